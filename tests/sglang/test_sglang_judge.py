"""The LLM judge (--judge-model) on a real SGLang server of its own: a tiny random judge with a character
tokenizer answers greedily exactly as the built-in engine does on the same prompt, its verdict is parsed from
that answer, a killed server is restarted, and past its restarts (or its time limit) a sample is a failure,
never a reward."""

import os
import re
import signal

import pytest
import torch
from conftest import SPEC

from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.models.hf import save_random_hf_model
from megatron_rl.rewards.types import RewardSample
from megatron_rl.rewards.verdicts import parse_verdict
from megatron_rl.rollout.local.engine import LocalEngine
from megatron_rl.rollout.sglang.judge import SGLangJudge
from megatron_rl.rollout.types import SamplingParams

TEMPLATE = "Q: {prompt} A: {response} R: {label} verdict:"
VERDICT = r"([0-9])"  # the last digit of a random judge's answer, when it writes one
MAX_NEW = 24


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("judge"))
    tokenizer = build_char_tokenizer()
    save_random_hf_model(SPEC.replace(name="tiny-judge", vocab_size=len(tokenizer)), path, seed=3,
                         dtype=torch.float32)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def judge(judge_dir, tmp_path_factory):
    judge = SGLangJudge(judge_dir, str(tmp_path_factory.mktemp("logs") / "judge.log"), template=TEMPLATE,
                        verdict_pattern=VERDICT, max_new_tokens=MAX_NEW, timeout_s=120, max_restarts=1)
    yield judge
    judge.close()


SAMPLES = [RewardSample(f"{a}+{b}=?", f"{a + b}", str(a + b)) for a, b in ((3, 4), (12, 30), (7, 7), (50, 1))]


def _expected(judge, judge_dir):
    """What the built-in engine (checked against transformers elsewhere) answers greedily to each prompt, and the
    verdict of that answer."""
    engine = LocalEngine.from_hf(judge_dir, max_seq_len=512)
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=(judge.tokenizer.eos_token_id,))
    outputs = engine.generate([judge.prompt_ids(s) for s in SAMPLES], params)
    answers = [judge.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
    return answers, [parse_verdict(a, re.compile(VERDICT)) for a in answers]


def test_the_judge_answers_as_the_builtin_engine_and_its_verdict_is_parsed(judge, judge_dir):
    answers, verdicts = _expected(judge, judge_dir)
    assert any(v is not None for v in verdicts)  # the seed's judge writes a digit somewhere: a scored verdict
    for result, answer, verdict in zip(judge(SAMPLES), answers, verdicts):
        assert result.extracted == answer[-200:]
        if verdict is None:
            assert result.status == "scorer-failure" and "no verdict" in result.detail
        else:
            assert result.status == "scored" and result.reward == verdict
    assert SAMPLES[0].response in judge.tokenizer.decode(judge.prompt_ids(SAMPLES[0]))


def test_a_judge_that_does_not_answer_in_time_is_a_timeout(judge):
    (result,) = judge(SAMPLES[:1], timeout_s=0.001)
    assert result.status == "timeout" and result.is_failure


def test_a_killed_judge_is_restarted_and_past_its_restarts_fails_the_samples(judge, judge_dir):
    answers, _ = _expected(judge, judge_dir)
    os.killpg(judge.server.process.pid, signal.SIGKILL)
    judge.server.process.wait()
    results = judge(SAMPLES)
    assert judge.restarts == 1 and [r.extracted for r in results] == [a[-200:] for a in answers]
    os.killpg(judge.server.process.pid, signal.SIGKILL)  # --judge-max-restarts 1: no second restart
    judge.server.process.wait()
    failed = judge(SAMPLES)
    assert judge.restarts == 1
    assert all(r.status == "scorer-failure" and r.is_failure and "the judge failed" in r.detail for r in failed)
