"""A chaos soak: the main example, killed with SIGKILL again and again, resumed each time, then accounted for.

    python -m megatron_rl.bench soak [--quick] [--kills N] [--train-iters T] [--seed S] [--sglang]
        [--keep-last-n-checkpoints K] [--output-dir DIR] [-- extra train flags]

The run is examples/run_tiny_aipo.sh at a tiny size (2 processes: a trainer and a built-in generator), saving a
checkpoint every step. Each attempt resumes from the latest checkpoint (--load) and is killed once, in turn one
of these ways (a seeded shuffle, so that every kind comes up as often as the others):

- at an exact point (MEGATRON_RL_FAILPOINT, megatron_rl/runtime/failpoints.py): `train` (after the backward pass, before
  the update), `publish` (a generator in the middle of DDMA), `generate` (a generator mid-decode),
  `checkpoint-partial` (a checkpoint written, not yet complete), `checkpoint-saved` (right after one completed);
- from outside, at a random moment once the attempt has logged a step: `kill-rank0` (the trainer and controller),
  `kill-rank1` (the generator), `kill-all` (every process of the run at once, as when a node is lost).

With --sglang the generator is a real SGLang server (--rollout-backend sglang, the SGLang tier's environment),
and in every attempt, once it has logged a step, the server is also SIGKILLed at a random moment (its whole
process group, as a crashed server): the generator restarts it, gives it the current weights and sends its lost
requests again, and the attempt goes on to its own kill.

After each kill it waits for the run's processes to be gone and counts those left behind (every process the run
starts carries a marker in its environment), and measures the disk used by the checkpoints. A last attempt runs to
the end. Then `megatron_rl.observability.accounting` checks, from the run's own records, that every prompt was
consumed once (or its samples generated again, with the reason), that no sample was trained on twice, that steps are
contiguous and weight versions advance one per step. Time lost per kill: from the kill (for a failpoint: the end
of the attempt, which follows it within torchrun's teardown) to the moment a later attempt logs a step beyond the
last one logged before the kill (restart, reload and redone steps, and any kill in between).

Writes OUTPUT_DIR/soak.json (and the run in OUTPUT_DIR/run, its checkpoints in OUTPUT_DIR/checkpoints, each
attempt's output in OUTPUT_DIR/attempt-NN.log); exits 1 if anything is unaccounted for or left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
import uuid

from megatron_rl.bench.example import EXAMPLE, child_env
from megatron_rl.checkpoint.rl_checkpoint import TRACKER_FILE
from megatron_rl.observability.accounting import account, read_jsonl
from megatron_rl.runtime import failpoints
from megatron_rl.runtime.lifetime import processes_with_env, wait_until_gone

MARKER = "MEGATRON_RL_SOAK"
POINTS = ("train", "publish", "generate", "checkpoint-partial", "checkpoint-saved")
EXTERNAL = ("kill-rank0", "kill-rank1", "kill-all")
RUN_FLAGS = ["--sft-warmup-iters", "2", "--eval-size", "8", "--eval-interval", "0", "--global-batch-size", "16",
             "--micro-batch-size", "8", "--rollout-max-response-len", "4", "--reward-num-workers", "1",
             "--save-interval", "1"]
GONE_TIMEOUT_S = 30.0  # for a killed run's processes to go (its watchers kill the rest within seconds)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 kills (a few minutes)")
    p.add_argument("--kills", type=int, help="SIGKILLs to deliver (default 20; 4 with --quick)")
    p.add_argument("--train-iters", type=int, help="RL steps of the run (default: 3 per kill + 6)")
    p.add_argument("--seed", type=int, default=0, help="of the kill schedule (the run's own seed is the example's)")
    p.add_argument("--sglang", action="store_true",
                   help="generate with a real SGLang server, and kill it once in every attempt")
    p.add_argument("--keep-last-n-checkpoints", type=int, default=2, help="the run's checkpoint retention (default 2)")
    p.add_argument("--output-dir", default=None, help="default outputs/soak (outputs/soak-quick with --quick)")
    return p


def rank_pids(token: str) -> dict[int, int]:
    """RANK -> pid of the run's rank processes: torchrun's workers (RANK in their environment), less the
    processes they fork (Megatron's checkpoint writers), which show the same command line and environment."""
    candidates = {}
    for pid in processes_with_env(MARKER, token):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                runs_train = b"megatron_rl.train" in f.read()  # not reward workers, the watcher, torchrun
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if runs_train and b"RANK" in env:
            candidates[pid] = (int(env[b"RANK"]), parent)
    return {rank: pid for pid, (rank, parent) in candidates.items() if parent not in candidates}


def server_pids(token: str) -> list[int]:
    """The run's SGLang servers (`sglang.launch_server` processes; not the processes they start)."""
    servers = []
    for pid in processes_with_env(MARKER, token):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"sglang.launch_server" in f.read() and os.getpgid(pid) == pid:  # it leads its process group
                    servers.append(pid)
        except OSError:
            continue
    return servers


def logged_step(metrics_path: str) -> int:
    """The last RL step in metrics.jsonl (0 before any)."""
    if not os.path.isfile(metrics_path):
        return 0
    return max((row["step"] for row in read_jsonl(metrics_path) if "rollout" in row), default=0)


def checkpoint_step(ckpt: str) -> int:
    try:
        with open(os.path.join(ckpt, TRACKER_FILE)) as f:
            return int(f.read().strip())
    except OSError:
        return 0


def disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files
               if os.path.isfile(os.path.join(d, f)))


