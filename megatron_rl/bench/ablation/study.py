"""Does off-policy correction matter as the lag grows? An ablation on the arithmetic task.

    python -m megatron_rl.bench ablation [--quick] [--lags 0 1 2 4 8] [--losses aipo reinforce ppo tis icepop]
        [--seeds 1 2 3] [--train-iters N] [--eval-interval N] [--warmup-iters N] [--output-dir DIR]
        [--docs [--docs-dir DIR]] [-- extra train flags]

Every run is a real launch of the main example, examples/run_tiny_aipo.sh, itself (its flags are the one
definition of the recipe: task, model, learning rates, steps), with overrides: 2 processes (GPUS_PER_NODE=2,
trainer TP=1 + one built-in generator), --controlled-lag k (every batch trained exactly k weight versions after
the one that generated it, after a ramp of k steps; synchronous dispatch, --max-staleness k), --loss L, --seed s.
The script is copied into OUTPUT_DIR/recipe/ when the ablation starts and the copy is what runs, so that one
ablation has one recipe even while the example is being edited; resuming with a different example is refused.

The supervised warm-up is shared: once per seed a run without RL steps (--train-iters 0 --save-hf) exports the
warmed-up policy as HF weights (OUTPUT_DIR/warmup/seed<s>/hf/iter_0000000), and every RL run of that seed starts
from it (--load-hf, --sft-warmup-iters 0), so the runs of a seed differ only in lag and loss. Unlike the example's
own run, RL then starts with a fresh Adam state (the export holds weights only).

Resumable: a run whose eval.json exists is not run again (its recorded flags must be the ones this invocation
would use). A failure before any RL run has succeeded stops the ablation (the setup is broken); later failures are
recorded in summary.json, the grid goes on, and the exit status is 1.

Writes OUTPUT_DIR/lag<k>/<loss>/seed<s>/ (each run's metrics.jsonl, eval.json, run.log, ablation_run.json),
OUTPUT_DIR/summary.json (summary.py: the rules), and with --docs DOCS_DIR/ablations.md and
ablations.png (report.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

from megatron_rl.bench.ablation import report, summary
from megatron_rl.bench.example import EXAMPLE, LAUNCH_COMMON, ROOT, child_env

FULL = {"lags": [0, 1, 2, 4, 8], "losses": ["aipo", "reinforce", "ppo", "tis", "icepop"], "seeds": [1, 2, 3],
        "train_iters": None, "eval_interval": 10, "warmup_iters": None, "output_dir": "outputs/ablation"}
QUICK = {"lags": [0, 2], "losses": ["aipo", "reinforce"], "seeds": [1], "train_iters": 6, "eval_interval": 3,
         "warmup_iters": 20, "output_dir": "outputs/ablation-quick"}
# Flags the ablation sets on every run; after `--` they would silently change the grid.
OWN_FLAGS = ("--controlled-lag", "--loss", "--seed", "--load-hf", "--save-hf", "--sft-warmup-iters", "--train-iters",
             "--eval-interval", "--async-mode", "--max-staleness", "--output-dir", "--tensor-model-parallel-size",
             "--load", "--load-megatron", "--dry-run")


class AblationError(RuntimeError):
    """The ablation cannot go on (a run failed where that says the setup is broken, or a resume would mix runs)."""


class RunFailed(AblationError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.bench ablation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke check of a few minutes: lags 0 2, losses aipo reinforce, seed 1, 6 RL steps, a "
                        "20-step warm-up (explicit flags still win)")
    p.add_argument("--lags", type=int, nargs="+", help=f"controlled lags (default {FULL['lags']})")
    p.add_argument("--losses", nargs="+", help=f"--loss values (default {FULL['losses']})")
    p.add_argument("--seeds", type=int, nargs="+", help=f"seeds (default {FULL['seeds']})")
    p.add_argument("--train-iters", type=int, help="RL steps per run (default: the example's)")
    p.add_argument("--eval-interval", type=int,
                   help=f"RL steps between held-out evaluations (default {FULL['eval_interval']}); they give the time "
                        "to the target accuracy and the instability events")
    p.add_argument("--warmup-iters", type=int, help="supervised warm-up steps (default: the example's)")
    p.add_argument("--output-dir", help=f"default {FULL['output_dir']} ({QUICK['output_dir']} with --quick)")
    p.add_argument("--docs", action="store_true", help="write ablations.md and ablations.png into --docs-dir")
    p.add_argument("--docs-dir", default=os.path.join(ROOT, "docs"), help="default: the repository's docs/")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The ablation's options (missing ones from the full or --quick grid) and the train flags after `--`."""
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(own)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.extra = extra
    args.lags = sorted(args.lags)
    problem = grid_problem(args)
    if problem:
        parser.error(problem)
    args.output_dir = os.path.abspath(args.output_dir)
    return args


