"""What a run did with its prompts, from its own records: `account(output_dir)` reads the ledger
(rollouts.jsonl), the step metrics (metrics.jsonl) and the final report (eval.json) and checks that

- every RL prompt was dispatched once, and each of its samples was trained on or discarded (with a reason) once,
  or is still in flight or held at the end (the counts eval.json reports);
- samples lost in flight at a crash were generated again with the reason recorded (`resent` rows), and no
  sample was trained on twice;
- the ledger agrees with the controller's own state (the prompts it counts as dispatched, the samples it
  counts as consumed);
- steps are contiguous from 1 and weight versions strictly increase.

Any run can be accounted for, crashed and resumed or not (a resume cuts both logs back to its checkpoint).
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def account(output_dir: str) -> dict:
    """The figures (JSON-ready) and `problems`: one line per broken rule, empty when everything is accounted for."""
    ledger = _rows(os.path.join(output_dir, "rollouts.jsonl"))
    steps = [m for m in _rows(os.path.join(output_dir, "metrics.jsonl")) if "rollout" in m]  # not evaluations
    with open(os.path.join(output_dir, "eval.json")) as f:
        final = json.load(f)
    problems = []

    dispatches = Counter(r["prompt_id"] for r in ledger if r["event"] == "dispatched")
    samples = {r["prompt_id"]: r["samples"] for r in ledger if r["event"] == "dispatched"}
    twice = sorted(pid for pid, n in dispatches.items() if n > 1)
    if twice:
        problems.append(f"{len(twice)} prompts dispatched more than once (e.g. {twice[:3]})")
    if len(dispatches) != final["prompts_dispatched"]:
        problems.append(f"the ledger has {len(dispatches)} prompts dispatched, the controller counted "
                        f"{final['prompts_dispatched']}")

    consumed = [r for r in ledger if r["event"] in ("trained", "discarded")]
    uses = Counter((r["prompt_id"], r["sample_index"]) for r in consumed)
    reused = sorted(key for key, n in uses.items() if n > 1)
    if reused:
        problems.append(f"{len(reused)} samples consumed more than once (e.g. {reused[:3]})")
    strangers = sorted({pid for pid, _ in uses} - set(dispatches))
    if strangers:
        problems.append(f"{len(strangers)} prompts consumed but never dispatched (e.g. {strangers[:3]})")
    by_prompt = defaultdict(set)
    for pid, k in uses:
        by_prompt[pid].add(k)
    complete = [pid for pid in dispatches if by_prompt[pid] == set(range(samples[pid]))]
    partial = sorted(pid for pid in dispatches if by_prompt[pid] and pid not in complete)
    if partial:
        problems.append(f"{len(partial)} prompts with only some samples consumed (e.g. {partial[:3]})")
    open_at_end = final["prompts_in_flight_at_end"] + final.get("prompts_held_at_end", 0)
    unaccounted = len(dispatches) - len(complete) - open_at_end
    if unaccounted:
        problems.append(f"{unaccounted} prompts dispatched but neither consumed nor in flight or held at the end")

    trained = sum(r["event"] == "trained" for r in consumed)
    if steps and steps[-1]["train"]["consumed_samples"] != trained:
        problems.append(f"the ledger has {trained} samples trained on, the controller counted "
                        f"{steps[-1]['train']['consumed_samples']}")
    step_ids = [m["step"] for m in steps]
    if step_ids != list(range(1, len(steps) + 1)):
        problems.append(f"steps are not contiguous from 1: {step_ids}")
    versions = [m["train"]["weight_version"] for m in steps]
    if any(b <= a for a, b in zip(versions, versions[1:])):
        problems.append(f"weight versions do not strictly increase: {versions}")
    if final.get("train_iters") is not None and step_ids and step_ids[-1] != final["train_iters"]:
        problems.append(f"the last step logged is {step_ids[-1]}, the run was to take {final['train_iters']}")

    resent = [r for r in ledger if r["event"] == "resent"]
    return {
        "steps": len(steps), "prompts_dispatched": len(dispatches), "prompts_consumed": len(complete),
        "prompts_open_at_end": open_at_end, "samples_trained": trained,
        "samples_discarded": dict(Counter(r["outcome"] for r in consumed if r["event"] == "discarded")),
        "samples_generated_again": len(resent),
        "generated_again_reasons": dict(Counter(r["outcome"] for r in resent)),
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_rl.accounting OUTPUT_DIR`: print the figures as JSON; exit 1 if anything is unaccounted
    for."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_rl.accounting", description=main.__doc__)
    parser.add_argument("output_dir", help="a run's --output-dir (rollouts.jsonl, metrics.jsonl, eval.json)")
    figures = account(parser.parse_args(argv).output_dir)
    print(json.dumps(figures, indent=1))
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
