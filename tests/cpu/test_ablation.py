"""The off-policy ablation (`python -m megatron_rl.bench ablation`): its summarizing rules on hand-made records
(time to the target accuracy, instability events, the steps the off-policy statistics average over, mean and
spread over seeds), the generated reading, the flags it refuses and the resume check; and, in the slow tier, a
--quick run end to end."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from megatron_rl.bench.ablation import report, study
from megatron_rl.bench.ablation.summary import (
    instability_events,
    mean_curve,
    spread,
    summarize_cell,
    summarize_run,
    time_to_accuracy,
)


def _row(step, lag=0, step_time=1.0, kl=0.0, successful=True, **fractions):
    return {"step": step, "rollout": {"lag_max": float(lag)},
            "train": {"kl_behavior_current": kl, "update_successful": successful, "ess_fraction": 1.0, **fractions},
            "perf": {"step_time_s": step_time, "time_s": 100.0 * step}}


def _eval_json(curve, problems=200):
    history = [{"step": s, "problems": problems, "accuracy": a} for s, a in curve]
    return {"eval_set": "arithmetic", "accuracy_before_rl": curve[0][1], "accuracy_after_rl": curve[-1][1],
            "eval_sets": {"arithmetic": {"history": history, "distinct_problems": problems}}}


# ---- time to the target ------------------------------------------------------------------------------------------

def test_time_to_target_is_the_first_evaluation_reaching_it_with_the_step_seconds_up_to_it():
    rows = [_row(s, step_time=0.5 if s <= 10 else 2.0) for s in range(1, 31)]
    curve = [(0, 0.5), (10, 0.79), (20, 0.8), (30, 0.95)]
    assert time_to_accuracy(curve, rows) == {"step": 20, "rl_seconds": 10 * 0.5 + 10 * 2.0}  # evaluations excluded
    assert time_to_accuracy([(0, 0.5), (10, 0.79)], rows) is None
    assert time_to_accuracy([(0, 0.85), (10, 0.6)], rows) == {"step": 0, "rl_seconds": 0}


# ---- instability ---------------------------------------------------------------------------------------------------

def test_an_instability_event_is_a_drop_of_more_than_0_15_below_the_best_so_far_or_a_skipped_update():
    curve = [(0, 0.5), (10, 0.9), (20, 0.75), (30, 0.74), (40, 0.9), (50, 0.3)]
    rows = [_row(s, successful=s != 5) for s in range(1, 51)]
    events = instability_events(curve, rows)
    # 0.75 is exactly 0.15 below 0.9: not "more than"; 0.74 and 0.3 are
    assert [(e["step"], e["kind"]) for e in events] == [(5, "skipped update"), (30, "accuracy drop"),
                                                        (50, "accuracy drop")]
    assert events[1]["best_before"] == 0.9
    assert instability_events([(0, 0.2), (10, 0.1)], []) == []  # a fall of 0.1 from the start is within the rule


# ---- mean and spread ---------------------------------------------------------------------------------------------

def test_spread_is_mean_min_max_over_the_values_present():
    assert spread([0.5, None, 0.7, 0.6]) == {"mean": pytest.approx(0.6), "min": 0.5, "max": 0.7, "n": 3}
    assert spread([]) is None and spread([None]) is None


def test_a_run_summary_averages_off_policy_statistics_over_the_steps_at_the_full_lag():
    # lag 2: steps 1 and 2 are the ramp (lags 0 and 1); step 5 follows a skipped update (lag 1)
    lags = {1: 0, 2: 1, 3: 2, 4: 2, 5: 1, 6: 2}
    rows = [_row(s, lag=lags[s], kl=0.1 * s, clip_high_fraction=0.01 * s, successful=s != 4) for s in lags]
    records = {"metrics": [{"step": 0, "eval": {}}] + rows,
               "eval": _eval_json([(0, 0.4), (3, 0.82), (6, 0.6)], problems=150)}
    run = summarize_run(records, lag=2)
    assert run["steps"] == 6 and run["steps_at_full_lag"] == 3
    assert run["kl_behavior_current"] == pytest.approx((0.3 + 0.4 + 0.6) / 3)
    assert run["fractions"] == {"clip_high_fraction": pytest.approx((0.03 + 0.04 + 0.06) / 3)}  # ess_fraction is not
    assert (run["final_accuracy"], run["accuracy_before_rl"], run["best_accuracy"]) == (0.6, 0.4, 0.82)
    assert (run["steps_to_target"], run["rl_seconds_to_target"]) == (3, 3.0)
    assert run["instability_events"] == 2  # the skipped update at step 4, the drop 0.82 -> 0.6 at step 6
    assert run["distinct_problems"] == 150 and run["rl_step_seconds"] == 6.0


def test_a_cell_spreads_over_seeds_and_times_the_target_over_the_seeds_that_reached_it():
    def run(final, steps, events, kl):
        return {"final_accuracy": final, "accuracy_before_rl": 0.4, "steps_to_target": steps,
                "rl_seconds_to_target": None if steps is None else steps * 0.5, "instability_events": events,
                "kl_behavior_current": kl, "fractions": {"masked_fraction": 0.1}, "seconds_per_step": 0.5}

    c = summarize_cell([run(0.9, 20, 0, 0.01), run(0.7, None, 2, 0.03), run(0.85, 40, 1, 0.02)])
    assert c["final_accuracy"] == {"mean": pytest.approx(0.8166666), "min": 0.7, "max": 0.9, "n": 3}
    assert c["reached"] == 2 and c["steps_to_target"] == {"mean": 30, "min": 20, "max": 40, "n": 2}
    assert c["rl_seconds_to_target"]["mean"] == 15
    assert (c["instability_events"], c["runs_with_events"]) == (3, 2)
    assert c["kl_behavior_current"]["mean"] == pytest.approx(0.02)
    assert c["fractions"]["masked_fraction"]["n"] == 3


def test_mean_curve_averages_the_steps_every_seed_evaluated():
    assert mean_curve([[[0, 0.2], [10, 0.4], [20, 0.6]], [[0, 0.4], [10, 0.6]]]) == \
        [(0, pytest.approx(0.3)), (10, pytest.approx(0.5))]
    assert mean_curve([]) == []


# ---- the reading ---------------------------------------------------------------------------------------------------

def _summary(finals: dict, kl=0.05, quick=False) -> dict:
    """A summary whose cells have the given final accuracies per (lag, loss) over seeds; before RL 0.4."""
    lags = sorted({lag for lag, _ in finals})
    losses = list(dict.fromkeys(loss for _, loss in finals))
    seeds = len(next(iter(finals.values())))
    cells = [{"lag": lag, "loss": loss, "seeds": seeds, "final_accuracy": spread(values),
              "accuracy_before_rl": spread([0.4] * seeds), "reached": 0, "steps_to_target": None,
              "rl_seconds_to_target": None, "instability_events": 0, "runs_with_events": 0,
              "kl_behavior_current": spread([kl * lag] * seeds), "fractions": {}, "seconds_per_step": spread([0.5])}
             for (lag, loss), values in finals.items()]
    runs = [{"lag": lag, "loss": loss, "seed": i, "eval_curve": [[0, 0.4], [10, v]]}
            for (lag, loss), values in finals.items() for i, v in enumerate(values)]
    return {"grid": {"lags": lags, "losses": losses, "seeds": list(range(seeds)), "quick": quick,
                     "train_iters": 10, "eval_interval": 10, "warmup_iters": None, "extra_flags": []},
            "cells": cells, "runs": runs, "distinct_problems": [400], "target_accuracy": 0.8, "failed": [],
            "command": "python -m megatron_rl.bench ablation", "git_commit": "abc", "load_average": {
                "start": [1.0], "end": [2.0]}, "recipe": {"example": "examples/run_tiny_aipo.sh", "sha256": "0" * 64},
            "machine": {"cpu": "cpu", "cpu_cores": 2, "gpu": None, "system": "Linux", "python": "3.11",
                        "torch": "2"},
            "rules": {"time_to_target": "t", "instability": "i", "off_policy_statistics": "o"},
            "cost": {"wall_seconds": 60, "launch_seconds_total": 120, "warmup_launch_seconds": spread([10]),
                     "rl_launch_seconds": spread([20]), "seconds_per_rl_step": spread([0.5])}}


def test_the_reading_says_the_claim_reproduces_only_when_a_correction_is_above_on_every_seed_beyond_resolution():
    # resolution 0.5 / sqrt(400) = 0.025
    reproduced = _summary({(0, "reinforce"): [0.7, 0.72], (0, "aipo"): [0.71, 0.72],
                           (4, "reinforce"): [0.5, 0.55], (4, "aipo"): [0.6, 0.66]})
    text = report.reading(reproduced)
    assert any(s.startswith("The claim reproduces here: at the largest lag (4) aipo") for s in text)
    assert any("losses that end lower at lag 4 than at lag 0 on every seed: reinforce, aipo" in s for s in text)
    close = _summary({(0, "reinforce"): [0.7, 0.72], (0, "aipo"): [0.71, 0.72],
                      (4, "reinforce"): [0.5, 0.55], (4, "aipo"): [0.56, 0.66]})  # apart by 0.01 < 0.025
    text = report.reading(close)
    assert any(s.startswith("The claim does not reproduce here") for s in text)
    assert any("ranges overlap: aipo" in s for s in text)


def test_the_reading_does_not_judge_the_claim_when_rl_did_not_learn_and_names_small_kl():
    stalled = _summary({(0, "reinforce"): [0.41], (0, "aipo"): [0.4], (2, "reinforce"): [0.4], (2, "aipo"): [0.4]},
                       kl=0.001)
    text = report.reading(stalled)
    assert any(s.startswith("The claim is not judged: at lag 0 RL did not raise") for s in text)
    assert any("< 0.01: the importance weights stay near 1" in s for s in text)
    assert any(s.startswith("1 seed") for s in text)


def test_docs_are_written_from_a_summary(tmp_path):
    summary = _summary({(0, "reinforce"): [0.7, 0.72], (0, "aipo"): [0.71, 0.72],
                        (4, "reinforce"): [0.5, 0.55], (4, "aipo"): [0.6, 0.66]})
    md, png = report.write_docs(summary, str(tmp_path / "docs"))
    text = open(md).read()
    assert "| aipo | 0.715 [0.710, 0.720] | 0.630 [0.600, 0.660] |" in text  # the accuracy table: loss x lag
    assert "HUMAN READING" in text and "400 distinct problems" in text and "`python -m megatron_rl.bench" in text
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# ---- the command line and the resume -----------------------------------------------------------------------------

def test_quick_defaults_explicit_flags_and_train_flags_after_the_separator(tmp_path):
    args = study.parse_args(["--quick", "--lags", "2", "0", "--output-dir", str(tmp_path), "--", "--lr", "1e-4"])
    assert (args.lags, args.losses, args.seeds, args.train_iters) == ([0, 2], ["aipo", "reinforce"], [1], 6)
    assert args.extra == ["--lr", "1e-4"]
    flags = study.rl_flags(args, 2, "aipo", 1)
    assert flags[flags.index("--controlled-lag") + 1] == "2" and flags[flags.index("--max-staleness") + 1] == "2"
    assert flags[flags.index("--load-hf") + 1] == os.path.join(str(tmp_path), "warmup", "seed1", "hf", "iter_0000000")
    assert flags.index("--lr") < flags.index("--loss")  # extra flags override the example's, never the grid's
    full = study.parse_args([])
    assert full.lags == [0, 1, 2, 4, 8] and full.seeds == [1, 2, 3] and full.train_iters is None


@pytest.mark.parametrize("argv", [["--", "--loss", "ppo"], ["--", "--seed=3"], ["--losses", "nope"],
                                  ["--lags", "1", "1"], ["--eval-interval", "0"]])
def test_flags_that_would_change_the_grid_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        study.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_a_finished_run_is_skipped_and_one_of_other_flags_is_refused(tmp_path):
    record = {"recipe_sha256": "a", "flags": ["--loss", "aipo"]}
    assert not study.is_done(str(tmp_path), record)  # no eval.json yet
    (tmp_path / "eval.json").write_text("{}")
    study.write_record(str(tmp_path), {**record, "command": "bash x", "launch_seconds": 3.0})
    assert study.is_done(str(tmp_path), record)
    with pytest.raises(study.AblationError, match="other flags"):
        study.is_done(str(tmp_path), {**record, "flags": ["--loss", "ppo"]})


FAKE_EXAMPLE = """import json, os, sys
flags = sys.argv[1:]
value = lambda flag: flags[len(flags) - 1 - flags[::-1].index(flag) + 1]  # the last occurrence wins, as in argparse
out = os.environ["OUTPUT_DIR"]
if "--loss" in flags and value("--loss") in os.environ.get("FAIL_LOSSES", "").split():
    sys.exit(3)