def grid_problem(args: argparse.Namespace) -> str | None:
    """Why the grid cannot run as asked (None if it can)."""
    from megatron_rl.algorithms import policy_losses

    unknown = [loss for loss in args.losses if loss not in policy_losses()]
    if unknown:
        return f"--losses {unknown}: unknown; choose from {policy_losses()}"
    if min(args.lags) < 0:
        return f"--lags must be >= 0, got {args.lags}"
    for name in ("lags", "losses", "seeds"):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            return f"--{name} repeats a value: {values}"
    if args.eval_interval < 1:
        return f"--eval-interval must be >= 1, got {args.eval_interval}"
    if args.train_iters is not None and args.train_iters < 1:
        return f"--train-iters must be >= 1, got {args.train_iters}"
    if args.warmup_iters is not None and args.warmup_iters < 0:
        return f"--warmup-iters must be >= 0, got {args.warmup_iters}"
    own = sorted({f.split("=")[0] for f in args.extra if f.split("=")[0] in OWN_FLAGS})
    if own:
        return (f"{', '.join(own)} after `--`: the ablation sets these on every run (use --lags, --losses, --seeds, "
                "--train-iters, --eval-interval, --warmup-iters)")
    return None


# ---- the recipe and the runs ---------------------------------------------------------------------------------------

def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def snapshot_recipe(output_dir: str) -> str:
    """Copy the example script into OUTPUT_DIR/recipe/ (once: a resumed ablation keeps its recipe, and refuses an
    example that changed since) with launch_common.sh beside it; returns the copy's path."""
    if not os.path.isfile(EXAMPLE):
        raise AblationError(f"{EXAMPLE}: the example script is missing (the ablation runs from a checkout)")
    recipe_dir = os.path.join(output_dir, "recipe")
    copy = os.path.join(recipe_dir, os.path.basename(EXAMPLE))
    if os.path.isfile(copy) and sha256(copy) != sha256(EXAMPLE):
        raise AblationError(f"{EXAMPLE} changed since this ablation started in {output_dir} (its copy: {copy}); "
                           "finish it with the old recipe by restoring the script, or start a new --output-dir")
    os.makedirs(recipe_dir, exist_ok=True)
    if not os.path.isfile(copy):
        shutil.copy2(EXAMPLE, copy)
    shutil.copy2(LAUNCH_COMMON, os.path.join(recipe_dir, os.path.basename(LAUNCH_COMMON)))
    return copy


def warmup_dir(output_dir: str, seed: int) -> str:
    return os.path.join(output_dir, "warmup", f"seed{seed}")


def warmup_export(output_dir: str, seed: int) -> str:
    """Where the warm-up run of `seed` exports its policy: --save-hf's step-0 iteration."""
    return os.path.join(warmup_dir(output_dir, seed), "hf", "iter_0000000")


def run_dir(output_dir: str, lag: int, loss: str, seed: int) -> str:
    return os.path.join(output_dir, f"lag{lag}", loss, f"seed{seed}")


def warmup_flags(args: argparse.Namespace, seed: int) -> list[str]:
    warmup = ["--sft-warmup-iters", str(args.warmup_iters)] if args.warmup_iters is not None else []
    return ["--tensor-model-parallel-size", "1", *args.extra, "--seed", str(seed), "--train-iters", "0", *warmup,
            "--save-hf", os.path.dirname(warmup_export(args.output_dir, seed))]


