"""Math equivalence scoring: 40 answer pairs across categories, hang- and crash-proof workers, rule terms."""

import os
import signal
import time

import pytest

from megatron_rl.rewards import MathScorer, RewardResult, build_reward_fn, combine, extract_answer, format_reward
from megatron_rl.rewards.pool import WorkerPool

TIMEOUT = 2

PAIRS = [
    # fractions vs decimals
    ("So \\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{0.25}", "\\frac14", 1.0), ("#### 3/4", "0.75", 1.0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0), ("\\boxed{\\dfrac{6}{4}}", "1.5", 1.0),
    # integers and answer formats
    ("The answer is 42.", "42", 1.0), ("#### 1,000", "1000", 1.0), ("so 7 apples and 12 pears", "12", 1.0),
    ("\\boxed{-5}", "-5", 1.0), ("\\boxed{5}", "-5", 0.0), ("The answer is: $17$", "17", 1.0),
    ("\\fbox{9}", "9", 1.0), ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0), ("#### 12.0", "12", 1.0),
    # sets and intervals
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", 1.0), ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0.0),
    ("\\boxed{(0,1]}", "(0,1]", 1.0), ("\\boxed{[0,1]}", "(0,1]", 0.0), ("\\boxed{(-\\infty, 2)}", "(-\\infty,2)", 1.0),
    # radicals and pi
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0), ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0), ("\\boxed{\\sqrt{2}}", "2", 0.0),
    ("\\boxed{2\\pi}", "\\pi \\cdot 2", 1.0), ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0), ("\\boxed{\\pi}", "2\\pi", 0.0),
    # equivalent algebraic forms
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0), ("\\boxed{x^2-1}", "(x-1)(x+1)", 1.0), ("\\boxed{x^2+1}", "(x+1)^2", 0.0),
    ("\\boxed{\\frac{2x}{4}}", "x/2", 1.0), ("\\boxed{3}", "4", 0.0),
]
BAD_FORMAT = [("", "1"), ("   ", "1"), ("I don't know", "1"), ("\\boxed{\\frac{1}{2", "1/2"), ("\\boxed{}", "3")]
PATHOLOGICAL = [("\\boxed{9^{9^{9^{9}}}}", "1"), ("\\boxed{2^{2^{40}}}", "1"), ("The answer is 9^9^9^9", "1")]


@pytest.fixture(scope="module")
def scorer():
    s = MathScorer(num_workers=2, timeout_s=TIMEOUT)
    yield s
    s.close()


def test_answer_pairs_across_categories(scorer):
    results = scorer([p[0] for p in PAIRS], [p[1] for p in PAIRS])
    for (response, reference, expected), result in zip(PAIRS, results):
        assert result.status == "scored", (response, reference, result)
        assert result.reward == expected, (response, reference, result)


def test_malformed_and_empty_outputs_are_wrong_format(scorer):
    for result in scorer([p[0] for p in BAD_FORMAT], [p[1] for p in BAD_FORMAT]):
        assert result == RewardResult(0.0, "wrong-format", None, result.detail) and result.reward == 0.0


@pytest.mark.parametrize("response,reference", PATHOLOGICAL, ids=["9^9^9^9", "2^2^40", "plain-power-tower"])
def test_pathological_answers_return_within_timeout_plus_one_second(scorer, response, reference):
    start = time.monotonic()
    (result,) = scorer([response], [reference])
    assert time.monotonic() - start < TIMEOUT + 1
    assert result.reward == 0.0 and result.status in ("scored", "timeout")
    # the pool still serves after a timed-out (killed) worker
    assert scorer(["\\boxed{2}"], ["2"])[0].reward == 1.0


def _verdict_or_die(response, reference, timeout_s):
    """The real verdict, except that the worker process dies (SIGKILL) on the response \\boxed{die}."""
    from megatron_rl.rewards.math import verdict

    if response == "\\boxed{die}":
        os.kill(os.getpid(), signal.SIGKILL)
    return verdict(response, reference, timeout_s)


def test_killed_worker_gives_scorer_failure_and_pool_keeps_serving(scorer, monkeypatch):
    import megatron_rl.rewards.math as math_module

    monkeypatch.setattr(math_module, "verdict", _verdict_or_die)  # the workers run what the scorer sends them
    replaced = scorer.pool.replaced_workers
    results = scorer(["\\boxed{die}", "\\boxed{1/2}", "\\boxed{\\frac{3}{1}}"], ["1", "0.5", "3"])
    assert scorer.pool.replaced_workers == replaced + 1
    assert results[0].status == "scorer-failure" and results[0].is_failure and "crashed" in results[0].detail
    assert [r.reward for r in results[1:]] == [1.0, 1.0]
    monkeypatch.undo()
    assert scorer(["\\boxed{0.5}"], ["1/2"])[0].reward == 1.0


