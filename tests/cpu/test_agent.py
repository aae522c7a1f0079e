"""Agent rollouts: trajectories of policy and tool tokens through the built-in engine across a weight update
(against `transformers`), the tool loop on the chat template, environment failures excluded and counted, and a
launch with a rollout program from a file, scored by a reward server (--rm-url). The Python tool's sandbox has its
own tests: test_sandbox.py.

fp32; log-prob tolerance 1e-5 (the engine and transformers order their reductions differently, ~1e-7)."""

import asyncio
import collections
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, drive_agents, policy_turns, random_hf_weights
from reward_server import reward_server

from megatron_rl.controller.buffer import Rollout, RolloutBuffer
from megatron_rl.controller.reward_failures import RewardFailures, environment_failures
from megatron_rl.controller.reward_stage import RewardStage
from megatron_rl.data.tasks import tool_arithmetic
from megatron_rl.models import weight_map
from megatron_rl.models.hf import save_random_hf_model
from megatron_rl.models.spec import get_model_spec
from megatron_rl.rewards.types import RewardResult
from megatron_rl.rollout import LocalEngine
from megatron_rl.rollout.agent import (
    AgentFailure,
    AgentRunner,
    AgentSample,
    Generation,
    GenerationClient,
    InvalidInput,
    MultiTurn,
    ToolTurns,
    Trajectory,
    TrajectoryLimits,
)
from megatron_rl.rollout.types import NOT_SAMPLED, RequestMeta, RolloutOutput, SamplingParams
from megatron_rl.tools import (
    SandboxLimits,
    ToolCall,
    ToolSet,
    built_in_tools,
    format_tool_call,
    load_tool_config,
    parse_tool_calls,
)

LLAMA = get_model_spec("tiny-llama").replace(name="tiny-llama-v200", vocab_size=200)
OBSERVATION = [20, 21, 22]


# ---- a trajectory through the engine ------------------------------------------------------------------------------

def test_a_trajectory_through_the_engine_across_a_weight_update(tmp_path):
    import transformers

    old = save_random_hf_model(LLAMA, tmp_path / "old", seed=0)
    new_weights = random_hf_weights(LLAMA, seed=5, std=0.1)
    new = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "old")
    new.load_state_dict(new_weights)
    engine = LocalEngine.from_hf(str(tmp_path / "old"), max_slots=8)

    def update():
        engine.pause("retract")
        engine.begin_weight_update()
        engine.load_weights([(name, weight_map.assemble(lay, weight_map.slicer(new_weights)))
                             for name, lay in weight_map.sglang_shards(LLAMA, 1, 0).items()])
        engine.end_weight_update(version=1)
        engine.continue_generation()

    runner = AgentRunner(policy_turns(3, 4, OBSERVATION), tokenizer=None, max_context=128,
                         vocab_size=LLAMA.vocab_size)
    prompts = [[1, 5, 7, 9], [3, 4], [10, 11, 12]]
    samples = [AgentSample(f"p{i}#0", None, p, "", {}) for i, p in enumerate(prompts)]
    try:  # the update after the engine's 6th step: calls in flight are retracted and resume under it
        outputs = drive_agents(engine, runner, samples, SamplingParams(temperature=1.0, max_new_tokens=64, seed=7),
                               update, when=lambda steps: steps == 6)
    finally:
        runner.shutdown()
    assert sorted(o.request_id for o in outputs) == ["p0#0", "p1#0", "p2#0"]
    crossed = 0
    for out in outputs:
        policy = [True] * 4
        assert out.loss_mask == policy + [False] * 3 + policy + [False] * 3 + policy
        assert [t for t, m in zip(out.token_ids, out.loss_mask) if not m] == OBSERVATION * 2  # appended as given
        assert all(v == NOT_SAMPLED for v, m in zip(out.versions, out.loss_mask) if not m)
        assert all(lp == 0.0 for lp, m in zip(out.logprobs, out.loss_mask) if not m)
        versions = out.policy_versions
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        crossed += len(set(versions)) == 2
        assert out.trajectory["turns"] == 3
        # each policy token's log-prob is its sampling model's, given exactly the trajectory before it
        sequence = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logits = {v: m(torch.tensor([sequence])).logits[0] for v, m in ((0, old), (1, new))}
        start = len(out.prompt_token_ids)
        for j, (token, lp, v, m) in enumerate(zip(out.token_ids, out.logprobs, out.versions, out.loss_mask)):
            if m:
                want = torch.log_softmax(logits[v][start + j - 1], -1)[token]
                torch.testing.assert_close(torch.tensor(lp), want, atol=1e-5, rtol=0)
    assert crossed  # the update came in the middle of a trajectory (one of its calls was retracted and resumed)


