"""Asynchronous vs synchronous RL step time on the same model and batch, with the theoretical bound.

Short runs of `megatron_rl.train` (one trainer process, one generator process, the tiny model, no warm-up),
identical but for --async-mode and, in asynchronous mode, --rollout-pause-mode, repeated in alternation. Two
processes, so that on the 2-core machine each role has a core of its own, as on a cluster each has its own
GPUs: the bound below assumes generation and training can run at the same time. From the synchronous runs,
whose step is a generation phase (generate, score, wait) followed by a training phase (train + weight sync):
t_train = the training phase, t_gen = the rest. Overlapping the two phases cannot make a step shorter than
the longer one, so the bound on the speed-up is (t_gen + t_train) / max(t_gen, t_train). All runs keep
uniform-reward groups so that every step trains on exactly one batch (no dynamic re-sampling), which keeps
the work per step equal.

Asynchronous mode is measured with both pause modes: "retract" (the default) recomputes the KV cache of every
request in flight at a weight update, work the synchronous run never does (on a CPU a prefill costs about as
much per token as decoding); "in_place" keeps it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def _run(out_dir: str, mode: str, iters: int, pause_mode: str = "retract") -> list[dict]:
    from megatron_rl.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "megatron_rl.train", "--tensor-model-parallel-size", "1", "--train-iters", str(iters),
           "--global-batch-size", "64", "--micro-batch-size", "32", "--n-samples-per-prompt", "4",
           "--rollout-max-response-len", "16", "--task-max-digits", "2", "--eval-size", "4", "--keep-uniform-groups",
           "--reward-num-workers", "1",
           "--async-mode", mode, "--max-staleness", "1", "--rollout-pause-mode", pause_mode, "--output-dir", out_dir]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{r.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(quick: bool = False) -> dict:
    iters, rounds = (12, 2) if quick else (16, 3)
    skip = 2  # warm-up steps excluded from the means
    # The runs alternate (sync, async retract, async in-place; again ...) so that the machine's drift over the
    # minutes of the benchmark weighs on every mode alike; each mode's steps are pooled over the rounds.
    modes = {"sync": ("off", "retract"), "retract": ("on", "retract"), "in_place": ("on", "in_place")}
    steps: dict[str, list[dict]] = {name: [] for name in modes}
    with tempfile.TemporaryDirectory() as d:
        for k in range(rounds):
            for name, (async_mode, pause) in modes.items():
                steps[name] += _run(os.path.join(d, f"{name}{k}"), async_mode, iters, pause)[skip:]
    mean = lambda rows, f: sum(f(r) for r in rows) / len(rows)  # noqa: E731
    sync = steps["sync"]
    t_sync = mean(sync, lambda r: r["step_time_s"])
    t_train = mean(sync, lambda r: r["trainer_time"]["train_s"] + r["trainer_time"]["sync_s"])
    t_gen = t_sync - t_train
    bound = (t_gen + t_train) / max(t_gen, t_train)
    out = {"sync_step_s": t_sync, "t_gen_s": t_gen, "t_train_s": t_train, "bound": bound,
           "steps_measured_per_mode": len(sync), "rounds": rounds}
    for pause in ("retract", "in_place"):
        rows, suffix = steps[pause], "" if pause == "retract" else "_in_place"
        t_async = mean(rows, lambda r: r["step_time_s"])
        out.update({f"async_step_s{suffix}": t_async, f"speedup{suffix}": t_sync / t_async,
                    f"fraction_of_bound{suffix}": t_sync / t_async / bound,
                    f"retracted_fraction{suffix}": mean(rows, lambda r: r["retracted_fraction"])})
    return out
