"""The agent boundary against hostile input, on the real engine (the tiny Llama, vocabulary 200): malformed
trajectories and misbehaving rollout programs (every kind of `BaseException`, bad policy calls, wrong types and
lengths, hangs) are each their own sample's failure with its reason, and the generator goes on; the OpenAI
endpoint answers every malformed request with a 4xx that names the field, never a 5xx, and still serves the next
agent. Nothing malformed reaches the engine: an out-of-vocabulary id there would crash its step."""

import asyncio
import contextlib
import gc
import json
import math
import os
import threading

import pytest
from helpers import drive_agents, policy_turns

from megatron_rl.models.hf import save_random_hf_model
from megatron_rl.models.spec import get_model_spec
from megatron_rl.rollout import LocalEngine
from megatron_rl.rollout.agent import AgentRunner, AgentSample, EnvironmentFailure, InvalidInput, Segment, Trajectory
from megatron_rl.rollout.types import SamplingParams

LLAMA = get_model_spec("tiny-llama").replace(name="tiny-llama-v200", vocab_size=200)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)
PROMPT = [1, 5, 7, 9]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_random_hf_model(LLAMA, path, seed=0)
    return LocalEngine.from_hf(str(path), max_slots=8)


def returning(**fields):
    """A program that returns a trajectory of the sample's prompt with `fields` set (`segments`, `metadata`...)."""
    async def program(sample, client):
        trajectory = Trajectory(list(sample.prompt_token_ids))
        for name, value in fields.items():
            setattr(trajectory, name, value)
        return trajectory
    return program


def raising(error: BaseException):
    async def program(sample, client):
        raise error
    return program


def calling(*token_ids, **overrides):
    """A program whose policy call the boundary refuses."""
    async def program(sample, client):
        await client.generate(list(token_ids), **overrides)
    return program


async def _sampling_with_a_string_limit(sample, client):
    trajectory = Trajectory(list(sample.prompt_token_ids))
    await client.sample(trajectory, max_new_tokens="8")


async def _exits_in_a_task(sample, client):
    async def worker():
        raise SystemExit(4)
    await asyncio.get_running_loop().create_task(worker())


async def _raises_its_own_timeout(sample, client):
    raise TimeoutError("the tool server did not answer")