def _die_on_three(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if x == 5:
        raise RuntimeError("broken environment")
    return x * 2


def test_pool_reports_crashes_and_errors_per_item():
    with WorkerPool(2) as pool:
        out = pool.map(_die_on_three, [(i,) for i in range(7)], timeout_s=30)
        assert [o.status for o in out] == ["ok", "ok", "ok", "crashed", "ok", "error", "ok"]
        assert [o.value for o in out if o.status == "ok"] == [0, 2, 4, 8, 12]
        assert "broken environment" in out[5].error
        assert pool.replaced_workers == 1
        assert [o.value for o in pool.map(_die_on_three, [(10,)], timeout_s=30)] == [20]


def test_timeout_must_be_whole_seconds(scorer):
    with pytest.raises(ValueError, match="timeout_s must be a whole number of seconds"):
        scorer(["\\boxed{1}"], ["1"], timeout_s=1.5)


def test_unparseable_reference_is_an_infrastructure_failure_not_a_zero(scorer):
    (result,) = scorer(["\\boxed{1}"], [""])
    assert result.status == "scorer-failure" and result.is_failure


def test_extraction_order():
    assert extract_answer("we get 3, so \\boxed{5} and then 7") == "5"
    assert extract_answer("steps 1 2 3\n#### 42\nextra 9") == "42"
    assert extract_answer("So the answer is 8. Check: 9") == "8"
    assert extract_answer("The answer is $x+1$, as shown.") == "x+1"
    assert extract_answer("The answer is 3.5.") == "3.5"
    assert extract_answer("numbers 1, 2 and 3.5") == "3.5"
    assert extract_answer("no digits here") is None


def test_rule_terms_compose_and_never_hide_failures():
    def base(responses, references):
        return [RewardResult(1.0, "scored"), RewardResult(0.0, "timeout")]

    fn = combine(base, [(format_reward, 1.0), (lambda r: -0.01 * len(r), 1.0)])
    out = fn(["\\boxed{1}", "\\boxed{2}"], ["1", "2"])
    assert out[0].reward == pytest.approx(1.0 + 0.1 - 0.09) and out[0].status == "scored"
    assert out[1] == RewardResult(0.0, "timeout")


def test_reward_fn_registry_and_user_functions():
    math = build_reward_fn("math", num_workers=1)
    assert isinstance(math, MathScorer) and [r.reward for r in math(["\\boxed{1/2}"], ["0.5"])] == [1.0]
    math.close()
    assert build_reward_fn("megatron_rl.rewards.rules:format_reward") is format_reward
    with pytest.raises(ValueError, match="--reward-fn 'nope'"):
        build_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        build_reward_fn("no_such_module:fn")
    with pytest.raises(ValueError, match="has no callable 'missing'"):
        build_reward_fn("megatron_rl.rewards:missing")


INTEGER_PAIRS = [("The answer is 42.", "42"), ("\\boxed{007}", "7"), ("\\boxed{-0}", "0"), ("so 12", "012"),
                 ("\\boxed{5}", "-5"), ("7 + 5 = 12", "12"), ("3", "4"), ("", "1"), ("no digits here", "3")]


def test_integer_fast_path_gives_math_verify_verdicts_without_a_worker():
    from megatron_rl.rewards.math import integer_verdict, verdict

    for response, reference in INTEGER_PAIRS:
        fast = integer_verdict(response, reference)
        assert fast == verdict(response, reference, TIMEOUT), (response, reference)
    assert integer_verdict("\\boxed{\\frac{1}{2}}", "0.5") is None  # needs the symbolic check
    assert integer_verdict("\\boxed{" + "9" * 200 + "}", "1") is None  # no fast path for huge numbers


def test_isolated_failures_are_counted_and_a_scorer_failing_on_every_item_stops_the_run():
    from megatron_rl.rewards.failures import RewardFailures

    ok, timeout = RewardResult(1.0, "scored", "4"), RewardResult(0.0, "timeout", None, "no verdict within 5 s")
    crash = RewardResult(0.0, "scorer-failure", None, "crashed: killed by SIGKILL")
    failures = RewardFailures(limit=4)
    failures.check([timeout, ok, crash, crash, ok, timeout])  # never 4 in a row
    assert failures.counts == {"timeout": 2, "scorer-failure": 2} and failures.streak == 1
    with pytest.raises(RuntimeError, match="failed on the last 4 samples in a row.*scorer-failure: crashed"):
        failures.check([timeout, timeout, crash])
