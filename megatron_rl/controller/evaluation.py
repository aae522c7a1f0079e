"""Evaluation sets: held-out prompts that the generators answer (greedy by default) before RL, every
--eval-interval steps and at the end, scored by the run's reward function.

A set is the arithmetic task's held-out split (when the run trains on the task) and each --eval-prompt-data
NAME PATH. Per set: `accuracy` (the fraction of scored samples whose reward is 1), `reward_mean`, and with
--eval-n-samples n > 1 `pass@n` (the fraction of problems with at least one correct sample). Samples whose reward
could not be computed (a timeout, a crashed scorer, an agent trajectory that failed) are excluded and counted in
`failures`, with their reasons in `failure_reasons`; a set with no scored sample reports its accuracy as null,
never NaN.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

MAX_REASONS = 5  # distinct failure reasons an evaluation keeps per set


@dataclasses.dataclass(frozen=True)
class EvalSet:
    name: str
    problems: list[dict]  # {"id", "prompt", "answer", ...}; ids are "<name>/<record id>", unique across sets
    source: dict | None = None  # where the problems come from (the task's space), reported in eval.json


def eval_sets(args, source) -> list[EvalSet]:
    """The run's evaluation sets: the task's held-out split (no --prompt-data), then --eval-prompt-data's."""
    sets = []
    if source.dataset is None and args.eval_size:
        sets.append(EvalSet("arithmetic", source.eval(args.eval_size), source.task.describe("eval")))
    pairs = args.eval_prompt_data or []
    for name, path in zip(pairs[::2], pairs[1::2]):
        sets.append(EvalSet(name, read_records(path, args)))
    for s in sets:
        s.problems[:] = [dict(p, id=f"{s.name}/{p['id']}") for p in s.problems]
    return sets


def read_records(path: str, args) -> list[dict]:
    """Every record of an evaluation file, in file order, validated like training data."""
    from megatron_rl.controller.prompt_source import open_prompt_data

    dataset = open_prompt_data(path, args, flag="--eval-prompt-data", shuffle=False)
    return [dataset.record(i) for i in range(len(dataset))]


def summarize(eval_set: EvalSet, results: dict, n_samples: int) -> dict:
    """One set's figures from `results`: (prompt id, sample index) -> RewardResult."""
    scored, failed, solved = [], [], 0
    for problem in eval_set.problems:
        rewards = [results[(problem["id"], k)] for k in range(n_samples)]
        ok = [r.reward for r in rewards if not r.is_failure]
        failed += [r for r in rewards if r.is_failure]
        scored += ok
        solved += any(r == 1.0 for r in ok)
    out = {"problems": len(eval_set.problems), "samples": len(eval_set.problems) * n_samples,
           "failures": len(failed), "failure_reasons": failure_reasons(failed),
           "accuracy": sum(r == 1.0 for r in scored) / len(scored) if scored else None,
           "reward_mean": sum(scored) / len(scored) if scored else None}
    if n_samples > 1:
        out[f"pass@{n_samples}"] = solved / len(eval_set.problems)
    return out


def failure_reasons(failed: list) -> list[dict]:
    """How many samples each reason kept from being scored, most frequent first: {"reason": "status: detail",
    "samples": n} for the MAX_REASONS most frequent, the rest as "other reasons". (A list: free text is no metric
    name for wandb or tensorboard.)"""
    reasons = Counter(f"{r.status}: {r.detail}" if r.detail else r.status for r in failed)
    out = [{"reason": reason, "samples": n} for reason, n in reasons.most_common(MAX_REASONS)]
    if len(reasons) > MAX_REASONS:
        out.append({"reason": "other reasons", "samples": sum(reasons.values()) - sum(r["samples"] for r in out)})
    return out


def describe(name: str, summary: dict) -> str:
    accuracy = "n/a" if summary["accuracy"] is None else f"{summary['accuracy']:.3f}"
    passes = "".join(f", {k} {v:.3f}" for k, v in summary.items() if k.startswith("pass@"))
    reasons = summary.get("failure_reasons")  # (absent from the evaluations of older checkpoints)
    failed = f", {summary['failures']} samples not scored" if summary["failures"] else ""
    failed += f", most for {reasons[0]['reason']}" if failed and reasons else ""
    return f"eval {name}: accuracy {accuracy}{passes} ({summary['problems']} problems x " \
           f"{summary['samples'] // summary['problems']} samples{failed})"


def report(history: list[dict], n_samples: int, temperature: float, eval_sets: list[EvalSet] = ()) -> dict:
    """eval.json's evaluations: per set, its figures before RL (the first evaluation), after RL (the last) and at
    every evaluation, how many of its problems are distinct and where they were drawn from; the first set's
    accuracies also as `accuracy_before_rl` / `accuracy_after_rl`."""
    names = [k for k in history[0] if k != "step"] if history else []
    sets = {name: {"n_samples": n_samples, "temperature": temperature, "before_rl": history[0][name],
                   "after_rl": history[-1][name], "history": [{"step": h["step"], **h[name]} for h in history]}
            for name in names}
    for s in eval_sets:
        if s.name in sets:
            sets[s.name].update(distinct_problems=len({str(p["prompt"]) for p in s.problems}),
                                **({"drawn_from": s.source} if s.source else {}))
    out: dict = {"eval_sets": sets}
    if names:
        first = sets[names[0]]
        out.update(accuracy_before_rl=first["before_rl"]["accuracy"], accuracy_after_rl=first["after_rl"]["accuracy"],
                   eval_set=names[0], eval_size=first["before_rl"]["problems"])
    return out