def rl_flags(args: argparse.Namespace, lag: int, loss: str, seed: int) -> list[str]:
    iters = ["--train-iters", str(args.train_iters)] if args.train_iters else []
    return ["--tensor-model-parallel-size", "1", *args.extra, "--controlled-lag", str(lag), "--async-mode", "off",
            "--max-staleness", str(lag), "--loss", loss, "--seed", str(seed), "--load-hf",
            warmup_export(args.output_dir, seed), "--sft-warmup-iters", "0", *iters,
            "--eval-interval", str(args.eval_interval)]


def run_record(script: str, flags: list[str], output_dir: str) -> dict:
    """What identifies a run: the recipe and its flags, paths relative to the output directory."""
    return {"recipe_sha256": sha256(script),
            "flags": [f.replace(output_dir, "<output-dir>") for f in flags]}


def is_done(out_dir: str, record: dict) -> bool:
    """Whether the run finished (its eval.json exists) with this record; a finished run of other flags is refused."""
    if not os.path.isfile(os.path.join(out_dir, "eval.json")):
        return False
    path = os.path.join(out_dir, "ablation_run.json")
    recorded = {}
    if os.path.isfile(path):
        with open(path) as f:
            recorded = json.load(f)
    if {k: recorded.get(k) for k in record} != record:
        raise AblationError(f"{out_dir} holds a finished run of other flags or another recipe ({path}: "
                           f"{recorded.get('flags')}); this invocation would run {record['flags']}. Use another "
                           "--output-dir, or remove that run")
    return True


def launch(script: str, out_dir: str, flags: list[str], record: dict) -> float:
    """Run the example once into `out_dir` (its output in run.log); returns the wall seconds. Raises RunFailed
    unless the script exits cleanly having written eval.json."""
    os.makedirs(out_dir, exist_ok=True)
    for name in ("eval.json", "metrics.jsonl"):  # a previous, interrupted attempt's
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))
    log_path = os.path.join(out_dir, "run.log")
    command = ["bash", script, *flags]
    write_record(out_dir, {**record, "command": shlex.join(command)})
    start = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=child_env(out_dir)).returncode
    seconds = time.time() - start
    if rc != 0 or not os.path.isfile(os.path.join(out_dir, "eval.json")):
        with open(log_path) as f:
            tail = f.read()[-2000:]
        raise RunFailed(f"{out_dir}: exit status {rc}{'' if rc else ' without eval.json'}; {log_path} ends:\n{tail}")
    write_record(out_dir, {**record, "command": shlex.join(command), "launch_seconds": seconds})
    return seconds


def write_record(out_dir: str, record: dict) -> None:
    with open(os.path.join(out_dir, "ablation_run.json"), "w") as f:
        json.dump(record, f, indent=2)


# ---- progress ------------------------------------------------------------------------------------------------------

class Progress:
    """One line per run: how many of all are done, this invocation's rate and the ETA (each remaining run at the
    mean duration of the runs of its kind launched so far)."""

    def __init__(self, total: int, remaining: dict[str, int]):
        self.total, self.remaining, self.done, self.start = total, dict(remaining), 0, time.time()
        self.seconds: dict[str, list[float]] = {"warm-up": [], "RL": []}

    def skipped(self, kind: str, label: str) -> None:
        self.done += 1
        self.remaining[kind] -= 1
        print(f"[ablation] {self.done}/{self.total} {label}: done before (eval.json), not run again", flush=True)

    def finished(self, kind: str, label: str, seconds: float | None, result: str) -> None:
        self.done += 1
        self.remaining[kind] -= 1
        if seconds is not None:
            self.seconds[kind].append(seconds)
        launched = sum(map(len, self.seconds.values()))
        rate = launched / (time.time() - self.start) * 60
        took = f"{seconds:.0f} s" if seconds is not None else "failed"
        print(f"[ablation] {self.done}/{self.total} {label}: {took}, {result} | {rate:.2f} runs/min | "
              f"ETA {format_seconds(self.eta())}", flush=True)

    def eta(self) -> float:
        every = [s for v in self.seconds.values() for s in v]
        fallback = sum(every) / len(every) if every else 0.0
        mean = {k: sum(v) / len(v) if v else fallback for k, v in self.seconds.items()}
        return sum(mean[k] * n for k, n in self.remaining.items())


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# ---- the grid ------------------------------------------------------------------------------------------------------

