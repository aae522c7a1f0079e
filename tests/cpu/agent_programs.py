"""Rollout programs for the agent tests, loaded by --custom-generate-function-path from this file."""

import asyncio
import contextlib
import os

import aiohttp  # noqa: F401 - see RECIPE
import openai

from megatron_rl.rollout.agent import EnvironmentFailure, Trajectory
from megatron_rl.runtime import plugins

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OBSERVATION = " obs "


async def two_turns(sample, client):
    """Three sampled tokens, an observation the policy did not write, three more sampled tokens."""
    trajectory = Trajectory(list(sample.prompt_token_ids))
    await client.sample(trajectory, max_new_tokens=3, stop_token_ids=(), ignore_eos=True)
    trajectory.add_observation(client.tokenizer.encode(OBSERVATION, add_special_tokens=False))
    await client.sample(trajectory, max_new_tokens=3, stop_token_ids=(), ignore_eos=True)
    trajectory.metadata = {"program": "two_turns"}
    return trajectory


async def environment_down(sample, client):
    raise EnvironmentFailure("the tool server is unreachable")


# loaded with this file, at the run's setup: a program's first call would otherwise spend its
# --rollout-program-timeout on importing openai and aiohttp (the endpoint's server)
RECIPE = plugins.load(os.path.join(ROOT, "examples", "chat_program.py") + ":generate", "the recipe")
_hung: set[str] = set()


async def chat_agents(sample, client):
    """By sample index: 0 `two_turns`, 1 the recipe on chat data (examples/chat_program.py: through the OpenAI
    endpoint), 2 raises, 3 sends a token id outside the vocabulary through the endpoint (refused: the sample is
    excluded). The first evaluation sample of the run waits for an event that never fires (--rollout-program-timeout
    ends it); the other evaluation samples run the recipe."""
    index = int(sample.request_id.rsplit("#", 1)[1])
    if sample.is_eval and not _hung:
        _hung.add(sample.request_id)
        await asyncio.Event().wait()
    if not sample.is_eval and index == 0:
        return await two_turns(sample, client)
    if not sample.is_eval and index == 2:
        raise ValueError("the environment's state is inconsistent")
    if not sample.is_eval and index == 3:
        session = await client.openai_session()
        async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as api:
            with contextlib.suppress(openai.BadRequestError):
                await api.completions.create(model="policy", prompt=[client.limits.vocab_size + 5])
        return session.trajectory
    return await RECIPE(sample, client)