POLICY = Segment([3, 4, 5], [-0.1, -0.2, -0.3], [0, 0, 0], "stop")
REFUSED = "the rollout program's input was refused: "
UNTRAINABLE = "the rollout program's trajectory cannot be trained on: "
RAISED = "the rollout program raised "
# name -> (program, kind, reason)
CASES = {
    # the trajectory it returns
    "returns-none": (lambda s, c: asyncio.sleep(0), "invalid-input",
                     UNTRAINABLE + "it is a NoneType, not a Trajectory"),
    "returns-dict": (lambda s, c: asyncio.sleep(0, {"token_ids": [1]}), "invalid-input",
                     UNTRAINABLE + "it is a dict, not a Trajectory"),
    "empty-prompt": (returning(prompt_token_ids=[]), "invalid-input",
                     UNTRAINABLE + "prompt_token_ids is empty: a policy call needs at least one token"),
    "out-of-vocabulary-prompt": (returning(prompt_token_ids=[1, 1_000_000]), "invalid-input",
                                 UNTRAINABLE + "prompt_token_ids[1] = 1000000 is outside the vocabulary [0, 200)"),
    "negative-id": (returning(segments=[Segment([5, -1])]), "invalid-input",
                    UNTRAINABLE + "segments[0].token_ids[1] = -1 is outside the vocabulary [0, 200)"),
    "float-id": (returning(segments=[Segment([5, 6.0])]), "invalid-input",
                 UNTRAINABLE + "segments[0].token_ids[1] is float 6.0: token ids are ints"),
    "segments-not-a-list": (returning(segments=POLICY), "invalid-input",
                            UNTRAINABLE + "segments must be a list, got Segment"),
    "segment-not-a-segment": (returning(segments=[[5, 6]]), "invalid-input",
                              UNTRAINABLE + "segments[0] is list, not a Segment"),
    "fewer-logprobs": (returning(segments=[Segment([3, 4, 5], [-0.1, -0.2], [0, 0, 0])]), "invalid-input",
                       UNTRAINABLE + "segments[0] has 3 tokens and 2 logprobs: one per token"),
    "no-versions": (returning(segments=[Segment([3, 4], [-0.1, -0.2])]), "invalid-input",
                    UNTRAINABLE + "segments[0].versions must be a list, got NoneType"),
    "nan-logprob": (returning(segments=[Segment([3], [math.nan], [0])]), "invalid-input",
                    UNTRAINABLE + "segments[0].logprobs[0] must be finite numbers, got nan"),
    "versions-without-logprobs": (returning(segments=[Segment([3], None, [0])]), "invalid-input",
                                  UNTRAINABLE + "segments[0] has versions but no log-probs: a policy segment needs "
                                                "both, an observation neither"),
    "bad-finish-reason": (returning(segments=[POLICY], finish_reason="done"), "invalid-input",
                          UNTRAINABLE + "finish_reason must be one of ('stop', 'length') or None, got 'done'"),
    "metadata-none": (returning(metadata=None), "invalid-input",
                      UNTRAINABLE + "metadata must be a dict with str keys, got NoneType None"),
    "metadata-not-json": (returning(metadata={"seen": {1, 2}}), "invalid-input",
                          UNTRAINABLE + "metadata must be JSON (it goes to the reward function and the ledger): "
                                        "Object of type set is not JSON serializable"),
    "reward-string": (returning(reward="1"), "invalid-input",
                      UNTRAINABLE + "reward must be a finite number or None, got '1'"),
    "response-bytes": (returning(response=b"42"), "invalid-input",
                       UNTRAINABLE + "response must be a str or None, got bytes"),
    "negative-tool-calls": (returning(tool_calls=-1), "invalid-input",
                            UNTRAINABLE + "tool_calls must be an int >= 0, got -1"),
    "past-the-budget": (returning(segments=[Segment([5] * 17)]), "invalid-input",
                        UNTRAINABLE + "the trajectory has 17 tokens after its prompt, more than its response budget "
                                      "16 (--rollout-max-response-len)"),
    "past-the-context": (returning(prompt_token_ids=[1] * 120, segments=[Segment([5] * 9)]), "invalid-input",
                         UNTRAINABLE + "the trajectory has 129 tokens, more than --seq-length 128"),
    # its policy calls, refused before the engine
    "calls-out-of-vocabulary": (calling(1, 1_000_000), "invalid-input",
                                REFUSED + "token_ids[1] = 1000000 is outside the vocabulary [0, 200)"),
    "calls-with-nothing": (calling(), "invalid-input",
                           REFUSED + "token_ids is empty: a policy call needs at least one token"),
    "calls-with-floats": (calling(1.0, 2.0), "invalid-input",
                          REFUSED + "token_ids[0] is float 1.0: token ids are ints"),
    "calls-with-nan-temperature": (calling(1, temperature=math.nan), "invalid-input",
                                   REFUSED + "sampling parameter temperature must be a finite number, got nan"),
    "calls-with-top-k-0": (calling(1, top_k=0), "invalid-input",
                           REFUSED + "sampling parameters: top_k must be -1 (all) or >= 1, got 0"),
    "calls-with-an-unknown-parameter": (calling(1, beam_width=4), "invalid-input",
                                        REFUSED + "'beam_width' is not a sampling parameter (one of ['ignore_eos', "
                                                  "'max_new_tokens', 'seed', 'stop_token_ids', 'temperature', "
                                                  "'top_k', 'top_p'])"),
    "samples-a-string-limit": (_sampling_with_a_string_limit, "invalid-input",
                               REFUSED + "sampling parameter max_new_tokens must be an int, got '8'"),
    # what it raises: every BaseException is the sample's, never the generator's
    "raises-key-error": (raising(KeyError("state")), "program-error", RAISED + "KeyError: 'state'"),
    "raises-cancelled": (raising(asyncio.CancelledError()), "program-error", RAISED + "CancelledError: "),
    "raises-system-exit": (raising(SystemExit(3)), "program-error", RAISED + "SystemExit: 3"),
    "raises-keyboard-interrupt": (raising(KeyboardInterrupt()), "program-error", RAISED + "KeyboardInterrupt: "),
    "raises-generator-exit": (raising(GeneratorExit()), "program-error", RAISED + "GeneratorExit: "),
    "its-task-exits": (_exits_in_a_task, "program-error", RAISED + "SystemExit: 4"),
    "raises-its-own-timeout": (_raises_its_own_timeout, "program-error",
                               RAISED + "TimeoutError: the tool server did not answer"),
    "environment-fails": (raising(EnvironmentFailure("sandbox worker crashed")), "environment",
                          "sandbox worker crashed"),
}