def run_grid(args: argparse.Namespace, script: str) -> dict:
    """Every warm-up and RL run of the grid, seed by seed (an interrupted ablation has whole seeds first);
    returns {"warmups": {seed: record}, "runs": {(lag, loss, seed): record}, "failed": [...]}."""
    cells = [(lag, loss) for lag in args.lags for loss in args.losses]
    progress = Progress(len(args.seeds) * (1 + len(cells)), {"warm-up": len(args.seeds),
                                                             "RL": len(args.seeds) * len(cells)})
    out = {"warmups": {}, "runs": {}, "failed": []}
    for seed in args.seeds:
        try:
            out["warmups"][seed] = run_one(args, script, progress, "warm-up", f"warm-up seed {seed}",
                                           warmup_dir(args.output_dir, seed), warmup_flags(args, seed))
        except RunFailed as e:
            if not out["runs"]:
                raise
            print(f"[ablation] warm-up seed {seed} failed, its runs are skipped: {e}", file=sys.stderr, flush=True)
            out["failed"] += [{"lag": lag, "loss": loss, "seed": seed,
                               "log": os.path.join(warmup_dir(args.output_dir, seed), "run.log")}
                              for lag, loss in cells]
            continue
        for lag, loss in cells:
            label = f"lag {lag} {loss} seed {seed}"
            try:
                out["runs"][(lag, loss, seed)] = run_one(args, script, progress, "RL", label,
                                                         run_dir(args.output_dir, lag, loss, seed),
                                                         rl_flags(args, lag, loss, seed))
            except RunFailed as e:
                if not out["runs"]:
                    raise
                print(f"[ablation] {label} failed, going on: {e}", file=sys.stderr, flush=True)
                progress.finished("RL", label, None, "recorded in summary.json")
                out["failed"].append({"lag": lag, "loss": loss, "seed": seed,
                                      "log": os.path.join(run_dir(args.output_dir, lag, loss, seed), "run.log")})
    return out


def run_one(args, script: str, progress: Progress, kind: str, label: str, out_dir: str, flags: list[str]) -> dict:
    """Launch one run unless it is done; returns its ablation_run.json."""
    record = run_record(script, flags, args.output_dir)
    if is_done(out_dir, record):
        progress.skipped(kind, label)
    else:
        seconds = launch(script, out_dir, flags, record)
        with open(os.path.join(out_dir, "eval.json")) as f:
            evaluation = json.load(f)
        progress.finished(kind, label, seconds, f"held-out {accuracy_text(evaluation)}")
    with open(os.path.join(out_dir, "ablation_run.json")) as f:
        return json.load(f)


def accuracy_text(evaluation: dict) -> str:
    before, after = evaluation.get("accuracy_before_rl"), evaluation.get("accuracy_after_rl")
    fmt = lambda a: "n/a" if a is None else f"{a:.3f}"  # noqa: E731
    return fmt(before) if evaluation.get("train_iters") == 0 else f"{fmt(before)} -> {fmt(after)}"


# ---- the summary ---------------------------------------------------------------------------------------------------

def machine() -> dict:
    """The machine the numbers come from (wall times depend on it and on what else it ran)."""
    import platform

    import torch

    model = None
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "cpu_cores": os.cpu_count(), "gpu": gpu, "system": f"{platform.system()} "
            f"{platform.machine()}", "python": platform.python_version(), "torch": torch.__version__}


