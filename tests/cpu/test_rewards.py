"""Rewards: math equivalence across answer categories checked against math-verify itself, hang- and crash-proof
workers that die with their rank, bad inputs, prose references, user reward functions (--custom-rm-path) in the
same workers, rule terms, and the overlong shaping of truncated responses."""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers import ROOT

from megatron_rl.rewards import MathScorer, RewardResult, RewardSample, build_reward_fn, combine, marked_answer
from megatron_rl.rewards.rules import format_reward
from megatron_rl.rewards.workers import WorkerPool

TIMEOUT = 2


def samples(pairs):
    """RewardSamples of (response, label, ...) tuples."""
    return [RewardSample("", p[0], p[1]) for p in pairs]


PAIRS = [
    # fractions vs decimals
    ("So \\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{0.25}", "\\frac14", 1.0), ("#### 3/4", "0.75", 1.0),
    ("\\boxed{0.33}", "\\frac{1}{3}", 0.0), ("\\boxed{\\dfrac{6}{4}}", "1.5", 1.0),
    # integers and answer formats
    ("The answer is 42.", "42", 1.0), ("#### 1,000", "1000", 1.0), ("so 7 apples and 12 pears", "12", 1.0),
    ("\\boxed{-5}", "-5", 1.0), ("\\boxed{5}", "-5", 0.0), ("The answer is: $17$", "17", 1.0),
    ("\\fbox{9}", "9", 1.0), ("#### 12.0", "12", 1.0),
    # several boxes are one answer, a set: hedging between candidates is not the last one's answer
    ("first \\boxed{3}, finally \\boxed{4}", "4", 0.0), ("\\boxed{3}, \\boxed{4}", "\\{3, 4\\}", 1.0),
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
BAD_FORMAT = [("", "1"), ("   ", "1"), ("I don't know", "1"), ("\\boxed{\\frac{1}{2}", "1/2"), ("\\boxed{}", "3")]
PATHOLOGICAL = [("\\boxed{9^{9^{9^{9}}}}", "1"), ("\\boxed{2^{2^{40}}}", "1"), ("The answer is 9^9^9^9", "1")]


@pytest.fixture(scope="module")
def scorer():
    s = MathScorer(num_workers=2, timeout_s=TIMEOUT)
    yield s
    s.close()


def test_answer_pairs_across_categories(scorer):
    for (response, reference, expected), result in zip(PAIRS, scorer(samples(PAIRS))):
        assert result.status == "scored", (response, reference, result)
        assert result.reward == expected, (response, reference, result)


# (gold, response) pairs whose verdict must be math-verify's own: integers (decided without a worker), full-width
# and Arabic-Indic digits (which int() would read, math-verify does not), several boxes, symbolic forms. Plain
# golds are read by math-verify's expression extraction, $-delimited ones by its LaTeX extraction.
AGREEMENT = [
    ("42", "\\boxed{42}"), ("42", "\\boxed{43}"), ("-5", "\\boxed{5}"), ("12", "7 + 5 = 12"),
    ("7", "\\boxed{７}"), ("7", "\\boxed{٧}"), ("7", "The answer is ７."), ("12", "so the total is ١٢"),
    ("$\\{3,4\\}$", "\\boxed{3}, \\boxed{4}"), ("$\\{3,4\\}$", "\\boxed{4} and \\boxed{3}"),
    ("$4$", "\\boxed{3}, \\boxed{4}"), ("$4$", "first \\boxed{3}, finally \\boxed{4}"), ("$3, 4$", "\\boxed{3}\\boxed{4}"),
    ("$\\frac{1}{2}$", "\\boxed{0.5}"), ("$x^2-1$", "\\boxed{(x-1)(x+1)}"), ("$(0,1]$", "\\boxed{[0,1]}"),
    ("$2\\sqrt{2}$", "\\boxed{\\sqrt{8}}"),
]


def test_verdicts_agree_with_math_verify_itself(scorer):
    from math_verify import parse, verify

    results = scorer([RewardSample("", response, gold) for gold, response in AGREEMENT])
    for (gold, response), result in zip(AGREEMENT, results):
        expected = float(verify(parse(gold), parse(response)))
        assert not result.is_failure and result.reward == expected, (gold, response, result, expected)


def test_non_ascii_digits_never_take_the_integer_shortcut():
    from megatron_rl.rewards.math import quick_verdict

    assert quick_verdict("\\boxed{７}", "7") is None and quick_verdict("\\boxed{٧}", "7") is None
    assert marked_answer("so the total is ١٢") is None


INTEGER_PAIRS = [("#### 42", "42"), ("\\boxed{007}", "7"), ("\\boxed{-0}", "0"), ("so #### 12", "012"),
                 ("\\boxed{5}", "-5"), ("7 + 5 = \\boxed{12}", "12"), ("#### 3", "4")]


def test_integer_fast_path_gives_math_verify_verdicts_without_a_worker():
    from math_verify import parse, verify

    from megatron_rl.rewards.math import quick_verdict

    for response, reference in INTEGER_PAIRS:
        fast = quick_verdict(response, reference)
        assert fast.status == "scored" and fast.reward == float(verify(parse(f"${reference}$"), parse(response))), \
            (response, reference)
    assert quick_verdict("\\boxed{\\frac{1}{2}}", "0.5") is None  # needs the symbolic check
    assert quick_verdict("\\boxed{" + "9" * 200 + "}", "1") is None  # no fast path for huge numbers
    assert quick_verdict("\\boxed{3}, \\boxed{4}", "4") is None  # several boxes: math-verify reads them as a set
    assert quick_verdict("so the total is 12", "12") is None  # no marked answer: math-verify's extraction reads it


# Responses that mark no answer, read by math-verify's own extraction: the last number in the text would misjudge
# every one of them (3, the set {3, 5}, 4, 3).
UNMARKED = [("So we get $x > 3$.", "x > 3", 1.0), ("So we get $x > 3$.", "x < 3", 0.0),
            ("The answer is 3,5.", "3.5", 1.0),
            ("The matrix is $\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}$.", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", 1.0),
            ("The final answer is $\\frac{1}{2}$. I used 3 steps.", "0.5", 1.0), ("The answer is 42.", "42", 1.0),
            ("so 7 apples and 12 pears", "12", 1.0), ("so 7 apples and 12 pears", "7", 0.0)]


def test_unmarked_answers_are_read_by_math_verify(scorer):
    from math_verify import parse, verify

    for (response, reference, expected), result in zip(UNMARKED, scorer(samples(UNMARKED))):
        assert result.status == "scored" and result.reward == expected, (response, reference, result)
        assert expected == float(verify(parse(f"${reference}$"), parse(response))), (response, reference)


PROSE = [("The answer is Paris.", "Paris", 1.0), ("I think so.\nParis", "Paris", 1.0), ("\\boxed{\\text{paris}}", "Paris", 1.0),
         ("\\boxed{the  Red one}", "the red one.", 1.0), ("\\boxed{one red the}", "the red one", 0.0),
         ("\\boxed{London}", "Paris", 0.0), ("\\boxed{Paris}, \\boxed{London}", "\\text{Paris}", 0.0),
         ("\\boxed{Paris}", "Paris, France", 0.0)]


def test_prose_references_are_compared_as_normalized_text(scorer):
    from megatron_rl.rewards.math import is_prose

    for (response, reference, expected), result in zip(PROSE, scorer(samples(PROSE))):
        assert result.status == "scored" and result.reward == expected, (response, reference, result)
    assert [is_prose(r) for r in ("Paris", "\\text{the red one}", "yes")] == [True, True, True]
    assert not any(is_prose(r) for r in ("x", "x^2+1", "\\pi", "pi", "2 apples", "(a, b)", "\\frac{1}{2}", "sin x"))


def test_malformed_and_empty_outputs_are_wrong_format(scorer):
    for result in scorer(samples(BAD_FORMAT)):
        assert result == RewardResult(0.0, "wrong-format", None, result.detail) and result.reward == 0.0


def test_bad_inputs_fail_one_item_each_and_never_the_batch(scorer):
    batch = [RewardSample("", "\\boxed{7}", None), RewardSample("", "\\boxed{7}", 7),
             RewardSample("", "\\boxed{1/2}", 0.5), RewardSample("", "\\boxed{1}", True),
             RewardSample("", "\\boxed{1}", ["1"]), RewardSample("", None, "1"), RewardSample("", "\\boxed{2}", "2")]
    results = scorer(batch)
    assert [r.status for r in results] == ["bad-input", "scored", "scored", "bad-input", "bad-input", "bad-input",
                                           "scored"]
    assert [r.reward for r in results if r.status == "scored"] == [1.0, 1.0, 1.0]
    assert all(r.is_failure for r in results if r.status == "bad-input")  # excluded from training, not a 0
    assert "label is NoneType" in results[0].detail and "label is bool" in results[3].detail
    assert "label is list" in results[4].detail and "response is NoneType" in results[5].detail


@pytest.mark.parametrize("response,reference", PATHOLOGICAL, ids=["9^9^9^9", "2^2^40", "plain-power-tower"])
def test_pathological_answers_return_within_timeout_plus_one_second(scorer, response, reference):
    start = time.monotonic()
    (result,) = scorer([RewardSample("", response, reference)])
    assert time.monotonic() - start < TIMEOUT + 1
    assert result.reward == 0.0 and result.status in ("scored", "timeout")
    # the pool still serves after a timed-out (killed) worker
    assert scorer([RewardSample("", "\\boxed{2}", "2")])[0].reward == 1.0


def test_a_verdict_past_its_limit_inside_math_verify_is_a_timeout_not_a_wrong_answer():
    """math-verify catches Exception around each comparison; the limit must still end it as a timeout. This
    comparison spends several seconds in sympy's Python code (interruptible), in this process's main thread."""
    import math_verify  # noqa: F401 - imported before the clock starts (slow on a busy machine)

    from megatron_rl.rewards.math import verdict

    start = time.monotonic()
    result = verdict("\\boxed{(x+y+z+2)^{16}}", "(x+y+z+1)^{16}", timeout_s=1)
    assert result.status == "timeout" and result.is_failure, result
    assert time.monotonic() - start < 2


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
    results = scorer(samples([("\\boxed{die}", "1"), ("\\boxed{1/2}", "0.5"), ("\\boxed{\\frac{3}{1}}", "3")]))
    assert scorer.pool.replaced_workers == replaced + 1
    assert results[0].status == "scorer-failure" and results[0].is_failure and "crashed" in results[0].detail
    assert [r.reward for r in results[1:]] == [1.0, 1.0]
    monkeypatch.undo()
    assert scorer([RewardSample("", "\\boxed{0.5}", "1/2")])[0].reward == 1.0


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


def _broken_warmup():
    raise ImportError("no module named 'grader'")


def test_a_worker_that_cannot_start_stops_the_pool_with_its_reason():
    with WorkerPool(1, warmup=_broken_warmup) as pool, \
            pytest.raises(RuntimeError, match="(?s)a scoring worker failed to start.*no module named 'grader'"):
        pool.map(abs, [(-1,)], timeout_s=30)


KILLED_PARENT = textwrap.dedent("""
    import os, signal
    from megatron_rl.rewards.workers import WorkerPool

    def busy():
        print(os.getpid(), flush=True)  # this worker is inside a task now, not reading its pipe
        signal.pause()  # and stays there until a signal ends it

    if __name__ == "__main__":
        pool = WorkerPool(2)
        pool.map(busy, [(), ()], timeout_s=900)
""")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_die_with_the_process_that_started_them_even_by_sigkill(tmp_path):
    import selectors

    script = tmp_path / "parent.py"
    script.write_text(KILLED_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": ROOT},
                              stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        with selectors.DefaultSelector() as selector:  # each busy worker announces its pid on the shared stdout
            selector.register(parent.stdout, selectors.EVENT_READ)
            while len(pids) < 2:
                assert selector.select(timeout=120), "the pool did not start"
                line = parent.stdout.readline()
                assert line, f"the parent exited before its workers were busy (exit code {parent.wait()})"
                pids.append(int(line))
        workers = [psutil.Process(p) for p in pids]
        parent.kill()
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=10)  # the kernel's PR_SET_PDEATHSIG, not a guess
        assert all(_gone(p.pid) for p in alive), f"workers outlived their parent: {[p.pid for p in alive]}"
    finally:
        parent.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_timeout_must_be_whole_seconds(scorer):
    with pytest.raises(ValueError, match="timeout_s must be a whole number of seconds"):
        scorer(samples([("\\boxed{1}", "1")]), timeout_s=1.5)


def test_unparseable_reference_is_an_infrastructure_failure_not_a_zero(scorer):
    (result,) = scorer(samples([("\\boxed{1}", "")]))
    assert result.status == "scorer-failure" and result.is_failure


def test_extraction_order():
    from megatron_rl.rewards.math import prose_answer

    assert marked_answer("we get 3, so \\boxed{5} and then 7") == "5"
    assert marked_answer("steps 1 2 3\n#### 42\nextra 9") == "42"
    assert marked_answer("\\boxed{1} then \\boxed{}") == "" and marked_answer("#### ") == ""
    assert marked_answer("So the answer is 8. Check: 9") is None  # math-verify's own anchors read this one
    assert prose_answer("So the answer is Paris. Check: London") == "Paris"
    assert prose_answer("The answer is $Paris$, as shown.") == "Paris"
    assert prose_answer("hmm\nParis\n") == "Paris"


def test_rule_terms_compose_and_never_hide_failures():
    def base(batch):
        return [RewardResult(1.0, "scored"), RewardResult(0.0, "timeout")]

    fn = combine(base, [(format_reward, 1.0), (lambda r: -0.01 * len(r), 1.0)])
    out = fn(samples([("\\boxed{1}", "1"), ("\\boxed{2}", "2")]))
    assert out[0].reward == pytest.approx(1.0 + 0.1 - 0.09) and out[0].status == "scored"
    assert out[1] == RewardResult(0.0, "timeout")


def test_reward_fn_registry_and_custom_functions_fail_early(tmp_path):
    math = build_reward_fn("math", num_workers=1)
    assert isinstance(math, MathScorer) and [r.reward for r in math(samples([("\\boxed{1/2}", "0.5")]))] == [1.0]
    math.close()
    with pytest.raises(ValueError, match="--reward-fn 'nope'.*--custom-rm-path"):
        build_reward_fn("nope")
    (tmp_path / "rm.py").write_text("def reward(sample):\n    return 1.0\n")
    (tmp_path / "broken.py").write_text("import no_such_module\n")
    for spec, message in [
        (f"{tmp_path}/missing.py:reward", r"--custom-rm-path '.*missing.py:reward': no such file"),
        (f"{tmp_path}/rm.py:nope", r"--custom-rm-path '.*rm.py:nope': '.*rm.py' has no function 'nope'"),
        (f"{tmp_path}/broken.py:reward", r"--custom-rm-path .*loading '.*broken.py' failed \(ModuleNotFoundError"),
        ("no_such_module:fn", r"--custom-rm-path 'no_such_module:fn': cannot import module 'no_such_module'"),
        (f"{tmp_path}/rm.py", r"expected path/to/file.py:function or package.module:function"),
    ]:
        with pytest.raises(ValueError, match=message):
            build_reward_fn("math", custom_rm_path=spec)


CUSTOM = textwrap.dedent("""
    import os, signal, time
    from megatron_rl.rewards import RewardResult

    def exact(sample):
        return float(sample.response.strip() == sample.label)

    def echo(sample):
        return {"reward": 0.5, "prompt": sample.prompt, "response": sample.response, "label": sample.label,
                "metadata": sample.metadata, "finish_reason": sample.finish_reason}

    BEHAVIOURS = {
        "float": lambda s: 0.25,
        "dict": lambda s: {"reward": 1, "steps": 3},
        "result": lambda s: RewardResult(1.0, "wrong-format", "x", "judged"),
        "slow": lambda s: signal.pause(),  # until the time limit's alarm
        "raises": lambda s: {}["no such key"],
        "crash": lambda s: os.kill(os.getpid(), signal.SIGKILL),
        "str": lambda s: "1.0",
        "nan": lambda s: float("nan"),
        "no-reward": lambda s: {"score": 1.0},
        "bad-status": lambda s: RewardResult(1.0, "great"),
        "not-json": lambda s: {"reward": 1.0, "blob": object()},
    }

    def by_label(sample):
        return BEHAVIOURS[sample.label](sample)
""")


@pytest.fixture(scope="module")
def custom_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(CUSTOM)
    return path


def test_custom_reward_runs_in_the_workers_with_the_same_statuses_as_math(custom_file):
    fn = build_reward_fn("math", num_workers=2, timeout_s=1, custom_rm_path=f"{custom_file}:by_label")
    try:
        labels = ["float", "dict", "result", "slow", "raises", "crash", "str", "nan", "no-reward", "bad-status",
                  "not-json", "float"]
        start = time.monotonic()
        results = dict(zip(labels, fn([RewardSample("p", "r", label) for label in labels])))
        assert time.monotonic() - start < 30
    finally:
        fn.close()
    assert results["float"] == RewardResult(0.25, "scored")
    assert results["dict"] == RewardResult(1.0, "scored", extras={"steps": 3})
    assert results["result"] == RewardResult(1.0, "wrong-format", "x", "judged")
    assert results["slow"].status == "timeout"
    failures = {k: r.detail for k, r in results.items() if r.status == "scorer-failure"}
    assert set(failures) == {"raises", "crash", "str", "nan", "no-reward", "bad-status", "not-json"}
    assert "KeyError" in failures["raises"] and "crashed" in failures["crash"]
    assert "returned str" in failures["str"] and "reward nan" in failures["nan"]
    assert "without 'reward'" in failures["no-reward"] and "status 'great'" in failures["bad-status"]
    assert "not JSON" in failures["not-json"]
    assert all(r.is_failure for k, r in results.items() if k in failures or k == "slow")


def test_custom_reward_by_module_name(custom_file, monkeypatch):
    monkeypatch.syspath_prepend(str(custom_file.parent))  # the spawned workers inherit the path
    fn = build_reward_fn(custom_rm_path="my_reward:exact", num_workers=1)
    try:
        assert [r.reward for r in fn([RewardSample("", " 12", "12"), RewardSample("", "13", "12")])] == [1.0, 0.0]
    finally:
        fn.close()


class _Channel:
    def __init__(self, messages):
        self.messages = queue.Queue()
        for m in messages:
            self.messages.put(m)

    def recv(self):
        return self.messages.get(timeout=60)


def test_reward_stage_gives_the_function_the_sample_and_shapes_rl_rewards_only(custom_file):
    from megatron_rl.controller.reward_stage import RewardStage
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.rewards.shaping import OverlongPenalty
    from megatron_rl.rollout.types import RequestMeta, RolloutOutput

    tok = build_char_tokenizer()
    prompt = [tok.bos_token_id] + tok.encode("2+3=", add_special_tokens=False)
    response = tok.encode("5", add_special_tokens=False) + [tok.eos_token_id]
    long = tok.encode("55555555", add_special_tokens=False)  # 8 tokens: the limit, truncated

    def rollout(tokens, finish, is_eval):
        out = RolloutOutput("r", prompt, tokens, [0.0] * len(tokens), [0] * len(tokens), finish)
        return out, RequestMeta("p", 0, "5", is_eval, 0.0, {"source": "test"})

    rollouts = [rollout(response, "stop", False), rollout(long, "length", False), rollout(long, "length", True)]
    channel = _Channel([(("rollouts", (rollouts, {})), 1), (("stopped", {}), 1)])
    fn = build_reward_fn(custom_rm_path=f"{custom_file}:echo", num_workers=1)
    try:
        stage = RewardStage(channel, tok, fn, 1, [tok.eos_token_id], OverlongPenalty(max_len=8, buffer_len=4,
                                                                                     factor=1.0))
        scored = stage.get(timeout=60)
    finally:
        fn.close()
    first = scored.rewards[0]
    assert first.extras == {"prompt": "2+3=", "response": "5", "label": "5", "metadata": {"source": "test"},
                            "finish_reason": "stop"}
    assert first.reward == 0.5  # 2 tokens: far from the limit
    assert scored.rewards[1].reward == 0.5 - 1.0 and scored.rewards[1].extras["finish_reason"] == "length"
    assert scored.rewards[1].extras["overlong_penalty"] == -1.0
    assert scored.rewards[2].reward == 0.5  # evaluation: as scored


def test_overlong_penalty_by_hand():
    from megatron_rl.rewards.shaping import OverlongPenalty, overlong_penalty

    # limit 20, buffer 8: free up to 12 tokens, then -1/8 per token, -1 (the factor) at 20 and beyond
    assert [overlong_penalty(n, 20, 8, 1.0) for n in (5, 12, 13, 16, 20, 25)] == [0.0, 0.0, -0.125, -0.5, -1.0, -1.0]
    assert overlong_penalty(16, 20, 8, 0.5) == -0.25
    shape = OverlongPenalty(20, 8, 1.0)
    assert shape(RewardResult(1.0, "scored", "4"), 16) == RewardResult(0.5, "scored", "4",
                                                                       extras={"overlong_penalty": -0.5})
    assert shape(RewardResult(0.0, "wrong-format"), 20).reward == -1.0  # truncated never beats finished
    assert shape(RewardResult(0.0, "timeout"), 20) == RewardResult(0.0, "timeout")  # a failure stays one
    assert shape(RewardResult(1.0, "scored"), 12) == RewardResult(1.0, "scored")
    with pytest.raises(ValueError, match="--overlong-buffer-len must be in \\[1, --rollout-max-response-len 20\\]"):
        OverlongPenalty(20, 21)
    with pytest.raises(ValueError, match="--overlong-penalty-factor must be >= 0"):
        OverlongPenalty(20, 8, -1.0)


def test_mask_truncated_keeps_the_reward_in_the_baseline_and_drops_the_gradient():
    from megatron_rl.controller.buffer import Rollout
    from megatron_rl.rollout.types import RequestMeta, RolloutOutput
    from megatron_rl.trainer.batch import TrainBatch

    def rollout(k, reward, finish):
        out = RolloutOutput(f"p#{k}", [1, 2], [3, 4, 5], [-1.0] * 3, [0] * 3, finish)
        return Rollout(out, RequestMeta("p", k, "x", False, 0.0), RewardResult(reward, "scored"))

    group = [rollout(0, 1.0, "stop"), rollout(1, 0.0, "length"), rollout(2, 0.0, "stop"), rollout(3, 1.0, "length")]
    masked = TrainBatch.from_groups([group], "group-baseline", mask_truncated=True)
    plain = TrainBatch.from_groups([group], "group-baseline")
    # group baseline: r - mean(1, 0, 0, 1) = r - 0.5, the truncated rewards counted in the mean
    assert masked.advantages.tolist() == plain.advantages.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert masked.loss_mask.sum(1).tolist() == [3, 0, 3, 0] and plain.loss_mask.sum(1).tolist() == [3, 3, 3, 3]


def test_reward_flags_are_checked_by_the_parser(capsys):
    from megatron_rl.config.arguments import parse_args

    args = parse_args(["--overlong-penalty", "--rollout-max-response-len", "12"])
    assert (args.overlong_buffer_len, args.overlong_penalty_factor) == (3, 1.0)
    for flags, message in [
        (["--overlong-buffer-len", "2"], "--overlong-buffer-len need(s) --overlong-penalty"),
        (["--overlong-penalty", "--overlong-buffer-len", "9"],
         "--overlong-buffer-len must be in [1, --rollout-max-response-len 8], got 9"),
        (["--overlong-penalty", "--overlong-penalty-factor", "-1"], "--overlong-penalty-factor must be >= 0"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(flags)
        assert message in capsys.readouterr().err


def test_isolated_failures_are_counted_and_a_scorer_failing_on_every_item_stops_the_run():
    from megatron_rl.controller.reward_failures import RewardFailures

    ok, timeout = RewardResult(1.0, "scored", "4"), RewardResult(0.0, "timeout", None, "no verdict within 5 s")
    crash = RewardResult(0.0, "scorer-failure", None, "crashed: killed by SIGKILL")
    failures = RewardFailures(limit=4)
    failures.check([timeout, ok, crash, crash, ok, timeout])  # never 4 in a row
    assert failures.counts == {"timeout": 2, "scorer-failure": 2} and failures.streak == 1
    with pytest.raises(RuntimeError, match="failed on the last 4 samples in a row.*scorer-failure: crashed"):
        failures.check([timeout, timeout, crash])


def test_a_reward_server_scores_and_its_failures_are_never_rewards(monkeypatch):
    import socket

    from reward_server import reward_server

    from megatron_rl.rewards import remote

    monkeypatch.setattr(remote, "RETRY_PAUSE_S", 0.01)
    batch = [RewardSample("p", "so 12", "12", {"id": 1}), RewardSample("p", "so 13", "12")]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    with reward_server(flaky_failures=2) as server:
        scored = remote.RemoteReward(server.url("/score"), timeout_s=5, retries=0)
        assert scored(batch) == [RewardResult(1.0, "scored", None, "", {"length": 5}),
                                 RewardResult(0.0, "scored", None, "", {"length": 5})]
        # the batch's requests are concurrent: they may arrive in either order
        assert {"prompt": "p", "response": "so 12", "label": "12", "metadata": {"id": 1},
                "finish_reason": "stop"} in server.requests["/score"]
        # 503 twice, then an answer: the retries absorb it
        assert [r.reward for r in remote.RemoteReward(server.url("/flaky"), 5, retries=2)(batch[:1])] == [1.0]
        assert len(server.requests["/flaky"]) == 3
        failures = {path: remote.RemoteReward(url, timeout_s=0.5, retries=1)(batch[:1])[0]
                    for path, url in [("hang", server.url("/hang")), ("404", server.url("/missing")),
                                      ("nan", server.url("/nan")), ("text", server.url("/text")), ("closed", closed)]}
        assert len(server.requests["/hang"]) == 2 and len(server.requests["/missing"]) == 1  # 404: no retry
    assert failures["hang"].status == "timeout" and "no answer within 0.5 s (2 tries)" in failures["hang"].detail
    assert failures["404"].status == "scorer-failure" and "HTTP 404" in failures["404"].detail
    assert failures["nan"].status == "scorer-failure" and "returned the reward nan" in failures["nan"].detail
    assert failures["text"].status == "scorer-failure" and "not JSON" in failures["text"].detail
    assert failures["closed"].status == "scorer-failure" and "ConnectError" in failures["closed"].detail
    assert all(r.is_failure for r in failures.values())
    with pytest.raises(ValueError, match="--rm-url 'localhost:8000': expected an http:// or https:// URL"):
        remote.RemoteReward("localhost:8000")


def test_a_judges_verdict_is_its_patterns_last_match_and_bad_judge_flags_are_named(capsys):
    import re

    from megatron_rl.config.arguments import parse_args
    from megatron_rl.rewards.verdicts import DEFAULT_VERDICT, check_template, parse_verdict

    default = re.compile(DEFAULT_VERDICT)
    assert parse_verdict("NO at first... on reflection YES", default) == 1.0
    assert parse_verdict("YES, or rather NO.", default) == 0.0
    assert parse_verdict("I cannot tell", default) is None
    score = re.compile(r"score: (\S+)")
    assert parse_verdict("score: 3 then score: 0.75", score) == 0.75
    assert parse_verdict("score: nan", score) is None and parse_verdict("score: Correct", score) == 1.0
    assert check_template("{prompt} {response} {label}") == "{prompt} {response} {label}"
    for flags, message in [
        (["--judge-model", "j", "--rm-url", "http://h:1/s"], "--rm-url and --judge-model each give the reward"),
        (["--judge-model", "j", "--judge-prompt-template", "grade {answer}"], "may name only"),
        (["--judge-model", "j", "--judge-prompt-template", "grade {prompt}"], "must contain {response}"),
        (["--judge-model", "j", "--judge-verdict-pattern", "YES|NO"], "needs a group"),
        (["--judge-model", "j", "--judge-verdict-pattern", "(YES"], "not a regular expression"),
        (["--rm-url", "http://h:1/s", "--rm-retries", "-1"], "--rm-retries must be >= 0"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(flags)
        assert message in capsys.readouterr().err, flags
