"""What a run did with its prompts, from its own records: `account(output_dir)` reads the ledger
(rollouts.jsonl), the step metrics (metrics.jsonl) and the final report (eval.json) and checks that

- every RL prompt dispatch's samples were each trained on or discarded (with a reason) once, or the prompt is
  still in flight or held at the end (the counts eval.json reports); a prompt is dispatched again only after its
  previous dispatch was consumed (a file dataset's next epoch);
- samples lost in flight at a crash were generated again with the reason recorded (`resent` rows), and no
  sample was trained on twice;
- the ledger agrees with the controller's own state (the prompts it counts as dispatched, the samples it
  counts as consumed);
- every sample excluded has its reason: a discarded row names it, a sample whose reward could not be computed or
  whose agent trajectory failed is never trained on, a failed trajectory's row carries the failure's reason, and
  the failures each step counted are the ledger's;
- steps are contiguous from 1 and each publishes the next weight version (a skipped update, none).

Any run can be accounted for, crashed and resumed or not (a resume cuts both logs back to its checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter, defaultdict

from megatron_rl.rewards.types import EXCLUDED_STATUSES


def read_jsonl(path: str) -> list[dict]:
    """The rows of one of a run's JSONL logs, less a last line torn by a crash or still being written (the next
    resume drops such a line too)."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    rows = [json.loads(line) for line in lines[:-1]]
    with contextlib.suppress(json.JSONDecodeError):
        rows += [json.loads(line) for line in lines[-1:]]
    return rows


def account(output_dir: str) -> dict:
    """The figures (JSON-ready) and `problems`: one line per broken rule, empty when everything is accounted for."""
    missing = [name for name in ("rollouts.jsonl", "metrics.jsonl", "eval.json")
               if not os.path.isfile(os.path.join(output_dir, name))]
    if missing:  # eval.json is written last: a run that crashed and was not resumed has none
        return {"problems": [f"{output_dir}: no {', '.join(missing)}: not the output of a finished run"]}
    ledger = read_jsonl(os.path.join(output_dir, "rollouts.jsonl"))
    steps = [m for m in read_jsonl(os.path.join(output_dir, "metrics.jsonl")) if "rollout" in m]  # not evaluations
    with open(os.path.join(output_dir, "eval.json")) as f:
        final = json.load(f)
    problems = []

    # The ledger in order: a dispatch opens its prompt's samples, each is then consumed (trained on or discarded)
    # once. A prompt may be dispatched again once its samples are all consumed (a file dataset's next epoch).
    dispatches, pending, size = Counter(), {}, {}  # prompt id -> times dispatched; samples not yet consumed; of them
    again_in_flight, reused, strangers = set(), set(), set()
    for r in ledger:
        pid = r["prompt_id"]
        if r["event"] == "dispatched":
            if pending.get(pid):
                again_in_flight.add(pid)
            dispatches[pid] += 1
            pending[pid] = set(range(r["samples"])) if isinstance(r["samples"], int) else set(r["samples"])
            size[pid] = len(pending[pid])
        elif r["event"] in ("trained", "discarded"):
            if pid not in dispatches:
                strangers.add(pid)
            elif r["sample_index"] in pending[pid]:
                pending[pid].discard(r["sample_index"])
            else:
                reused.add((pid, r["sample_index"]))
    for what, found in (("prompts dispatched again while in flight", again_in_flight),
                        ("samples consumed more than once", reused),
                        ("prompts consumed but never dispatched", strangers)):
        if found:
            problems.append(f"{len(found)} {what} (e.g. {sorted(found)[:3]})")
    if len(dispatches) != final["prompts_dispatched"]:
        problems.append(f"the ledger has {len(dispatches)} prompts dispatched, the controller counted "
                        f"{final['prompts_dispatched']}")
    untouched = [pid for pid, left in pending.items() if left and len(left) == size[pid]]
    partial = sorted(pid for pid, left in pending.items() if left and pid not in untouched)
    if partial:
        problems.append(f"{len(partial)} prompts with only some samples consumed (e.g. {partial[:3]})")
    open_at_end = final["prompts_in_flight_at_end"] + final.get("prompts_held_at_end", 0)
    if len(untouched) != open_at_end:
        problems.append(f"{len(untouched) - open_at_end} prompts dispatched but neither consumed nor in flight or "
                        f"held at the end")

    consumed = [r for r in ledger if r["event"] in ("trained", "discarded")]
    trained = sum(r["event"] == "trained" for r in consumed)
    if steps and steps[-1]["train"]["consumed_samples"] != trained:
        problems.append(f"the ledger has {trained} samples trained on, the controller counted "
                        f"{steps[-1]['train']['consumed_samples']}")
    step_ids = [m["step"] for m in steps]
    if step_ids != list(range(1, len(steps) + 1)):
        problems.append(f"steps are not contiguous from 1: {step_ids}")
    # each step publishes a new version, but a skipped update (NaN/Inf gradient, counted in skipped_steps) none
    versions = [(m["train"]["weight_version"], m["train"].get("skipped_steps", 0)) for m in steps]
    if any(v1 - v0 != 1 - (s1 - s0) for (v0, s0), (v1, s1) in zip(versions, versions[1:])):
        problems.append(f"weight versions do not advance one per step (less skipped updates): {versions}")
    if final.get("train_iters") is not None and step_ids and step_ids[-1] != final["train_iters"]:
        problems.append(f"the last step logged is {step_ids[-1]}, the run was to take {final['train_iters']}")

    problems += _exclusion_problems(consumed, steps)
    resent = [r for r in ledger if r["event"] == "resent"]
    failed = [r for r in consumed if r.get("trajectory", {}).get("environment_failure")]
    return {
        "steps": len(steps), "prompts_dispatched": len(dispatches),
        "prompts_dispatched_again": sum(n > 1 for n in dispatches.values()),
        "prompt_dispatches_consumed": sum(dispatches.values()) - sum(bool(left) for left in pending.values()),
        "prompts_open_at_end": open_at_end, "samples_trained": trained,
        "samples_discarded": dict(Counter(r["outcome"] for r in consumed if r["event"] == "discarded")),
        "samples_generated_again": len(resent),
        "generated_again_reasons": dict(Counter(r["outcome"] for r in resent)),
        "agent_failures": dict(Counter(r["trajectory"].get("failure_kind") or "environment" for r in failed)),
        "problems": problems,
    }