def git_commit() -> str | None:
    """The checkout's commit, marked when the checkout has uncommitted changes; None outside git."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    return f"{commit} (with uncommitted changes)" if commit and dirty.stdout.strip() else commit or None


def build_summary(args: argparse.Namespace, argv: list[str], script: str, grid: dict, context: dict) -> dict:
    """summary.json: the grid, the rules, every run's figures and every cell's over seeds, the cost."""
    from megatron_rl.rollout.sglang.arguments import redact_argv

    runs = []
    for (lag, loss, seed), record in grid["runs"].items():
        directory = run_dir(args.output_dir, lag, loss, seed)
        figures = summary.summarize_run(summary.read_records(directory), lag)
        runs.append({"lag": lag, "loss": loss, "seed": seed, "dir": directory,
                     "launch_seconds": record.get("launch_seconds"), **figures})
    cells = []
    for lag in args.lags:
        for loss in args.losses:
            members = [r for r in runs if (r["lag"], r["loss"]) == (lag, loss)]
            if members:
                cells.append({"lag": lag, "loss": loss, **summary.summarize_cell(members)})
    warmups = {}
    for seed, record in grid["warmups"].items():
        with open(os.path.join(warmup_dir(args.output_dir, seed), "eval.json")) as f:
            warmups[str(seed)] = {"dir": warmup_dir(args.output_dir, seed), "accuracy": json.load(f)
                                  ["accuracy_before_rl"], "launch_seconds": record.get("launch_seconds")}
    spread = summary.spread
    return {
        "command": shlex.join(["python", "-m", "megatron_rl.bench", "ablation", *redact_argv(argv)]),
        "git_commit": context["commit"],
        "recipe": {"example": os.path.relpath(EXAMPLE, ROOT), "copy": script, "sha256": sha256(script)},
        "machine": context["machine"],
        "load_average": context["load_average"],
        "grid": {"lags": args.lags, "losses": args.losses, "seeds": args.seeds, "train_iters": args.train_iters,
                 "eval_interval": args.eval_interval, "warmup_iters": args.warmup_iters,
                 "extra_flags": redact_argv(args.extra),
                 "quick": args.quick},
        "target_accuracy": summary.TARGET_ACCURACY,
        "rules": {"time_to_target": summary.TARGET_RULE, "instability": summary.INSTABILITY_RULE,
                  "off_policy_statistics": summary.LAGGED_STEPS_RULE},
        "distinct_problems": sorted({r["distinct_problems"] for r in runs if r["distinct_problems"] is not None}),
        "warmups": warmups,
        "cells": cells,
        "runs": runs,
        "failed": grid["failed"],
        "cost": {"wall_seconds": context["wall_seconds"],
                 "launch_seconds_total": sum(w["launch_seconds"] or 0 for w in warmups.values()) +
                 sum(r["launch_seconds"] or 0 for r in runs),
                 "warmup_launch_seconds": spread(w["launch_seconds"] for w in warmups.values()),
                 "rl_launch_seconds": spread(r["launch_seconds"] for r in runs),
                 "seconds_per_rl_step": spread(r["seconds_per_step"] for r in runs)},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start, load_before = time.time(), os.getloadavg()
    try:
        script = snapshot_recipe(args.output_dir)
        print(f"[ablation] lags {args.lags} x losses {args.losses} x seeds {args.seeds} into {args.output_dir}; "
              f"recipe {script}", flush=True)
        grid = run_grid(args, script)
    except AblationError as e:
        print(f"[ablation] error: {e}", file=sys.stderr, flush=True)
        return 1
    context = {"commit": git_commit(), "machine": machine(), "wall_seconds": time.time() - start,
               "load_average": {"start": list(load_before), "end": list(os.getloadavg())}}
    summary = build_summary(args, argv, script, grid, context)
    path = os.path.join(args.output_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
    print(f"[ablation] {path}", flush=True)
    if args.docs:
        for written in report.write_docs(summary, args.docs_dir):
            print(f"[ablation] {written}", flush=True)
    if grid["failed"]:
        print(f"[ablation] {len(grid['failed'])} run(s) failed: "
              f"{', '.join(f['log'] for f in grid['failed'])}", file=sys.stderr, flush=True)
        return 1
    return 0
