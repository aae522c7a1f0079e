"""SGLangEngine against a real SGLang server (TP=1) and the built-in engine on the same checkpoint: the
same greedy tokens and log-probs, the same log-prob convention for sampled tokens, partial rollouts that
resume under new weights (retracted, or paused in place) with per-token versions, clear errors for a
mismatched, unreachable or dead server, and agent trajectories of several policy calls across an update."""

import concurrent.futures as cf
import json
import os
import signal
import time

import pytest
import requests
import torch
from conftest import SPEC
from helpers import drive_agents, policy_turns

from megatron_rl.models import weight_map
from megatron_rl.models.safetensors_io import HFCheckpoint
from megatron_rl.rollout.agent import AgentRunner, AgentSample
from megatron_rl.rollout.local.engine import LocalEngine
from megatron_rl.rollout.sglang.engine import (
    IN_PLACE_SERVER_FLAGS,
    parse_generate_response,
    sglang_sampling_params,
    start_replica_engine,
)
from megatron_rl.rollout.sglang.server import SGLangServer, SGLangServerError
from megatron_rl.rollout.types import LOGPROB_CONVENTION, NOT_SAMPLED, SamplingParams
from megatron_rl.runtime.spawn import free_port

PROMPTS = [[1, 5, 9, 13], [2, 40, 41, 42, 43, 44, 45], [3, 100]]
ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(model_a, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    engine = start_replica_engine(SPEC, 1, None, True, model_a, log, load_format="auto")
    yield engine
    engine.shutdown()


def reference(path):
    return LocalEngine.from_hf(path, max_seq_len=2048)


def continuation_logprobs(ref: LocalEngine, prompt, tokens, temperature=1.0):
    return ref.score(list(prompt) + list(tokens), temperature)[len(prompt) - 1:]


def test_greedy_generation_matches_the_builtin_engine(engine, model_a):
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    got = engine.generate(PROMPTS, params)
    want = reference(model_a).generate(PROMPTS, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=ATOL, rtol=0)
        assert g.versions == [0] * 12 and g.finish_reason == "length"
        assert g.logprob_convention == LOGPROB_CONVENTION


def test_sampled_logprobs_are_after_temperature_and_before_top_k(engine, model_a):
    ref = reference(model_a)
    params = SamplingParams(temperature=0.7, top_k=3, max_new_tokens=16, ignore_eos=True)
    for out in engine.generate(PROMPTS, params):
        want = continuation_logprobs(ref, out.prompt_token_ids, out.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=ATOL, rtol=0)
        # After top-k=3 renormalization every sampled token would have log-prob >= log(1/3); the full-vocab
        # distribution of a random 128-token model puts them far lower.
        assert max(out.logprobs) < -1.5


def test_stop_token_ends_the_request_with_finish_reason_stop(engine, model_a):
    greedy = reference(model_a).generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    stop = greedy.token_ids[3]
    first = greedy.token_ids.index(stop)
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:first + 1]


def _runtime_shards(path, tp=1, rank=0):
    reader = HFCheckpoint(path)
    shards = weight_map.sglang_shards(SPEC, tp, rank)
    return [(name, weight_map.assemble(shard, reader.get_slice)) for name, shard in shards.items()]


def _swap_weights(engine, path, mode, version):
    """Pause (`mode`), load the checkpoint at `path` as `version`, continue."""
    engine.pause(mode)
    engine.begin_weight_update()
    engine.load_weights(_runtime_shards(path))
    engine.end_weight_update(version=version)
    engine.continue_generation()


