"""The tiny example end to end with --rollout-backend sglang (a real SGLang server as the generator), whose
server is killed with SIGKILL mid-run: the generator restarts it, gives it the current weights, re-runs the
requests it lost, and the run finishes every step with every prompt consumed once.

Whether requests are in flight at the moment of the kill depends on timing (the generator may be paused for a
weight update or waiting on the lag bound), so the re-run count is not asserted here; a lost request that was
not re-run would leave its group unfinished and the run would not reach its last step. The re-run itself is
tested deterministically in test_sglang_engine.py."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from megatron_rl.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--sft-warmup-iters", "2", "--train-iters", "12", "--eval-size", "8", "--global-batch-size", "16",
         "--micro-batch-size", "8", "--rollout-max-response-len", "4", "--reward-num-workers", "1",
         "--log-rollouts", "--keep-uniform-groups", "--max-oversample", "2"]


def _rows(path):
    return [json.loads(line) for line in open(path) if line.strip()] if path.exists() else []


def _server_of(out):
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "sglang.launch_server" in cmd and str(out) in cmd:
            return p.pid
    return None


def test_tiny_run_on_sglang_survives_a_killed_server(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}  # this environment's torchrun
    log = tmp_path / "run.log"
    run = subprocess.Popen(["bash", "examples/run_tiny_aipo.sh", "--rollout-backend", "sglang", *SMALL], cwd=ROOT,
                           env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while len(_rows(out / "metrics.jsonl")) < 4:
            assert run.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        os.killpg(_server_of(out), signal.SIGKILL)  # the server and its scheduler/TP processes
        assert run.wait(900) == 0, log.read_text()[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    metrics = _rows(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert [m["weight_version"] for m in metrics] == list(range(2, 14))  # version 1: after the SFT warm-up
    assert metrics[-1]["generator_restarts"] == 1
    rollouts = _rows(out / "rollouts.jsonl")
    keys = [(r["prompt_id"], r["sample_index"]) for r in rollouts]
    assert len(keys) == len(set(keys)) and sum(r["outcome"] == "trained" for r in rollouts) == 16 * 12
    assert all(len(r["versions"]) == r["response_tokens"] for r in rollouts)
    assert json.loads((out / "eval.json").read_text())["prompts_dispatched_more_than_once"] == 0
    assert "SGLang server" in log.read_text() and "restart 1/3" in log.read_text()
