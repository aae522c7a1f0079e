"""The chaos soak on a real SGLang generator (`python -m megatron_rl.bench soak --sglang`): the run is SIGKILLed
twice and resumed, and in every attempt its SGLang server is also killed at a random moment, which the generator
survives (it restarts the server and gives it the current weights). Every prompt is accounted for from the run's
own records and nothing is left behind: no rank, no server, no server subprocess."""

import json
import subprocess
import sys

from helpers import ROOT


def test_the_soak_on_sglang_accounts_for_everything_and_leaves_nothing(tmp_path):
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, "-m", "megatron_rl.bench", "soak", "--sglang", "--kills", "2",
                        "--output-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "soak.json").read_text())
    assert report["kills"] == 2 and report["processes_left"] == 0
    assert report["accounting"]["problems"] == [] and report["accounting"]["steps"] == report["train_iters"]
    assert report["server_kills"] >= 1
    went_on = [a for a in report["attempts"]
               if a["server_killed_at_step"] is not None and a["last_step_logged"] > a["server_killed_at_step"]]
    assert went_on  # the last attempt, at least
    for attempt in went_on:  # steps after the server's death: the generator restarted it
        assert "restart 1/3" in open(attempt["log"]).read(), attempt["log"]