def schedule(kills: int, seed: int) -> list[str]:
    """Kill kinds, each as often as the others (in a seeded order)."""
    kinds = list(POINTS + EXTERNAL)
    rng, order = random.Random(seed), []
    while len(order) < kills:
        rng.shuffle(kinds)
        order += kinds
    return order[:kills]


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = os.path.abspath(args.output_dir)
        self.run_dir, self.ckpt = os.path.join(self.out, "run"), os.path.join(self.out, "checkpoints")
        self.token = uuid.uuid4().hex
        self.rng = random.Random(args.seed)
        retention = ["--keep-last-n-checkpoints", str(args.keep_last_n_checkpoints)] \
            if args.keep_last_n_checkpoints else []
        backend = ["--rollout-backend", "sglang"] if args.sglang else []
        self.flags = [*RUN_FLAGS, "--train-iters", str(args.train_iters), "--save", self.ckpt, *retention,
                      *backend, *args.extra]
        self.records: list[dict] = []
        self.disk_max = 0
        self.pending_recovery: list[dict] = []  # kills whose loss is not made good yet (a later step not logged)

    def start(self, attempt: int, failpoint: str | None) -> tuple[subprocess.Popen, str]:
        env = {**child_env(self.run_dir), MARKER: self.token}
        if failpoint:
            env[failpoints.ENV] = failpoint
        flags = self.flags + (["--load", self.ckpt] if checkpoint_step(self.ckpt) else [])
        log_path = os.path.join(self.out, f"attempt-{attempt:02d}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(["bash", EXAMPLE, *flags], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        return proc, log_path

    def watch(self, proc: subprocess.Popen, until_step: int | None = None) -> int | None:
        """Follow the attempt until it exits (or, with `until_step`, logs a step beyond it); note when the previous
        kill's loss is made good. Returns the exit code, or None when `until_step` was passed first."""
        metrics = os.path.join(self.run_dir, "metrics.jsonl")
        while True:
            step = logged_step(metrics)
            for kill in [k for k in self.pending_recovery if step > k["last_step_logged"]]:
                kill["seconds_lost"] = round(time.time() - kill["killed_at"], 2)
                self.pending_recovery.remove(kill)
            if until_step is not None and step > until_step:
                return None
            if proc.poll() is not None:
                return proc.returncode
            time.sleep(0.1)

    def kill_server(self, proc: subprocess.Popen, last_logged: int) -> int | None:
        """Once the attempt has logged a step beyond `last_logged`, SIGKILL its SGLang server's process group at a
        random moment of the next steps. Returns the last step logged at the kill, or None if the attempt ended
        (at its failpoint) first."""
        if self.watch(proc, until_step=last_logged) is not None:
            return None
        time.sleep(self.rng.uniform(0.0, 2.0))
        servers = server_pids(self.token)
        if not servers:
            raise RuntimeError("--sglang: no SGLang server found in a run that logs steps")
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        return logged_step(os.path.join(self.run_dir, "metrics.jsonl"))

    def kill_from_outside(self, proc: subprocess.Popen, kind: str, last_logged: int) -> float | None:
        """Once the attempt has logged a step beyond `last_logged` (the last step logged before it: a resumed run
        first redoes the steps after its checkpoint), wait a random moment of the next steps (generation,
        training, DDMA) and SIGKILL the rank `kind` names, or every process of the run (`kill-all`). Returns the
        time of the kill, or None if the attempt ended first."""
        if self.watch(proc, until_step=last_logged) is not None:
            return None
        time.sleep(self.rng.uniform(0.0, 2.0))
        killed_at = time.time()
        if kind == "kill-all":  # as a lost node: every process, including any started meanwhile
            deadline = time.monotonic() + GONE_TIMEOUT_S
            while (victims := processes_with_env(MARKER, self.token)) and time.monotonic() < deadline:
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.05)
            return killed_at
        rank = int(kind[-1])
        pid = rank_pids(self.token).get(rank)
        if pid is None:
            raise RuntimeError(f"{kind}: no process of rank {rank} found in a run that logs steps")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return killed_at

    def attempt(self, number: int, kind: str | None) -> dict:
        resumed_from = checkpoint_step(self.ckpt)
        last_logged = logged_step(os.path.join(self.run_dir, "metrics.jsonl"))
        target = None
        if kind in POINTS:  # a step a little past the checkpoint; train/publish/generate count weight versions
            step = min(resumed_from + self.rng.randint(1, 3), self.args.train_iters - 2)
            target = step if kind.startswith("checkpoint") else step + 1
        failpoint = f"{kind}:{target}" if target is not None else None
        start = time.time()
        proc, log_path = self.start(number, failpoint)
        server_killed_at_step = self.kill_server(proc, last_logged) if self.args.sglang else None
        killed_at = None
        if kind in EXTERNAL:  # after the server kill, once the attempt has logged a step since
            killed_at = self.kill_from_outside(proc, kind, max(last_logged, server_killed_at_step or 0))
        code = self.watch(proc)
        ended_at = time.time()
        killed_at = killed_at or ended_at  # a failpoint: the rank killed itself just before the attempt ended
        left = wait_until_gone(MARKER, self.token, GONE_TIMEOUT_S)
        self.disk_max = max(self.disk_max, disk_bytes(self.ckpt))
        record = {"attempt": number, "kill": failpoint or kind, "resumed_from": resumed_from, "exit_code": code,
                  "last_step_logged": logged_step(os.path.join(self.run_dir, "metrics.jsonl")),
                  "seconds": round(ended_at - start, 1), "processes_left": left, "log": log_path,
                  "server_killed_at_step": server_killed_at_step}
        if kind is None:
            if code != 0:
                raise RuntimeError(f"the last attempt (no kill) failed with exit code {code}; see {log_path}")
        elif code == 0 or os.path.isfile(os.path.join(self.run_dir, "eval.json")):
            raise RuntimeError(f"attempt {number}: the run finished before the kill {failpoint or kind} landed; "
                               f"see {log_path}")
        else:
            record["killed_at"] = killed_at
            self.pending_recovery.append(record)
        self.records.append(record)
        return record

    def run(self) -> dict:
        shutil.rmtree(self.out, ignore_errors=True)
        os.makedirs(self.out)
        kinds = schedule(self.args.kills, self.args.seed)
        begin = time.time()
        for i, kind in enumerate(kinds + [None], start=1):
            record = self.attempt(i, kind)
            rate = (time.time() - begin) / i
            print(f"[soak] attempt {i}/{len(kinds) + 1}: {record['kill'] or 'to the end'}, resumed from step "
                  f"{record['resumed_from']}, exit {record['exit_code']}, {len(record['processes_left'])} processes "
                  f"left | {record['seconds']:.0f} s | ETA {rate * (len(kinds) + 1 - i) / 60:.1f} min", flush=True)
        figures = account(self.run_dir)
        lost = [r["seconds_lost"] for r in self.records if "seconds_lost" in r]
        iteration = os.path.join(self.ckpt, f"iter_{self.args.train_iters:07d}")
        report = {
            "command": " ".join(["python -m megatron_rl.bench soak", *self.args.argv]),
            "kills": len(kinds), "kinds": {k: kinds.count(k) for k in dict.fromkeys(kinds)},
            "train_iters": self.args.train_iters, "wall_seconds": round(time.time() - begin, 1),
            "seconds_lost_per_kill": {"mean": round(sum(lost) / len(lost), 1), "max": max(lost)} if lost else None,
            "processes_left": sum(len(r["processes_left"]) for r in self.records),
            "checkpoint_disk_max_bytes": self.disk_max, "checkpoint_bytes": disk_bytes(iteration),
            "keep_last_n_checkpoints": self.args.keep_last_n_checkpoints,
            "server_kills": sum(r["server_killed_at_step"] is not None for r in self.records),
            "accounting": figures, "attempts": self.records,
        }
        with open(os.path.join(self.out, "soak.json"), "w") as f:
            json.dump(report, f, indent=1)
        return report


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.extra, args.argv = extra, argv
    args.kills = args.kills if args.kills is not None else (4 if args.quick else 20)
    if args.kills < 1:
        build_parser().error(f"--kills must be >= 1, got {args.kills}")
    args.train_iters = args.train_iters or 3 * args.kills + 6
    args.output_dir = args.output_dir or os.path.join("outputs", "soak-quick" if args.quick else "soak")
    report = Soak(args).run()
    summary = {k: report[k] for k in ("kills", "wall_seconds", "seconds_lost_per_kill", "processes_left",
                                      "checkpoint_disk_max_bytes", "checkpoint_bytes")}
    print(json.dumps({**summary, "problems": report["accounting"]["problems"]}), flush=True)
    return 1 if report["accounting"]["problems"] or report["processes_left"] else 0
