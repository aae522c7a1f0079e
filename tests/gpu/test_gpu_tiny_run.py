"""The tiny RL example on one GPU: a trainer rank and a generator rank share the GPU (the trainer at TP=1), so DDMA
takes the CPU-staged gloo path (NCCL refuses two ranks on one device) and the log names that choice; held-out
accuracy rises as on the CPU."""

import json
import os
import subprocess
import sys

from helpers import ROOT


def test_tiny_example_learns_on_one_gpu(tmp_path):
    env = {**os.environ, "OUTPUT_DIR": str(tmp_path), "GPUS_PER_NODE": "2", "MASTER_PORT": "29611",
           "PYTHON": sys.executable}
    run = subprocess.run(["bash", "examples/run_tiny_aipo.sh", "--tensor-model-parallel-size", "1",
                          "--sft-warmup-iters", "200", "--train-iters", "60", "--eval-size", "200"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "DDMA transport: staged" in run.stdout + run.stderr
    with open(tmp_path / "eval.json") as f:
        result = json.load(f)
    assert result["accuracy_after_rl"] > result["accuracy_before_rl"], result