os.makedirs(out, exist_ok=True)
iters = int(value("--train-iters")) if "--train-iters" in flags else 0
lag = int(value("--controlled-lag")) if "--controlled-lag" in flags else 0
with open(os.path.join(out, "metrics.jsonl"), "w") as f:
    for step in range(1, iters + 1):
        f.write(json.dumps({"step": step, "rollout": {"lag_max": float(min(step - 1, lag))},
                            "train": {"kl_behavior_current": 0.01 * lag, "update_successful": True},
                            "perf": {"step_time_s": 0.5, "time_s": 0.5 * step}}) + "\\n")
history = [{"step": s, "accuracy": 0.5 + 0.01 * s} for s in [0] + list(range(3, iters + 1, 3))]
with open(os.path.join(out, "eval.json"), "w") as f:
    json.dump({"eval_set": "arithmetic", "accuracy_before_rl": 0.5, "accuracy_after_rl": history[-1]["accuracy"],
               "train_iters": iters, "eval_sets": {"arithmetic": {"history": history, "distinct_problems": 100}}}, f)
"""


def _fake_grid(tmp_path, monkeypatch, losses, fail=()):
    """run_grid with a stand-in for the example (writes plausible records; fails for the losses in `fail`)."""
    (tmp_path / "fake.py").write_text(FAKE_EXAMPLE)
    script = tmp_path / "fake.sh"
    script.write_text(f'exec "{sys.executable}" "{tmp_path / "fake.py"}" "$@"\n')
    args = study.parse_args(["--quick", "--losses", *losses, "--output-dir", str(tmp_path / "out")])
    monkeypatch.setenv("FAIL_LOSSES", " ".join(fail))
    return args, str(script), study.run_grid(args, str(script))


def test_the_grid_runs_each_seed_warm_up_first_records_later_failures_and_resumes(tmp_path, monkeypatch, capsys):
    args, script, grid = _fake_grid(tmp_path, monkeypatch, ["aipo", "ppo"], fail=["ppo"])
    assert sorted(grid["runs"]) == [(0, "aipo", 1), (2, "aipo", 1)]
    assert [(f["lag"], f["loss"]) for f in grid["failed"]] == [(0, "ppo"), (2, "ppo")]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[ablation] ")]
    assert lines[0].startswith("[ablation] 1/5 warm-up seed 1:") and "ETA" in lines[0]
    assert lines[1].startswith("[ablation] 2/5 lag 0 aipo seed 1:") and lines[-1].startswith("[ablation] 5/5")
    summary = study.build_summary(args, ["--quick"], script, grid, {
        "commit": None, "machine": {}, "wall_seconds": 1.0, "load_average": {"start": [0.0], "end": [0.0]}})
    assert [(c["lag"], c["loss"]) for c in summary["cells"]] == [(0, "aipo"), (2, "aipo")]
    assert summary["runs"][1]["kl_behavior_current"] == pytest.approx(0.02)  # steps 3..6, at the full lag
    _, _, again = _fake_grid(tmp_path, monkeypatch, ["aipo", "ppo"])  # resumed: only the failed runs run again
    assert "lag 0 aipo seed 1: done before" in capsys.readouterr().out
    assert not again["failed"] and len(again["runs"]) == 4


def test_a_failure_before_any_run_succeeded_stops_the_ablation(tmp_path, monkeypatch):
    with pytest.raises(study.RunFailed, match="exit status 3"):
        _fake_grid(tmp_path, monkeypatch, ["ppo", "aipo"], fail=["ppo"])


# ---- end to end ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_quick_ablation_runs_every_cell_and_writes_the_summary_and_docs(tmp_path):
    out, docs = tmp_path / "ablation", tmp_path / "docs"
    r = subprocess.run([sys.executable, "-m", "megatron_rl.bench", "ablation", "--quick", "--output-dir", str(out),
                        "--docs", "--docs-dir", str(docs)], capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    cells = {(run["lag"], run["loss"], run["seed"]): run for run in summary["runs"]}
    assert set(cells) == {(lag, loss, 1) for lag in (0, 2) for loss in ("aipo", "reinforce")}
    for (lag, loss, seed), run in cells.items():
        evaluation = json.loads((out / f"lag{lag}" / loss / f"seed{seed}" / "eval.json").read_text())
        assert evaluation["controlled_lag"] == lag and evaluation["train_iters"] == 6
        assert run["final_accuracy"] == evaluation["accuracy_after_rl"]
        assert run["accuracy_before_rl"] == evaluation["accuracy_before_rl"]
        assert [s for s, _ in run["eval_curve"]] == [0, 3, 6] and run["steps"] == 6
        assert run["steps_at_full_lag"] == 6 - lag and run["kl_behavior_current"] is not None
    warmup = json.loads((out / "warmup" / "seed1" / "eval.json").read_text())
    # every RL run starts from the shared warm-up's export: the same held-out accuracy before RL
    assert {run["accuracy_before_rl"] for run in cells.values()} == {warmup["accuracy_before_rl"]}
    assert {(c["lag"], c["loss"]) for c in summary["cells"]} == {(lag, loss) for lag, loss, _ in cells}
    assert summary["distinct_problems"] == [warmup["eval_sets"]["arithmetic"]["distinct_problems"]]
    assert "| loss \\ lag | 0 | 2 |" in (docs / "ablations.md").read_text()
    assert (docs / "ablations.png").read_bytes()[:4] == b"\x89PNG"
    # resumed: nothing runs again
    again = subprocess.run([sys.executable, "-m", "megatron_rl.bench", "ablation", "--quick", "--output-dir",
                            str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert again.returncode == 0 and "runs/min" not in again.stdout and "not run again" in again.stdout, \
        again.stdout + again.stderr