# ---- the tool loop on a chat template -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_tokenizer():
    return tool_arithmetic.build_tokenizer()


class ScriptedPolicy:
    """Stands in for the engine behind a `GenerationClient`: answers each call with the next scripted turn (the
    engine path itself is tested above); records the prompts it was given."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def __call__(self, request_id, token_ids, params):
        self.prompts.append(list(token_ids))
        ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[:params.max_new_tokens]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        return RolloutOutput(request_id, token_ids, ids, [-0.5] * len(ids), [3] * len(ids), finish)


def _loop(tokenizer, tools=("calculator",), **limits):
    turns = ToolTurns(tokenizer, [tokenizer.eos_token_id])
    return MultiTurn(ToolSet(built_in_tools(tools), SandboxLimits(timeout_s=2, memory_mb=512)), turns,
                     limits.get("max_turns", 4), None, limits.get("max_observation_tokens", 64), "Use the calculator.")


def _run_loop(tokenizer, loop, script, budget=400):
    policy = ScriptedPolicy(tokenizer, script)
    client = GenerationClient(policy, "q#0", SamplingParams(max_new_tokens=budget, seed=1), tokenizer,
                              TrajectoryLimits(len(tokenizer), 4096, budget))
    sample = AgentSample("q#0", [{"role": "user", "content": "12*34+56=?"}], [1], "464", {})
    return asyncio.run(loop(sample, client)), policy


def test_the_tool_loop_trains_exactly_the_chat_templates_rendering(chat_tokenizer):
    """The template is prefix-stable: the trajectory's tokens are its rendering of the whole conversation, the
    policy's tokens are exactly its turns (and their end tokens), and each call continued the trajectory."""
    tok = chat_tokenizer
    call = format_tool_call("calculator", {"expression": "12*34+56"})
    answer = "The answer is \\boxed{464}."
    trajectory, policy = _run_loop(tok, _loop(tok), [call, answer])
    conversation = [{"role": "system", "content": "Use the calculator."},
                    {"role": "user", "content": "12*34+56=?"}, {"role": "assistant", "content": call},
                    {"role": "tool", "content": "464"}, {"role": "assistant", "content": answer}]
    rendered = tok.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert trajectory.token_ids == rendered[:len(trajectory.token_ids)]
    assert tok.decode(rendered[len(trajectory.token_ids):]) == "\n"  # what the template writes after the last turn
    out = trajectory.to_output("q#0")
    sampled = [t for t, m in zip(out.token_ids, out.loss_mask) if m]
    assert tok.decode(sampled) == call + "<|im_end|>" + answer + "<|im_end|>"
    assert policy.prompts == [trajectory.prompt_token_ids, trajectory.token_ids[:len(policy.prompts[1])]]
    assert (out.trajectory["turns"], out.trajectory["tool_calls"], out.trajectory["tool_errors"]) == (2, 1, 0)
    assert out.trajectory["response"] == answer and out.finish_reason == "stop"


