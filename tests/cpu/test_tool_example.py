"""`examples/run_tool_aipo.sh`, shortened: it makes the tool-arithmetic data and tokenizer, warms the tiny model up
on the tool demonstrations, and runs the multi-turn tool loop (--rollout-function multi-turn, the calculator
from tools.json) in a real launch: trajectories of several turns are trained and evaluated, with the tool's
output masked out, and the summary and plot come out."""

import json
import os
import subprocess

import pytest
from helpers import ROOT


@pytest.mark.slow  # about 100 s: a short warm-up, two RL steps, 20 held-out problems twice
def test_the_tool_example_trains_multi_turn_trajectories(tmp_path):
    from megatron_rl.data.tasks import tool_arithmetic
    from megatron_rl.observability.accounting import account
    from megatron_rl.runtime.spawn import free_port

    out = tmp_path / "run"
    tool_arithmetic.write(str(out / "data"), train=1000, eval_size=20, seed=0)  # the script uses data it finds
    env = {**os.environ, "OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "NO_BASELINE": "1"}
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", "run_tool_aipo.sh"), "--sft-warmup-iters", "120",
                        "--train-iters", "2", "--global-batch-size", "16", "--micro-batch-size", "8",
                        "--eval-interval", "0"], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "with the calculator: held-out accuracy" in r.stdout and "(20 distinct problems)" in r.stdout
    assert (out / "reward_curve.png").is_file()
    rows = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    trained = [row for row in rows if row["event"] == "trained"]
    assert len(trained) == 16 * 2 and account(str(out))["problems"] == []
    multi_turn = [row for row in trained if row["trajectory"]["turns"] >= 2]
    assert multi_turn, "the warmed-up policy never got the calculator's answer back"
    for row in multi_turn:  # a tool turn: the calculator's output (and the next turn's prompt) is not the policy's
        assert row["trajectory"]["tool_calls"] >= 1 and -1 in row["versions"]
        assert row["trajectory"]["policy_tokens"] == sum(v != -1 for v in row["versions"])
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all(m["rollout"]["agent_tool_calls_mean"] > 0 for m in metrics if "rollout" in m)
