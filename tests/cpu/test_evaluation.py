"""Evaluation figures from reward results: accuracy over scored samples, pass@n, failures counted apart (never
a NaN), and eval.json's before / after / history per set."""

from megatron_rl.controller.evaluation import EvalSet, describe, report, summarize
from megatron_rl.rewards.types import RewardResult

RIGHT, WRONG = RewardResult(1.0, "scored"), RewardResult(0.0, "scored")
TIMEOUT = RewardResult(0.0, "timeout", detail="no verdict within 5 s")


def test_accuracy_pass_at_n_and_failures_by_hand():
    s = EvalSet("x", [{"id": "x/0"}, {"id": "x/1"}, {"id": "x/2"}])
    results = {("x/0", 0): RIGHT, ("x/0", 1): WRONG, ("x/1", 0): WRONG, ("x/1", 1): TIMEOUT,
               ("x/2", 0): WRONG, ("x/2", 1): WRONG}
    summary = summarize(s, results, 2)
    # 5 scored samples, 1 right; problem 0 solved by one of its two samples
    assert summary == {"problems": 3, "samples": 6, "failures": 1, "accuracy": 1 / 5, "reward_mean": 1 / 5,
                       "failure_reasons": [{"reason": "timeout: no verdict within 5 s", "samples": 1}],
                       "pass@2": 1 / 3}


def test_failure_reasons_keep_the_most_frequent_and_count_the_rest():
    hung = RewardResult(0.0, "environment-failure", detail="the rollout program ran longer than 5 s")
    s = EvalSet("x", [{"id": f"x/{i}"} for i in range(9)])
    results = {("x/0", 0): hung, ("x/1", 0): hung, ("x/2", 0): RIGHT, ("x/3", 0): RewardResult(0.0, "bad-input")}
    results.update({(f"x/{i}", 0): RewardResult(0.0, "scorer-failure", detail=f"crash {i}") for i in range(4, 9)})
    summary = summarize(s, results, 1)
    reasons = summary["failure_reasons"]
    assert reasons[0] == {"reason": "environment-failure: the rollout program ran longer than 5 s", "samples": 2}
    assert len(reasons) == 6 and reasons[-1] == {"reason": "other reasons", "samples": 2}
    assert sum(r["samples"] for r in reasons) == summary["failures"] == 8
    assert describe("x", summary).endswith(", 8 samples not scored, most for environment-failure: the rollout "
                                           "program ran longer than 5 s)")


def test_a_set_without_any_scored_sample_reports_null_not_nan():
    s = EvalSet("x", [{"id": "x/0"}])
    summary = summarize(s, {("x/0", 0): TIMEOUT}, 1)
    assert summary["accuracy"] is None and summary["failures"] == 1 and "pass@1" not in summary


def test_report_has_before_after_and_history_per_set():
    history = [{"step": 0, "a": {"accuracy": 0.1, "problems": 4}, "b": {"accuracy": 0.5, "problems": 2}},
               {"step": 5, "a": {"accuracy": 0.3, "problems": 4}, "b": {"accuracy": 0.6, "problems": 2}}]
    out = report(history, 1, 0.0)
    assert (out["accuracy_before_rl"], out["accuracy_after_rl"]) == (0.1, 0.3)
    assert (out["eval_set"], out["eval_size"]) == ("a", 4)
    assert out["eval_sets"]["b"]["history"] == [{"step": 0, "accuracy": 0.5, "problems": 2},
                                                 {"step": 5, "accuracy": 0.6, "problems": 2}]
    assert report([], 1, 0.0) == {"eval_sets": {}}


def test_report_counts_distinct_problems_and_names_their_space():
    from types import SimpleNamespace

    from megatron_rl.controller.evaluation import eval_sets
    from megatron_rl.controller.prompt_source import PromptSource

    args = SimpleNamespace(prompt_data=None, sft_data=None, seed=0, task_min_digits=1, task_max_digits=2,
                           task_operands=2, eval_size=50, eval_prompt_data=None)
    (arith,) = eval_sets(args, PromptSource(args))
    out = report([{"step": 0, "arithmetic": {"accuracy": 0.0, "problems": 50}}], 1, 0.0, [arith])
    entry = out["eval_sets"]["arithmetic"]
    assert entry["distinct_problems"] == 50
    assert entry["drawn_from"]["expressions"] == 100 * 100 * 2 and 1500 < entry["drawn_from"]["eval_split"] < 2500
