"""Metrics go to JSONL always, and to tensorboard and (offline) wandb when asked; plots are written."""

import json
import os

from megatron_rl.observability.metrics import MetricsLogger, flatten


def test_metrics_reach_jsonl_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = MetricsLogger(str(tmp_path / "run"), wandb_project="megatron-rl-test", wandb_save_dir=str(tmp_path),
                           tensorboard_dir=str(tmp_path / "tb"), config={"lr": 1e-3})
    logger.log(1, {"reward_mean": 0.5, "time": {"train_s": 1.0}, "staleness_histogram": {"0": 3}, "note": "x"})
    logger.log(2, {"reward_mean": 0.75, "time": {"train_s": 0.5}})
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["time"] == {"train_s": 1.0}
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run")]
    assert runs and any(f.endswith(".wandb") for f in os.listdir(tmp_path / "wandb" / runs[0]))


def test_flatten_keeps_numbers_only():
    assert flatten({"a": 1, "b": {"c": 2.5, "d": "text"}, "e": True}) == {"a": 1, "b/c": 2.5}


def test_plot_writes_a_png(tmp_path):
    from megatron_rl.observability.plots import plot

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step in range(1, 4):
                row = {"step": step, "perf": {"time_s": step},
                       "rollout": {"reward_mean": step / 4, "accuracy": step / 5}}
                f.write(json.dumps(row) + "\n")
    out = plot({"async": str(tmp_path / "a"), "sync": str(tmp_path / "b")}, str(tmp_path / "curve.png"))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def _eval_run(path, points):
    """metrics.jsonl of a run evaluated before RL (0 s) and at each (step, time, accuracy) of `points`."""
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "eval": {"arithmetic": {"accuracy": 0.2}}}) + "\n")
        for step, time_s, accuracy in points:
            f.write(json.dumps({"step": step, "perf": {"time_s": time_s}, "rollout": {"reward_mean": 0.5,
                                "accuracy": 0.5}, "eval": {"arithmetic": {"accuracy": accuracy}}}) + "\n")


def test_baseline_comparison_finds_when_the_run_first_reached_the_baseline_final_accuracy(tmp_path):
    from megatron_rl.observability.plots import main, time_to_reach

    _eval_run(tmp_path / "sync", [(10, 40.0, 0.6), (20, 80.0, 0.9)])
    _eval_run(tmp_path / "async", [(10, 25.0, 0.7), (20, 50.0, 0.92), (30, 75.0, 0.88)])
    result = time_to_reach(str(tmp_path / "async"), str(tmp_path / "sync"))
    assert (result["reached_at_seconds"], result["reached_at_step"], result["time_ratio"]) == (50.0, 20, 50 / 80)
    assert result["run_final_accuracy"] == 0.88
    _eval_run(tmp_path / "slow", [(10, 90.0, 0.85)])
    assert time_to_reach(str(tmp_path / "slow"), str(tmp_path / "sync"))["time_ratio"] is None
    assert main([str(tmp_path / "async"), "--baseline", str(tmp_path / "sync")]) == 0
    assert json.load(open(tmp_path / "async" / "compare_baseline.json"))["time_ratio"] == 50 / 80


def test_console_lines_without_a_terminal_follow_log_interval(tmp_path):
    import io

    from megatron_rl.observability.metrics import Progress

    stream = io.StringIO()  # not a terminal: plain lines, no carriage returns
    progress = Progress(0, 5, "AIPO", interval=2, stream=stream)
    for step in range(1, 6):
        progress.update(step, {"reward": f"{step / 10:.1f}"})
    progress.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["AIPO step 2/5", "AIPO step 4/5", "AIPO step 5/5"]
    assert "reward 0.4" in lines[1] and "s/step" in lines[1] and "eta" in lines[1] and "\r" not in stream.getvalue()


def test_wandb_mode_follows_the_flag_then_the_environment_then_the_key(monkeypatch):
    from megatron_rl.observability.metrics import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled" and wandb_mode("offline") == "offline"