def test_every_malformed_trajectory_and_misbehaving_program_is_excluded_with_its_reason(engine, capfd):
    """One runner on the real engine takes every case, then a well-behaved program: each bad one is excluded with
    its kind and reason (an empty trajectory: nothing of it is trained), and the good one is trained as it was
    sampled: the generator survived them all."""
    programs = {**{name: program for name, (program, _, _) in CASES.items()}, "good": policy_turns(2, 3, [20, 21])}
    runner = AgentRunner(lambda sample, client: programs[sample.request_id.split("#")[0]](sample, client), None,
                         max_context=128, vocab_size=LLAMA.vocab_size, program_timeout_s=300)
    try:
        outputs = drive_agents(engine, runner, [AgentSample(f"{name}#0", None, PROMPT, "", {}) for name in programs],
                               PARAMS)
    finally:
        runner.shutdown()
    by_name = {o.request_id.split("#")[0]: o for o in outputs}
    got = {name: (o.trajectory["failure_kind"], o.trajectory["environment_failure"]) for name, o in by_name.items()}
    assert got == {**{name: (kind, reason) for name, (_, kind, reason) in CASES.items()}, "good": (None, None)}
    assert all(o.token_ids == [] and o.prompt_token_ids == PROMPT for name, o in by_name.items() if name != "good")
    good = by_name["good"]
    assert good.loss_mask == [True] * 3 + [False] * 2 + [True] * 3 and good.trajectory["turns"] == 2
    # an exception's traceback is in the log, down to the program's own line
    err = capfd.readouterr().err
    assert "excluded: the rollout program raised KeyError: 'state'\nTraceback (most recent call last)" in err
    assert 'in program\n    raise error' in err


def test_the_program_timeout_is_refused_at_start_unless_below_the_generator_timeout(capsys):
    from megatron_rl.config.arguments import parse_args

    agents = ["--custom-generate-function-path", f"{os.path.dirname(__file__)}/agent_programs.py:two_turns"]
    for flags, given in ((["--rollout-program-timeout", "900"], "900"), (["--generator-timeout", "300"], "600"),
                         (["--rollout-program-timeout", "0"], "0")):
        with pytest.raises(SystemExit):
            parse_args(agents + flags)
        err = capsys.readouterr().err
        assert "--rollout-program-timeout must be > 0 and below --generator-timeout" in err and f"got {given}" in err
    assert parse_args(["--generator-timeout", "300"]).rollout_program_timeout == 600  # no agents: not used
    assert parse_args(agents + ["--rollout-program-timeout", "30"]).rollout_program_timeout == 30


def _run_by_name(programs: dict, timeout_s: float | None, is_eval=()) -> AgentRunner:
    """A runner whose samples are named after their programs, started."""
    runner = AgentRunner(lambda sample, client: programs[sample.request_id.split("#")[0]](sample, client), None,
                         max_context=128, vocab_size=LLAMA.vocab_size, program_timeout_s=timeout_s)
    for name in programs:
        runner.start(AgentSample(f"{name}#0", None, PROMPT, "", {}, is_eval=name in is_eval), PARAMS)
    return runner


def test_a_program_waiting_on_what_nothing_references_is_not_collected():
    """The runner keeps its programs' tasks: the loop's own references are weak, so a garbage collection would
    otherwise close a program awaiting an event only it knows of (GeneratorExit in the middle of its await)."""
    waiting, collected = threading.Event(), threading.Event()

    async def forgotten(sample, client):
        try:
            waiting.set()
            await asyncio.Event().wait()
        except GeneratorExit:
            collected.set()
            raise

    runner = _run_by_name({"forgotten": forgotten}, timeout_s=None)
    try:
        assert waiting.wait(60)
        gc.collect()  # a collected program is closed right here, in this thread
        assert not collected.is_set() and runner.take_finished() == []
    finally:
        runner.shutdown()


def test_a_program_that_hangs_times_out_with_its_reason_and_the_others_go_on():
    """--rollout-program-timeout: a program waiting on an event that never fires, an evaluation sample asleep, one
    that swallows its cancellation and returns late: each times out with the reason; one that does not hang
    finishes beside them."""
    async def waits(sample, client):
        await asyncio.Event().wait()

    async def asleep(sample, client):
        await asyncio.sleep(3600)

    async def stubborn(sample, client):
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        return Trajectory(list(sample.prompt_token_ids))

    programs = {"waits": waits, "asleep": asleep, "stubborn": stubborn, "quick": returning()}
    runner = _run_by_name(programs, timeout_s=1, is_eval=("asleep",))
    try:
        outputs = []
        while len(outputs) < len(programs):
            runner.wait(1.0)
            outputs += runner.take_finished()
    finally:
        runner.shutdown()
    timed_out = ("timeout", "the rollout program ran longer than --rollout-program-timeout 1 s")
    assert {o.request_id: (o.trajectory["failure_kind"], o.trajectory["environment_failure"]) for o in outputs} == {
        "waits#0": timed_out, "asleep#0": timed_out, "stubborn#0": timed_out, "quick#0": (None, None)}