def test_an_openai_client_drives_a_tool_conversation_through_the_endpoint(chat_tokenizer):
    """A real `openai` client (an agent written against the OpenAI API) talks to a session of the endpoint: the
    tool call comes back as OpenAI tool_calls, the agent runs the tool itself and sends the result; the session's
    trajectory is the chat template's rendering of the conversation, with exactly the policy's turns sampled."""
    import openai

    from megatron_rl.rollout.agent.openai_server import OpenAIEndpoint

    tok = chat_tokenizer
    call, answer = format_tool_call("calculator", {"expression": "12*34+56"}), "\\boxed{464}"
    policy = ScriptedPolicy(tok, [call, answer, "9", "10", "11"])
    tools = built_in_tools(["calculator"])
    chat = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "12*34+56=?"}]

    async def agent():
        endpoint = OpenAIEndpoint(tok, [tok.eos_token_id])
        client = GenerationClient(policy, "q#0", SamplingParams(max_new_tokens=100, seed=1), tok,
                                  TrajectoryLimits(len(tok), 4096, 300), endpoint)
        session, other = await client.openai_session(), await client.openai_session()
        try:
            api = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            first = (await api.chat.completions.create(model="policy", messages=chat, tools=tools)).choices[0]
            tool_call = first.message.tool_calls[0]
            result = await ToolSet(tools, SandboxLimits(2, 512), "built-in").call(
                ToolCall(tool_call.function.name, json.loads(tool_call.function.arguments)))
            messages = [*chat, first.message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": tool_call.id, "content": result.text}]
            second = (await api.chat.completions.create(model="policy", messages=messages)).choices[0]
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(base_url=session.base_url, api_key="wrong", max_retries=0).models.list()
            other_api = openai.AsyncOpenAI(base_url=other.base_url, api_key=session.api_key, max_retries=0)
            await other_api.chat.completions.create(model="policy", messages=chat)
            edited = [*chat, {"role": "assistant", "content": "I know it"}, {"role": "user", "content": "go on"}]
            with pytest.raises(openai.BadRequestError, match="message 2 \\(assistant\\) is not the session's"):
                await other_api.chat.completions.create(model="policy", messages=edited)
            with pytest.raises(InvalidInput, match="refused a request of the agent"):
                other.trajectory  # noqa: B018 - the property raises
            completion = await client.openai_session()
            capi = openai.AsyncOpenAI(base_url=completion.base_url, api_key=session.api_key, max_retries=0)
            one = await capi.completions.create(model="policy", prompt=[1, 2, 3])
            ids = completion.trajectory.token_ids
            two = await capi.completions.create(model="policy", prompt=[*ids, 7, 8], max_tokens=1)
            return first, second, session.trajectory, (one, two, completion.trajectory), messages
        finally:
            await endpoint.stop()

    first, second, trajectory, (one, two, completed), messages = asyncio.run(agent())
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert first.message.tool_calls[0].function.name == "calculator"
    assert messages[-1]["content"] == "464"  # the agent ran the tool
    assert second.finish_reason == "stop" and second.message.content == answer
    conversation = [*chat, {"role": "assistant", "content": call}, {"role": "tool", "content": "464"},
                    {"role": "assistant", "content": answer}]
    rendered = tok.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=False)
    assert trajectory.token_ids == rendered[:len(trajectory.token_ids)]
    out = trajectory.to_output("q#0")
    sampled = [t for t, m in zip(out.token_ids, out.loss_mask) if m]
    assert tok.decode(sampled) == call + "<|im_end|>" + answer + "<|im_end|>"
    assert out.trajectory["response"] == answer and out.trajectory["turns"] == 2
    assert (out.trajectory["tool_calls"], out.trajectory["tool_errors"]) == (1, 0)  # counted as the tool loop does
    # completions: the prompt's tokens beyond the session's are appended as given, not sampled
    assert one.choices[0].text == "10" and two.choices[0].finish_reason == "length"
    assert completed.token_ids[:3] == [1, 2, 3] and completed.token_ids[-3:-1] == [7, 8]
    assert completed.to_output("c").loss_mask[-3:] == [False, False, True]


