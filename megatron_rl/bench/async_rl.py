"""Asynchronous vs synchronous RL step time on the same model and batch, with the theoretical bound.

Runs of `megatron_rl.train` (one trainer process, one generator process, the tiny model, no warm-up) with
--async-mode alternate: blocks of asynchronous and synchronous steps in turn within one run, so that both kinds
meet the same machine (this one's speed drifts by 10-20 % over tens of seconds: other tenants of the host),
with the first steps of each block (the switch-over) left out. Two processes, so that on the 2-core machine
each role has a core of its own, as on a cluster each has its own GPUs: the bound below assumes generation and
training can run at the same time. From the synchronous steps, each a generation phase (generate, score, wait)
followed by a training phase (train + weight sync): t_train = the training phase, t_gen = the rest.
Overlapping the two phases cannot make a step shorter than the longer one, so the bound on the speed-up is
(t_gen + t_train) / max(t_gen, t_train). All runs keep uniform-reward groups so that every step trains on
exactly one batch (no dynamic re-sampling), which keeps the work per step equal.

Asynchronous steps are measured with both pause modes, one run each: "retract" (the default) recomputes the KV
cache of every request in flight at a weight update, work the synchronous steps never do (on a CPU a prefill
costs about as much per token as decoding); "in_place" keeps it. Each run gives its own bound and speed-up;
the result is the median over runs, every run's values beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile


def _run(out_dir: str, iters: int, block: int, pause_mode: str) -> list[dict]:
    from megatron_rl.runtime.spawn import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "megatron_rl.train", "--tensor-model-parallel-size", "1", "--train-iters", str(iters),
           "--global-batch-size", "64", "--micro-batch-size", "32", "--n-samples-per-prompt", "4",
           "--rollout-max-response-len", "16", "--task-max-digits", "2", "--eval-size", "4", "--keep-uniform-groups",
           "--reward-num-workers", "1", "--async-mode", "alternate", "--async-alternate-steps", str(block),
           "--max-staleness", "1", "--rollout-pause-mode", pause_mode, "--output-dir", out_dir]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise RuntimeError(f"{pause_mode} run failed:\n{r.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_result(rows: list[dict], block: int, skip: int) -> dict:
    """The bound and the asynchronous speed-up from one run's steps (the first `skip` of each block left out)."""
    kept = [r for r in rows if "perf" in r and (r["step"] - 1) % block >= skip]  # RL steps, not evaluations
    sync, async_ = [r for r in kept if not r["perf"]["async"]], [r for r in kept if r["perf"]["async"]]
    mean = lambda rows, f: sum(f(r) for r in rows) / len(rows)  # noqa: E731
    t_sync = mean(sync, lambda r: r["perf"]["step_time_s"])
    t_train = mean(sync, lambda r: r["perf"]["train_s"] + r["perf"]["sync_s"])
    t_gen = t_sync - t_train
    bound = t_sync / max(t_gen, t_train)
    t_async = mean(async_, lambda r: r["perf"]["step_time_s"])
    return {"sync_step_s": t_sync, "t_gen_s": t_gen, "t_train_s": t_train, "bound": bound, "async_step_s": t_async,
            "speedup": t_sync / t_async, "fraction_of_bound": t_sync / t_async / bound,
            "retracted_fraction": mean(async_, lambda r: r["rollout"]["retracted_fraction"]),
            "steps_measured": {"sync": len(sync), "async": len(async_)}}


def run(quick: bool = False) -> dict:
    # Steps per block, and how many of each block's first steps are left out: switching from synchronous to
    # asynchronous steps makes the generator produce two batches back to back, and with "retract" the update
    # that lands in the middle of the second can delay a third.
    block, skip = 8, 3
    iters, rounds = (6 * block, 2) if quick else (10 * block, 3)
    runs: dict[str, list[dict]] = {"retract": [], "in_place": []}
    with tempfile.TemporaryDirectory() as d:
        for k in range(rounds):
            for pause in runs:
                runs[pause].append(_run_result(_run(os.path.join(d, f"{pause}{k}"), iters, block, pause), block, skip))
    median = lambda pause, key: statistics.median(r[key] for r in runs[pause])  # noqa: E731
    every = runs["retract"] + runs["in_place"]
    out = {key: statistics.median(r[key] for r in every) for key in ("sync_step_s", "t_gen_s", "t_train_s", "bound")}
    for pause, suffix in (("retract", ""), ("in_place", "_in_place")):
        out.update({f"{key}{suffix}": median(pause, key)
                    for key in ("async_step_s", "speedup", "fraction_of_bound", "retracted_fraction")})
    out.update(runs_per_pause_mode=rounds, steps_per_run=iters, block=block,
               per_run={pause: [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rs]
                        for pause, rs in runs.items()})
    return out
