"""The short chaos soak (`python -m megatron_rl.bench soak --quick`): the main example at a tiny size, SIGKILLed 4
times at different kinds of moments (after a checkpoint, mid-DDMA publish, mid-generation, from outside at a random
moment), resumed each time with --load, then run to the end. It must account for every prompt from the run's own
records, leave no process behind, and keep checkpoint disk within the retention. About a minute; the slow tier."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT


@pytest.mark.slow
def test_the_quick_soak_accounts_for_everything_and_leaves_nothing(tmp_path):
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, "-m", "megatron_rl.bench", "soak", "--quick", "--output-dir", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "soak.json").read_text())
    assert report["kills"] == 4 and len(report["attempts"]) == 5
    assert all(a["exit_code"] != 0 for a in report["attempts"][:-1]) and report["attempts"][-1]["exit_code"] == 0
    assert report["processes_left"] == 0
    figures = report["accounting"]
    assert figures["problems"] == [] and figures["steps"] == report["train_iters"]
    assert figures["samples_generated_again"] > 0  # samples in flight at a crash were generated again
    # 2 checkpoints kept, and at most one more being written when a kill lands
    assert report["checkpoint_disk_max_bytes"] <= (report["keep_last_n_checkpoints"] + 1) * report["checkpoint_bytes"]
    assert sorted(os.listdir(out / "checkpoints")) == [f"iter_{report['train_iters'] - 1:07d}",
                                                       f"iter_{report['train_iters']:07d}",
                                                       "latest_checkpointed_iteration.txt"]