# ---- the OpenAI endpoint ---------------------------------------------------------------------------------------------

def _chat(*messages, **fields) -> dict:
    return {"messages": list(messages), **fields}


USER = {"role": "user", "content": "1+1=?"}
CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "a", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}
NESTED = b"[" * 100_000 + b"]" * 100_000
# (name, path, body, status, what the error message says)
REQUESTS = [
    ("not JSON", "completions", b"{not json", 400, "the request body is not JSON"),
    ("empty body", "completions", b"", 400, "the request body is not JSON"),
    ("invalid UTF-8", "completions", b'{"prompt": "\xff\xfe"}', 400, "the request body is not UTF-8"),
    ("a lone surrogate", "completions", b'{"prompt": "\\ud800"}', 400, "prompt is not valid Unicode"),
    ("a JSON array", "completions", b"[1, 2]", 400, "the request body must be a JSON object, got list"),
    ("nested 100,000 deep", "completions", NESTED, 400, "the request body is nested too deeply"),
    ("nested in a prompt", "completions", b'{"prompt": ' + NESTED + b"}", 400, "nested too deeply"),
    ("larger than the limit", "completions", b" " * (64 * 2**20 + 1), 413, "larger than 67108864 bytes"),
    ("an id outside the vocabulary", "completions", {"prompt": [1_000_000]}, 400,
     "prompt[0] = 1000000 is outside the vocabulary [0, 200)"),
    ("a negative id", "completions", {"prompt": [3, -1]}, 400, "prompt[1] = -1 is outside the vocabulary"),
    ("a float id", "completions", {"prompt": [1.5]}, 400, "prompt[0] is float 1.5: token ids are ints"),
    ("a bool id", "completions", {"prompt": [True]}, 400, "prompt[0] is bool True"),
    ("ids in a list", "completions", {"prompt": [[1, 2]]}, 400, "prompt[0] is list"),
    ("no prompt", "completions", {}, 400, "'prompt' must be a string or a list of token ids"),
    ("an empty prompt", "completions", {"prompt": []}, 400, "prompt is empty"),
    ("an empty text prompt", "completions", {"prompt": ""}, 400, "prompt is empty"),
    ("a prompt longer than the context", "completions", {"prompt": [1] * 5000}, 400,
     "the prompt has 5000 tokens: no room for an answer within --seq-length 128"),
    ("max_tokens true", "completions", {"prompt": [1], "max_tokens": True}, 400,
     "'max_tokens' must be a positive integer, got True"),
    ("max_tokens 0", "completions", {"prompt": [1], "max_tokens": 0}, 400, "'max_tokens' must be a positive"),
    ("max_tokens a string", "completions", {"prompt": [1], "max_tokens": "8"}, 400, "'max_tokens' must be"),
    ("max_tokens NaN", "completions", b'{"prompt": [1], "max_tokens": NaN}', 400, "'max_tokens' must be"),
    ("n 2", "completions", {"prompt": [1], "n": 2}, 400, "'n' must be 1"),
    ("n true", "completions", {"prompt": [1], "n": True}, 400, "'n' must be 1"),
    ("stream", "completions", {"prompt": [1], "stream": True}, 400, "'stream' is not supported"),
    ("stop strings", "completions", {"prompt": [1], "stop": ["\n"]}, 400, "'stop' strings are not supported"),
    ("no messages", "chat/completions", {}, 400, "'messages' must be a non-empty list"),
    ("messages a string", "chat/completions", {"messages": "hi"}, 400, "'messages' must be a non-empty list"),
    ("a message a string", "chat/completions", _chat("hi"), 400,
     "messages[0] must be a message object, got str"),
    ("no role", "chat/completions", _chat({"content": "hi"}), 400,
     "messages[0].role must be one of ['system', 'user', 'assistant', 'tool'], got None"),
    ("an unknown role", "chat/completions", _chat({"role": "wizard", "content": "hi"}), 400,
     "messages[0].role must be one of"),
    ("content a number", "chat/completions", _chat({"role": "user", "content": 5}), 400,
     "messages[0].content must be a string or a list of text parts, got int"),
    ("an image part", "chat/completions",
     _chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}), 400,
     "messages[0].content[0] must be"),
    ("tool_calls not a list", "chat/completions", _chat(USER, {**CALLED, "tool_calls": "calculator"}), 400,
     "messages[1].tool_calls must be a list, got str"),
    ("a tool call without a function", "chat/completions", _chat(USER, {**CALLED, "tool_calls": [{"id": "a"}]}),
     400, "messages[1].tool_calls[0] must be"),
    ("tool call arguments a number", "chat/completions",
     _chat(USER, {**CALLED, "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}), 400,
     "messages[1].tool_calls[0].function.arguments must be a JSON string or an object, got int"),
    ("tool_calls on a user message", "chat/completions", _chat({**USER, "tool_calls": []}), 400,
     "messages[0]: only an assistant message has tool_calls"),
    ("tool content a dict", "chat/completions", _chat(USER, CALLED, {"role": "tool", "content": {"x": 1}}), 400,
     "messages[2].content must be a string or a list of text parts, got dict"),
    ("tool_call_id a number", "chat/completions", _chat(USER, CALLED, {"role": "tool", "content": "2",
                                                                       "tool_call_id": 7}), 400,
     "messages[2].tool_call_id must be a string, got int"),
    ("tools not a list", "chat/completions", _chat(USER, tools="calculator"), 400, "'tools' must be a list"),
    ("a huge message", "chat/completions", _chat({"role": "user", "content": "1" * 200_000}), 400,
     "no room for an answer within --seq-length 128"),
    ("max_completion_tokens -1", "chat/completions", _chat(USER, max_completion_tokens=-1), 400,
     "'max_completion_tokens' must be a positive integer, got -1"),
]


def test_the_endpoint_answers_every_malformed_request_with_a_4xx_and_serves_the_next_agent(engine):
    """Each malformed request on a session of its own (a refused session stays refused, and its trajectory is then
    excluded as invalid input); a wrong key and an unknown session too. Then an agent with the real `openai`
    client gets its answers from the engine, which none of the malformed requests reached."""
    import aiohttp
    import openai

    from megatron_rl.data.tasks import tool_arithmetic

    tokenizer = tool_arithmetic.build_tokenizer()
    answers, refused = [], []

    async def program(sample, client):
        async with aiohttp.ClientSession() as http:
            for name, path, body, _, _ in REQUESTS:
                session = await client.openai_session()
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with http.post(f"{session.base_url}/{path}", data=data,
                                     headers={"Authorization": f"Bearer {session.api_key}"}) as r:
                    answers.append((name, r.status, (await r.json())["error"]["message"]))
                with pytest.raises(InvalidInput) as e:
                    session.trajectory  # noqa: B018 - the property raises
                refused.append(str(e.value))
            for name, key, sid in (("a wrong key", "wrong", session.base_url),
                                   ("an unknown session", session.api_key, session.base_url.replace("/sessions/",
                                                                                                   "/sessions/x"))):
                async with http.post(f"{sid}/completions", json={"prompt": [1]},
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                    answers.append((name, r.status, (await r.json())["error"]["message"]))
        session = await client.openai_session()
        api = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        reply = await api.chat.completions.create(model="policy", messages=[USER], max_tokens=4)
        answers.append(("well-formed", 200, reply.choices[0].finish_reason))
        return session.trajectory

    runner = AgentRunner(program, tokenizer, max_context=128, vocab_size=LLAMA.vocab_size,
                         end_of_turn_ids=[tokenizer.eos_token_id], program_timeout_s=300)
    try:
        [output] = drive_agents(engine, runner, [AgentSample("fuzz#0", None, PROMPT, "", {})], PARAMS)
    finally:
        runner.shutdown()
    for (name, _, _, status, message), (got_name, got_status, got_message) in zip(REQUESTS, answers):
        assert (got_name, got_status) == (name, status) and message in got_message, (name, got_status, got_message)
    assert [(n, s) for n, s, _ in answers[len(REQUESTS):]] == [("a wrong key", 401), ("an unknown session", 404),
                                                               ("well-formed", 200)]
    assert all(r.startswith("the OpenAI endpoint refused a request of the agent: ") for r in refused)
    assert output.trajectory["environment_failure"] is None and output.trajectory["turns"] == 1
    assert 1 <= len(output.token_ids) <= 4 and all(output.loss_mask)