def _exclusion_problems(consumed: list[dict], steps: list[dict]) -> list[str]:
    """Every sample excluded is excluded with a reason: a discarded row names its reason, a sample whose reward
    could not be computed (or whose agent trajectory failed) is never trained on, a failed trajectory's row carries
    the failure's reason, and the failures each step counted (`rollout.agent_failures`) are the ledger's."""
    problems = []
    unexplained = [(r["prompt_id"], r["sample_index"]) for r in consumed if r["event"] == "discarded"
                   and not r.get("outcome")]
    trained_failed = [(r["prompt_id"], r["sample_index"]) for r in consumed if r["event"] == "trained"
                      and r.get("reward_status") in EXCLUDED_STATUSES]
    silent = [(r["prompt_id"], r["sample_index"]) for r in consumed if r.get("reward_status") == "environment-failure"
              and not r.get("trajectory", {}).get("environment_failure")]
    for what, found in (("samples discarded without a reason", unexplained),
                        ("samples trained on whose reward could not be computed", trained_failed),
                        ("samples of a failed environment without the failure's reason", silent)):
        if found:
            problems.append(f"{len(found)} {what} (e.g. {found[:3]})")
    ledger_failures = defaultdict(Counter)
    for r in consumed:
        if r.get("trajectory", {}).get("environment_failure"):
            ledger_failures[r["step"]][r["trajectory"].get("failure_kind") or "environment"] += 1
    for m in steps:
        counted = m["rollout"].get("agent_failures")
        if counted is not None and Counter(counted) != ledger_failures[m["step"]]:
            problems.append(f"step {m['step']} counted the agent failures {counted}, the ledger has "
                            f"{dict(ledger_failures[m['step']])}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_rl.observability.accounting OUTPUT_DIR`: print the figures as JSON; exit 1 if anything
    is unaccounted for."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_rl.observability.accounting", description=main.__doc__)
    parser.add_argument("output_dir", help="a run's --output-dir (rollouts.jsonl, metrics.jsonl, eval.json)")
    figures = account(parser.parse_args(argv).output_dir)
    print(json.dumps(figures, indent=1))
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
