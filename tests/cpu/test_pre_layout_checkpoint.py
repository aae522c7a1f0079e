"""An RL checkpoint written before the package layout changed (data/pre_layout_rl_checkpoint/, by commit 9fe99fa)
resumes to the parameters that commit resumed it to, and converts to the same HF weights bit for bit."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from safetensors.torch import load_file

from megatron_rl.runtime.spawn import free_port

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pre_layout_rl_checkpoint")
FLAGS = ["--model", "tiny-arith", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-layers", "2",
         "--num-attention-heads", "2", "--group-query-attention", "--num-query-groups", "1", "--seq-length", "24",
         "--global-batch-size", "8", "--micro-batch-size", "8", "--n-samples-per-prompt", "4",
         "--task-max-digits", "1", "--eval-size", "4", "--rollout-max-response-len", "4",
         "--reward-num-workers", "1", "--seed", "11", "--keep-uniform-groups"]


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURE, "ckpt"), path)
    return path


def test_a_pre_layout_checkpoint_resumes_to_the_same_parameters(checkpoint, tmp_path):
    expected = json.load(open(os.path.join(FIXTURE, "expected.json")))
    out = tmp_path / "out"
    env = {**os.environ, "OUTPUT_DIR": str(out), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), "-m", "megatron_rl.train", *FLAGS, "--train-iters", str(expected["step"]),
                        "--load", str(checkpoint), "--save", str(checkpoint), "--log-param-checksum"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed at step 2" in r.stdout + r.stderr
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    checksum = next(row["train"]["param_checksum"] for row in rows if row["step"] == expected["step"])
    # the same fp32 sums over the same weights on the same machine: equal up to summation order (1e-9 relative)
    assert checksum == pytest.approx(expected["param_checksum"], rel=1e-9)


def test_a_pre_layout_checkpoint_converts_to_the_same_hf_weights(checkpoint, tmp_path):
    r = subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", "--load", str(checkpoint),
                        "--save", str(tmp_path / "hf"), "--no-progress"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got, expected = load_file(tmp_path / "hf" / "model.safetensors"), load_file(os.path.join(FIXTURE, "hf",
                                                                                              "model.safetensors"))
    assert got.keys() == expected.keys()
    assert [n for n in expected if not torch.equal(got[n], expected[n])] == []
    assert json.load(open(tmp_path / "hf" / "config.json")) == json.load(open(os.path.join(FIXTURE, "hf",
                                                                                             "config.json")))
