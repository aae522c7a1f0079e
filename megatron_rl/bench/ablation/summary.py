"""The off-policy ablation's numbers, computed from each run's own records (metrics.jsonl, eval.json).

Pure functions of those records, so that every rule the report states (time to the target accuracy, what counts
as an instability event, which steps the off-policy statistics average over, mean and spread over seeds) is
tested on hand-made records (tests/cpu/test_ablation.py).
"""

from __future__ import annotations

import json
import os

TARGET_ACCURACY = 0.8
ACCURACY_DROP = 0.15

TARGET_RULE = (f"the first evaluation whose held-out accuracy is >= {TARGET_ACCURACY}: its RL step, and the wall time "
               "of the RL steps up to it (the sum of their perf/step_time_s, evaluations excluded; 0 when the "
               "evaluation before RL already reaches it); 'not reached' when no evaluation does")
INSTABILITY_RULE = (f"an evaluation whose held-out accuracy is more than {ACCURACY_DROP} below the best accuracy of "
                    "the run's earlier evaluations (the one before RL included), or an RL step whose optimizer update "
                    "was skipped (a NaN/Inf gradient: train/update_successful false)")
LAGGED_STEPS_RULE = ("averaged over the RL steps trained at the full lag (rollout/lag_max equal to the run's lag: the "
                     "ramp's first steps, and any step after a skipped update, are left out)")


def read_records(run_dir: str) -> dict:
    """{"metrics": the rows of metrics.jsonl, "eval": eval.json} of one run."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(run_dir, "eval.json")) as f:
        evaluation = json.load(f)
    return {"metrics": metrics, "eval": evaluation}


def rl_rows(metrics: list[dict]) -> list[dict]:
    """The RL steps' rows (evaluations before RL have rows of their own, without "rollout")."""
    return [r for r in metrics if "rollout" in r]


def eval_curve(evaluation: dict) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every evaluation of the run's held-out set, in order; evaluations without a
    scored sample (accuracy null) are left out."""
    name = evaluation.get("eval_set")
    if name is None:
        raise ValueError("eval.json has no evaluation set: the ablation needs the task's held-out set "
                         "(--eval-size > 0)")
    return [(h["step"], h["accuracy"]) for h in evaluation["eval_sets"][name]["history"] if h["accuracy"] is not None]


def step_seconds_until(rows: list[dict], step: int) -> float:
    """Wall time of the RL steps 1..`step` (perf/step_time_s summed; evaluations are not part of a step)."""
    return sum(r["perf"]["step_time_s"] for r in rows if r["step"] <= step)


def time_to_accuracy(curve: list[tuple[int, float]], rows: list[dict], target: float = TARGET_ACCURACY) -> dict | None:
    """The first evaluation at or above `target` (`TARGET_RULE`): {"step", "rl_seconds"}; None if never."""
    for step, accuracy in curve:
        if accuracy >= target:
            return {"step": step, "rl_seconds": step_seconds_until(rows, step)}
    return None


def instability_events(curve: list[tuple[int, float]], rows: list[dict], drop: float = ACCURACY_DROP) -> list[dict]:
    """The run's instability events (`INSTABILITY_RULE`), by step."""
    events, best = [], None
    for step, accuracy in curve:
        if best is not None and round(best - accuracy, 9) > drop:  # rounded: 0.8 - 0.65 is not "more than 0.15"
            events.append({"step": step, "kind": "accuracy drop", "accuracy": accuracy, "best_before": best})
        best = accuracy if best is None else max(best, accuracy)
    events += [{"step": r["step"], "kind": "skipped update"} for r in rows
               if not r["train"].get("update_successful", True)]
    return sorted(events, key=lambda e: e["step"])


def lagged_rows(rows: list[dict], lag: int) -> list[dict]:
    """The steps trained at the full lag (`LAGGED_STEPS_RULE`)."""
    return [r for r in rows if r["rollout"].get("lag_max") == lag]


def train_mean(rows: list[dict], key: str) -> float | None:
    """Mean of train/`key` over `rows` that report it; None if none does."""
    values = [r["train"][key] for r in rows if r["train"].get(key) is not None]
    return sum(values) / len(values) if values else None


def fraction_keys(rows: list[dict]) -> list[str]:
    """The loss's clipped / masked fractions the rows report (train/<indicator>_fraction)."""
    return sorted({k for r in rows for k in r["train"] if k.endswith("_fraction") and k != "ess_fraction"})


def summarize_run(records: dict, lag: int) -> dict:
    """One run's figures: final held-out accuracy, time to the target, instability events, and the off-policy
    statistics of its steps at the full lag."""
    evaluation, rows = records["eval"], rl_rows(records["metrics"])
    curve = eval_curve(evaluation)
    reached = time_to_accuracy(curve, rows)
    events = instability_events(curve, rows)
    lagged = lagged_rows(rows, lag)
    step_times = [r["perf"]["step_time_s"] for r in rows]
    return {
        "accuracy_before_rl": evaluation["accuracy_before_rl"],
        "final_accuracy": evaluation["accuracy_after_rl"],
        "best_accuracy": max((a for _, a in curve), default=None),
        "steps": len(rows),
        "steps_at_full_lag": len(lagged),
        "rl_step_seconds": sum(step_times),
        "seconds_per_step": sum(step_times) / len(step_times) if step_times else None,
        "steps_to_target": reached["step"] if reached else None,
        "rl_seconds_to_target": reached["rl_seconds"] if reached else None,
        "instability_events": len(events),
        "events": events,
        "kl_behavior_current": train_mean(lagged, "kl_behavior_current"),
        "fractions": {k: train_mean(lagged, k) for k in fraction_keys(lagged)},
        "eval_curve": [list(point) for point in curve],
        "distinct_problems": evaluation["eval_sets"][evaluation["eval_set"]].get("distinct_problems"),
    }


def spread(values) -> dict | None:
    """{"mean", "min", "max", "n"} of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize_cell(runs: list[dict]) -> dict:
    """One (lag, loss) cell over its seeds' run summaries: means and spreads; time to the target over the seeds
    that reached it (`reached` says how many)."""
    fractions = sorted({k for r in runs for k in r["fractions"]})
    return {
        "seeds": len(runs),
        "final_accuracy": spread(r["final_accuracy"] for r in runs),
        "accuracy_before_rl": spread(r["accuracy_before_rl"] for r in runs),
        "reached": sum(r["steps_to_target"] is not None for r in runs),
        "steps_to_target": spread(r["steps_to_target"] for r in runs),
        "rl_seconds_to_target": spread(r["rl_seconds_to_target"] for r in runs),
        "instability_events": sum(r["instability_events"] for r in runs),
        "runs_with_events": sum(r["instability_events"] > 0 for r in runs),
        "kl_behavior_current": spread(r["kl_behavior_current"] for r in runs),
        "fractions": {k: spread(r["fractions"].get(k) for r in runs) for k in fractions},
        "seconds_per_step": spread(r["seconds_per_step"] for r in runs),
    }


def mean_curve(curves: list[list]) -> list[tuple[int, float]]:
    """The mean accuracy over seeds at each evaluation step that every seed's curve has."""
    if not curves:
        return []
    by_step = [dict((step, acc) for step, acc in c) for c in curves]
    steps = sorted(set.intersection(*(set(c) for c in by_step)))
    return [(s, sum(c[s] for c in by_step) / len(by_step)) for s in steps]