def _swap_mid_request(engine, prompt, new_tokens, tokens_before, path, mode):
    """A greedy request, streamed from the server; once the server reports `tokens_before` generated tokens,
    swap to `path` as version 1 (`mode` pause). Returns the request's output, parsed as the engine parses it."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    body = {"input_ids": list(prompt), "sampling_params": sglang_sampling_params(params), "return_logprob": True,
            "rid": "swapped", "stream": True}
    last, swapped = None, False
    with requests.post(engine.server.url + "/generate", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            last = json.loads(line[5:])  # cumulative: every chunk holds the whole output so far
            if not swapped and last["meta_info"]["completion_tokens"] >= tokens_before:
                _swap_weights(engine, path, mode, version=1)
                swapped = True
    assert swapped, "the request finished before the swap"
    return parse_generate_response("swapped", list(prompt), last)


def test_retract_resumes_an_inflight_request_under_new_weights(engine, model_a, model_b):
    out = _swap_mid_request(engine, PROMPTS[1], 1500, 300, model_b, "retract")  # about a fifth under version 0
    switch = out.versions.index(1)
    assert 0 < switch < len(out.token_ids) == 1500
    assert out.versions == [0] * switch + [1] * (1500 - switch) and out.num_retractions >= 1
    # Tokens before the switch are model A's greedy choices, after it model B's given the same prefix;
    # their log-probs are each model's, teacher-forced on the same tokens.
    lp_a = continuation_logprobs(reference(model_a), out.prompt_token_ids, out.token_ids[:switch])
    prefix = out.prompt_token_ids + out.token_ids[:switch]
    lp_b = continuation_logprobs(reference(model_b), prefix, out.token_ids[switch:])
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.cat([lp_a, lp_b]), atol=ATOL, rtol=0)
    # and the engine now serves model B
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == \
        [o.token_ids for o in reference(model_b).generate(PROMPTS, params)]


def _builtin_in_place_switch(first, second, prompt, new_tokens, switch):
    """The built-in engine (checked against transformers in tests/cpu/test_engine.py) generating `switch` greedy
    tokens with `first` (one per step), then switching to `second` in place."""
    ref = reference(first)
    ref.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True), "ref")
    for _ in range(switch):
        ref.step()
    _swap_weights(ref, second, "in_place", version=1)
    finished = []
    while not finished:
        finished = ref.step()
    return finished[0]


def test_in_place_pause_keeps_the_kv_cache_across_an_update(model_a, model_b, tmp_path):
    """A server launched as the run launches it for --rollout-pause-mode in_place: a request paused in place
    resumes under model B on the KV cache model A computed, exactly as the built-in engine does it."""
    engine = start_replica_engine(SPEC, 1, None, True, model_a, str(tmp_path / "server.log"), load_format="auto",
                                  required_flags=IN_PLACE_SERVER_FLAGS)
    try:
        out = _swap_mid_request(engine, PROMPTS[1], 1500, 150, model_b, "in_place")  # room to pause before the end
    finally:
        engine.shutdown()
    switch = out.versions.index(1)
    assert 0 < switch < len(out.token_ids) == 1500
    assert out.versions == [0] * switch + [1] * (1500 - switch) and out.num_retractions == 0
    want = _builtin_in_place_switch(model_a, model_b, PROMPTS[1], 1500, switch)
    assert out.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want.logprobs), atol=ATOL, rtol=0)


def test_a_mismatched_server_fails_at_start_naming_the_field(engine):
    with pytest.raises(SGLangServerError, match=r"tp_size 1 \(the run's --rollout-tensor-parallel-size is 2\)"):
        engine.server.check(SPEC, tp_size=2)
    with pytest.raises(SGLangServerError, match="hidden_size 64 \\(the trainer's is 128\\)"):
        engine.server.check(SPEC.replace(hidden_size=128), tp_size=1)


def test_a_server_without_the_flags_of_in_place_pauses_fails_at_start(engine):
    with pytest.raises(SGLangServerError, match=r"disable_radix_cache False \(this run needs --disable-radix-cache\)"):
        engine.server.check(SPEC, 1, IN_PLACE_SERVER_FLAGS)


def test_an_unreachable_server_fails_at_start():
    with pytest.raises(SGLangServerError, match="did not answer /health within 3 s"):
        SGLangServer.attach(f"http://127.0.0.1:{free_port()}", timeout_s=3)


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(SGLangServerError, match="exited with code .* during start-up(.|\n)*last lines"):
        SGLangServer.launch(str(tmp_path), 1, free_port(), str(tmp_path / "server.log"), timeout_s=300)


def test_a_server_that_dies_is_restarted_resynced_and_its_requests_rerun(engine, model_b):
    """The engine serves model B as version 1 while the server's disk holds model A; the server is killed with a
    request pending (added, not finished: 400 tokens take seconds, the kill follows at once)."""
    _swap_weights(engine, model_b, "retract", version=1)
    restarts, reruns = engine.restarts, engine.rerun_requests
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    engine.add_request(PROMPTS[2], params, "killed")
    os.killpg(engine.server.process.pid, signal.SIGKILL)
    out = None
    while out is None:
        out = next(iter(engine.step(timeout_s=1.0)), None)
    assert engine.restarts == restarts + 1 and engine.rerun_requests == reruns + 1
    # re-run from its prompt under the re-sent weights (model B, version 1), not the disk's model A
    want = reference(model_b).generate([PROMPTS[2]], params)[0]
    assert out.request_id == "killed" and out.token_ids == want.token_ids and out.versions == [1] * 400


def test_replies_that_arrived_before_a_kill_are_kept(engine, model_b):
    """Short requests are answered, then the server is killed under a long one; all their replies are in when
    the engine next steps (the long one's as a failed connection). The answered requests come out of that step,
    only the killed one runs again: a batch is never short of a rollout (CI saw 15 of 16 once). This is the
    server's second restart (the test above made the first): the weights' shared memory must outlive the
    handles a restarted server used up (one reference each)."""
    short = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    reruns = engine.rerun_requests
    engine.add_request(PROMPTS[2], long, "killed")
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, short, f"answered-{i}")
    replies = {rid: future for future, (rid, _, _) in engine._pending.items()}
    cf.wait([f for rid, f in replies.items() if rid != "killed"])
    os.killpg(engine.server.process.pid, signal.SIGKILL)
    cf.wait([replies["killed"]])
    first = engine.step(timeout_s=0)
    assert sorted(o.request_id for o in first) == [f"answered-{i}" for i in range(len(PROMPTS))]
    assert engine.rerun_requests == reruns + 1
    rest = []
    while not rest:
        rest = engine.step(timeout_s=1.0)
    want = reference(model_b).generate([PROMPTS[2]], long)[0]  # the serving weights, re-sent at the restart
    assert [o.request_id for o in rest] == ["killed"] and rest[0].token_ids == want.token_ids


def test_a_server_that_keeps_dying_stops_with_its_log(model_a, tmp_path):
    """A server of its own (it is killed for good), allowed no restart."""
    engine = start_replica_engine(SPEC, 1, None, True, model_a, str(tmp_path / "server.log"), load_format="auto",
                                  max_restarts=0)
    try:
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=1500, ignore_eos=True), "doomed")
        os.killpg(engine.server.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(SGLangServerError,
                           match="failed again after 0 restart(.|\n)*exited with code -9(.|\n)*last lines"):
            while time.monotonic() - start < 30:
                assert not engine.step(timeout_s=0.5), "the request finished although its server was killed"
        assert time.monotonic() - start < 30
    finally:
        engine.shutdown()


OBSERVATION = [20, 21, 22]


def test_a_multi_turn_trajectory_through_sglang_across_a_weight_update(engine, model_a, model_b):
    """Agent programs on the SGLang engine, as the generator worker runs them: the policy calls go to the server,
    a weight update (model A as version 2, over model B as version 1) comes while they run; every policy token's
    log-prob is its version's model's, teacher-forced on exactly the trajectory before it."""
    _swap_weights(engine, model_b, "retract", version=1)
    runner = AgentRunner(policy_turns(3, 16, OBSERVATION), tokenizer=None, max_context=2048,
                         vocab_size=SPEC.vocab_size)
    samples = [AgentSample(f"p{i}#0", None, p, "", {}) for i, p in enumerate(PROMPTS)]
    in_second_turn = lambda steps: any(rid.endswith("@1") for rid, _, _ in engine._pending.values())  # noqa: E731
    try:
        finished = drive_agents(engine, runner, samples, SamplingParams(temperature=1.0, max_new_tokens=200, seed=7),
                                lambda: _swap_weights(engine, model_a, "retract", version=2), when=in_second_turn)
    finally:
        runner.shutdown()
    models = {1: reference(model_b), 2: reference(model_a)}
    crossed = 0
    for out in finished:
        policy = [True] * 16
        assert out.loss_mask == policy + [False] * 3 + policy + [False] * 3 + policy
        assert all(v == NOT_SAMPLED for v, m in zip(out.versions, out.loss_mask) if not m)
        versions = out.policy_versions
        assert versions == sorted(versions) and set(versions) <= {1, 2}
        crossed += len(set(versions)) == 2
        # each model's log-prob of every token given all before it (position p scores token p + 1)
        scores = {v: models[v].score(out.prompt_token_ids + out.token_ids, 1.0) for v in set(versions)}
        start = len(out.prompt_token_ids)
        got = [lp for lp, m in zip(out.logprobs, out.loss_mask) if m]
        want = [scores[v][start + j - 1] for j, (v, m) in enumerate(zip(out.versions, out.loss_mask)) if m]
        torch.testing.assert_close(torch.tensor(got), torch.stack(want), atol=ATOL, rtol=0)
    assert crossed  # the update came in the middle of a trajectory