def test_the_endpoint_stops_at_the_budget_as_the_tool_loop_does_and_keeps_the_trajectory(chat_tokenizer):
    """Past a trajectory's response budget the endpoint answers finish_reason "length" with what fits, the turn
    that does not fit left out, as the tool loop ends a trajectory whose tool turn does not fit: the trajectory is
    kept, truncated, not excluded. Chat: a tool call, then a tool result with no room left; completions: an
    answer cut to the room left, then tokens that do not fit."""
    import openai

    from megatron_rl.rollout.agent.boundary import check_trajectory
    from megatron_rl.rollout.agent.openai_server import OpenAIEndpoint

    tok = chat_tokenizer
    call = format_tool_call("calculator", {"expression": "2"})
    policy = ScriptedPolicy(tok, [call, "1234", "5678", "never asked"])
    chat_limits = TrajectoryLimits(len(tok), 4096, len(tok.encode(call)) + 1 + 3)  # the call, its end, 3 more
    completion_limits = TrajectoryLimits(len(tok), 4096, 5)

    async def agents():
        endpoint = OpenAIEndpoint(tok, [tok.eos_token_id])
        sessions = []
        for limits in (chat_limits, completion_limits):
            client = GenerationClient(policy, "q#0", SamplingParams(max_new_tokens=100, seed=1), tok, limits, endpoint)
            sessions.append(await client.openai_session())
        try:
            api = openai.AsyncOpenAI(base_url=sessions[0].base_url, api_key=sessions[0].api_key, max_retries=0)
            chat = [{"role": "user", "content": "2=?"}]
            first = (await api.chat.completions.create(model="policy", messages=chat)).choices[0]
            chat += [first.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "2"}]
            second = (await api.chat.completions.create(model="policy", messages=chat)).choices[0]
            chat += [second.message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
            third = (await api.chat.completions.create(model="policy", messages=chat)).choices[0]
            api = openai.AsyncOpenAI(base_url=sessions[1].base_url, api_key=sessions[1].api_key, max_retries=0)
            cut = await api.completions.create(model="policy", prompt=[1, 2, 3, 4], max_tokens=2)
            ids = sessions[1].trajectory.token_ids
            fits = await api.completions.create(model="policy", prompt=[*ids, 7])
            ids = sessions[1].trajectory.token_ids
            past = await api.completions.create(model="policy", prompt=[*ids, 8, 9])
            return (first, second, third), (cut, fits, past), [s.trajectory for s in sessions]
        finally:
            await endpoint.stop()

    (first, second, third), completions, (chatted, completed) = asyncio.run(agents())
    assert first.finish_reason == "tool_calls"
    assert [(c.finish_reason, c.message.content) for c in (second, third)] == [("length", "")] * 2
    assert [(c.choices[0].finish_reason, c.usage.completion_tokens) for c in completions] == \
        [("length", 2), ("length", 2), ("length", 0)]
    assert [c.choices[0].text for c in completions] == ["12", "56", ""]  # cut to max_tokens, to the room left
    for trajectory, limits, response in ((chatted, chat_limits, call), (completed, completion_limits, "56")):
        check_trajectory(trajectory, limits)  # kept: nothing past the budget, nothing excluded
        out = trajectory.to_output("q#0")
        assert out.finish_reason == "length" and out.trajectory["response"] == response
    assert (chatted.turns, chatted.tool_calls, chatted.num_response_tokens) == (1, 1, len(tok.encode(call)) + 1)
    assert completed.num_response_tokens == 5 and completed.segments[1].token_ids == [7]
    assert len(policy.prompts) == 3  # the calls that did not fit never reached the policy


def test_tool_errors_are_observations_and_the_limits_end_the_trajectory(chat_tokenizer):
    tok = chat_tokenizer
    bad = ["<tool_call>{not json</tool_call>", format_tool_call("calculator", {"expr": "1"}),
           format_tool_call("search", {"q": "x"}), format_tool_call("calculator", {"expression": "1/0"})]
    trajectory, _ = _run_loop(tok, _loop(tok, max_turns=5), [*bad, "done"], budget=2000)
    observations = [tok.decode(s.token_ids) for s in trajectory.segments if not s.is_policy]
    assert ["not valid JSON" in observations[0], "bad arguments for calculator" in observations[1],
            "no tool named 'search'" in observations[2], "division by zero" in observations[3]] == [True] * 4
    assert (trajectory.tool_calls, trajectory.tool_errors, trajectory.turns) == (4, 4, 5)
    # --max-turns: the last turn's call is not run; a long tool result is cut to --max-observation-len
    trajectory, _ = _run_loop(tok, _loop(tok, max_turns=2), [format_tool_call("calculator", {"expression": "2"})] * 2)
    assert (trajectory.turns, trajectory.tool_calls) == (2, 1)
    long = format_tool_call("calculator", {"expression": "7**300"})
    trajectory, _ = _run_loop(tok, _loop(tok, max_observation_tokens=10), [long, "ok"])
    assert "(244 more tokens)" in tok.decode(trajectory.segments[1].token_ids)
    # the response budget: a tool turn that does not fit ends the trajectory as truncated
    trajectory, _ = _run_loop(tok, _loop(tok), [format_tool_call("calculator", {"expression": "2"})], budget=40)
    assert trajectory.finish_reason == "length" and trajectory.turns == 1 and trajectory.num_response_tokens <= 40


def test_tool_calls_parse_in_the_hermes_format():
    text = 'a <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call> b <tool_call>{"name": "g", ' \
           '"arguments": "{\\"y\\": 2}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("f", {"x": 1}), ToolCall("g", {"y": 2})]
    assert parse_tool_calls("no call") == []
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[0].error


def test_the_tool_file_is_checked_naming_it(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(built_in_tools(["calculator"])))
    assert [t["function"]["name"] for t in load_tool_config(str(path))] == ["calculator"]
    for content, problem in [("[]", "non-empty list"), ('[{"type": "function", "function": {"name": "web"}}]',
                                                        "not a built-in"),
                             ('[{"type": "function", "function": {"name": "calculator", "parameters": '
                              '{"type": 3}}}]', "invalid parameters schema")]:
        path.write_text(content)
        with pytest.raises(ValueError, match=f"--tool-config '{path}'.*{problem}"):
            load_tool_config(str(path))


# ---- environment failures: excluded, counted, and a run stops on a broken environment --------------------------------

def test_an_environment_failure_is_excluded_not_scored():
    failed = RolloutOutput("p#0", [1], [], [], [], "stop", loss_mask=[],
                           trajectory=Trajectory([1]).summary(AgentFailure("environment", "sandbox worker crashed")))
    given = Trajectory([1])
    given.reward = 0.25
    scored = [failed, given.to_output("p#1")]

    def reward_fn(samples):
        raise AssertionError("neither sample goes to the reward function")

    stage = RewardStage.__new__(RewardStage)
    stage.reward_fn = reward_fn
    results = stage.score([(o, RequestMeta("p", i, "1", False, 0.0)) for i, o in enumerate(scored)])
    assert results == [RewardResult(0.0, "environment-failure", None, "sandbox worker crashed"),
                       RewardResult(0.25, "scored")]
    buffer = RolloutBuffer(2, 1)
    for i, (o, r) in enumerate(zip(scored, results)):
        buffer.add(Rollout(o, RequestMeta("p", i, "1", False, 0.0), r))
    batch = buffer.take(1, 0)
    assert [reason for _, reason in batch.outcomes] == ["infrastructure failure: environment-failure",
                                                        "group too small after gates"]
    # versions later, a failed trajectory (no policy token) is still excluded for its failure, not as stale, and
    # has no lag to count
    sampled, later = Trajectory([1]), RolloutBuffer(3, 1)
    sampled.add_policy(Generation([5], [-0.5], [4], "stop"))
    later.add(Rollout(failed, RequestMeta("q", 0, "1", False, 0.0), results[0]))
    for k in (1, 2):
        later.add(Rollout(sampled.to_output(f"q#{k}"), RequestMeta("q", k, "1", False, 0.0), RewardResult(k, "scored")))
    batch = later.take(1, 5)
    assert [reason for _, reason in batch.outcomes][0] == "infrastructure failure: environment-failure"
    assert len(batch.groups[0]) == 2 and batch.lag_histogram == {1: 2} and batch.popped == 1
    rewards, environment = RewardFailures(3), environment_failures(3)
    for _ in range(2):
        rewards.check(results[:1])
        environment.check(results[:1])
    assert rewards.streak == 0 and environment.streak == 2
    with pytest.raises(RuntimeError, match="the environment failed on the last 3 samples in a row "
                                           r"\(--max-consecutive-environment-failures 3\).*sandbox worker crashed"):
        environment.check(results[:1])


# ---- launches --------------------------------------------------------------------------------------------------------

PROGRAMS = os.path.join(ROOT, "tests", "cpu", "agent_programs.py")
LAUNCH = ["--global-batch-size", "8", "--micro-batch-size", "8", "--n-samples-per-prompt", "4", "--eval-size", "0",
          "--lr", "1e-3", "--reward-num-workers", "1", "--seed", "3", "--keep-uniform-groups",
          "--rollout-max-response-len", "16", "--max-staleness", "1"]


def _launch(out_dir, *flags, env=None):
    from megatron_rl.runtime.spawn import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "megatron_rl.train", *LAUNCH, "--output-dir", str(out_dir), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_rollout_programs_from_a_file_on_chat_data_are_trained_or_excluded_with_their_reasons(tmp_path):
    """One launch on chat data, rewards from a reward server (--rm-url), the programs of a file by sample index:
    `two_turns` (an observation between two sampled turns), the recipe (examples/chat_program.py: two turns
    through the OpenAI endpoint and the real `openai` client), one that raises, one that sends a token id outside
    the vocabulary through the endpoint; the first evaluation sample hangs. The run finishes. The good
    trajectories are trained as they were sampled; each bad sample is excluded with its reason in the ledger,
    counted by kind in its step's metrics (which average the good ones only), the hang's reason is in eval.json,
    the exception's traceback in the log; the accounting finds every sample, and a reason taken out of the
    ledger missing."""
    import shutil

    from megatron_rl.data.tasks import tool_arithmetic
    from megatron_rl.observability.accounting import account

    data, out = tmp_path / "data", tmp_path / "run"
    tool_arithmetic.write(str(data), train=16, eval_size=2, seed=0)
    with reward_server() as server:
        r = _launch(out, "--train-iters", "2", "--custom-generate-function-path", f"{PROGRAMS}:chat_agents",
                    "--rm-url", server.url("/score"), "--model", "tiny-arith", "--tokenizer", str(data / "tokenizer"),
                    "--seq-length", "128", "--prompt-data", str(data / "train.jsonl"), "--input-key", "messages",
                    "--label-key", "answer", "--apply-chat-template", "--eval-prompt-data", "heldout",
                    str(data / "eval.jsonl"), "--rollout-max-response-len", "48", "--rollout-program-timeout", "5")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    consumed = [row for row in rows if row["event"] in ("trained", "discarded")]
    assert len(consumed) == 8 * 2
    observation = len(tool_arithmetic.build_tokenizer().encode(" obs ", add_special_tokens=False))
    for row in consumed:
        t, k = row["trajectory"], row["sample_index"]
        if k in (0, 1):
            assert row["event"] == "trained" and row["reward_status"] == "scored", row
            assert t["turns"] == 2 and (t["environment_failure"], t["failure_kind"]) == (None, None)
            assert t["policy_tokens"] == sum(v != NOT_SAMPLED for v in row["versions"]) < len(row["versions"])
            assert row["lag"] == row["consumed_at_version"] - min(v for v in row["versions"] if v != NOT_SAMPLED)
            if k == 0:  # two_turns: 3 sampled tokens, the observation, 3 more
                assert t["policy_tokens"] == 6 and row["versions"][3:3 + observation] == [NOT_SAMPLED] * observation
            continue
        assert (row["event"], row["outcome"]) == ("discarded", "infrastructure failure: environment-failure")
        if k == 3:
            refused = re.fullmatch(r"the rollout program's input was refused: the OpenAI endpoint refused a request "
                                   r"of the agent: prompt\[0\] = (\d+) is outside the vocabulary \[0, (\d+)\)",
                                   t["environment_failure"])
            assert t["failure_kind"] == "invalid-input" and refused and int(refused[1]) == int(refused[2]) + 5, t
        else:
            assert (t["failure_kind"], t["environment_failure"]) == (
                "program-error", "the rollout program raised ValueError: the environment's state is inconsistent")
    assert "Traceback (most recent call last)" in r.stderr and "in chat_agents" in r.stderr
    asked = server.requests["/score"]  # the good ones only, with their programs' metadata
    assert {json.dumps(body["metadata"]) for body in asked} == {'{"program": "two_turns"}', '{"checked": true}'}
    served = collections.Counter(float(str(body["label"]) in body["response"]) for body in asked)
    assert collections.Counter(row["reward"] for row in consumed if row["event"] == "trained") <= served
    steps = [json.loads(line)["rollout"] for line in open(out / "metrics.jsonl") if '"rollout"' in line]
    assert [(m["agent_failures"], m["agent_environment_failures"], m["agent_turns_mean"]) for m in steps] == \
        [({"invalid-input": 2, "program-error": 2}, 4, 2.0)] * 2
    heldout = json.loads((out / "eval.json").read_text())["eval_sets"]["heldout"]
    assert heldout["before_rl"]["failure_reasons"] == [
        {"reason": "environment-failure: the rollout program ran longer than --rollout-program-timeout 5 s",
         "samples": 1}]
    assert heldout["after_rl"]["failures"] == 0
    report = account(str(out))
    assert report["problems"] == [] and report["agent_failures"] == {"invalid-input": 4, "program-error": 4}
    # a failure whose reason is lost is found
    shutil.copytree(out, tmp_path / "tampered")
    failed = next(i for i, row in enumerate(rows) if row.get("trajectory", {}).get("environment_failure"))
    rows[failed]["trajectory"]["environment_failure"] = None
    (tmp_path / "tampered" / "rollouts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    problems = account(str(tmp_path / "tampered"))["problems"]
    assert len(problems) == 2 and "1 samples of a failed environment without the failure's reason" in problems[0]
    assert f"step {rows[failed]['step']} counted the agent failures" in problems[1]


@pytest.mark.slow  # a launch (about 10 s); the failure rule itself is tested above without one
def test_a_run_whose_environment_always_fails_stops_with_the_reason(tmp_path):
    r = _launch(tmp_path, "--train-iters", "2", "--custom-generate-function-path", f"{PROGRAMS}:environment_down",
                "--max-consecutive-environment-failures", "8")
    assert r.returncode != 0
    assert re.search(r"the environment failed on the last (\d+) samples in a row \(--max-consecutive-environment-"
                     r"failures 8\); last failure: environment-failure: the tool server is unreachable",
                     r.stdout + r.stderr), r.stderr[-3000:]


@pytest.mark.slow  # two launches (about 60 s here)
def test_trajectories_in_flight_at_a_crash_are_generated_again_and_trained_once(tmp_path):
    from megatron_rl.observability.accounting import account
    from megatron_rl.runtime import failpoints

    ckpt = tmp_path / "ckpt"
    flags = ("--train-iters", "4", "--custom-generate-function-path", f"{PROGRAMS}:two_turns", "--save", str(ckpt),
             "--load", str(ckpt), "--save-interval", "2")
    killed = _launch(tmp_path, *flags, env={failpoints.ENV: "checkpoint-saved:2"})
    assert killed.returncode != 0 and (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    r = _launch(tmp_path, *flags)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = account(str(tmp_path))
    assert report["problems"] == [] and report["samples_generated_again"] > 0, report
    rows = [json.loads(line) for line in open(tmp_path / "rollouts.jsonl")]
    trained = collections.Counter((row["prompt_id"], row["sample_index"]) for row in rows if row["event"] == "trained")
    assert len(trained) == 8 * 4 and set(trained.values()) == {1}
    assert all(row["trajectory"]["turns"] == 2 for row in rows if row["event"] == "trained")
