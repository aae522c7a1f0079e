"""The user's path end to end, shortened: `examples/run_math_chat.sh` makes its chat dataset and BPE tokenizer,
trains (warm-up on conversations, RL with the chat template, a KL penalty and a held-out set), exports the
policy to HF, and `tools/eval_hf.py` scores the export with `transformers` alone: its held-out accuracy must
equal the run's own final evaluation exactly (greedy decoding of the same weights, fp32, on both sides)."""

import json
import os
import subprocess

import pytest
from helpers import ROOT


@pytest.mark.slow
def test_the_exported_policy_scores_what_the_run_scored(tmp_path):
    from megatron_rl.runtime.spawn import free_port

    out = tmp_path / "run"
    env = {**os.environ, "OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "run_math_chat.sh"), "--sft-warmup-iters", "30",
                        "--train-iters", "2", "--global-batch-size", "16", "--micro-batch-size", "8",
                        "--eval-interval", "0"], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "-> match" in r.stdout, r.stdout[-2000:]
    evaluation = json.loads((out / "eval.json").read_text())
    heldout = evaluation["eval_sets"]["heldout"]
    assert [h["step"] for h in heldout["history"]] == [0, 2] and heldout["after_rl"]["problems"] == 200
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all(m["train"]["kl_ref"] >= 0 for m in metrics if "train" in m)  # k3 is never negative
    assert (out / "hf" / "iter_0000002" / "generation_config.json").is_file()
