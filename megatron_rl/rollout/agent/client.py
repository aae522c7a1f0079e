"""What an agent program is given: its sample, and a client to the policy that speaks tokens in, tokens out.

A policy call is a request to this generator's engine like any other: it is decoded beside every other request,
and a weight update pauses, retracts and resumes it, so one call's tokens may carry two versions. The client
carries the run's sampling parameters and stop tokens, a seed per call derived from the sample's, and the limits:
no call goes past --seq-length, and `sample` and `observe` keep a trajectory within its response budget
(--rollout-max-response-len, every token after the prompt, policy or not). What a program passes in is checked
first (`boundary`): a bad call raises `InvalidInput` and never reaches the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from megatron_rl.rollout.agent import boundary
from megatron_rl.rollout.agent.boundary import TrajectoryLimits
from megatron_rl.rollout.agent.trajectory import Generation, Trajectory
from megatron_rl.rollout.types import RolloutOutput, SamplingParams
from megatron_rl.tools import EnvironmentFailure


@dataclasses.dataclass(frozen=True)
class AgentSample:
    request_id: str
    prompt: str | list[dict] | None  # the record's prompt as written: text or OpenAI messages
    prompt_token_ids: list[int]  # the run's rendering of it (--apply-chat-template, --system-prompt)
    label: Any  # the reference answer
    metadata: dict
    is_eval: bool = False


class GenerationClient:
    def __init__(self, submit: Callable[[str, list[int], SamplingParams], Awaitable[RolloutOutput]], request_id: str,
                 sampling_params: SamplingParams, tokenizer, limits: TrajectoryLimits, endpoint=None):
        """`limits`: the vocabulary, --seq-length and the sample's response budget; `endpoint`: the generator's
        `OpenAIEndpoint`, for `openai_session`."""
        self.sampling_params, self.tokenizer, self.limits = sampling_params, tokenizer, limits
        self._submit, self._request_id, self._calls = submit, request_id, 0
        self._endpoint, self.sessions = endpoint, []

    @property
    def max_context(self) -> int:
        return self.limits.max_context

    @property
    def response_budget(self) -> int:
        return self.limits.response_budget

    async def openai_session(self):
        """A session of the OpenAI-compatible endpoint whose calls are this sample's policy calls: give its
        `base_url` and `api_key` to an OpenAI client, and return its `trajectory` (`openai_server`)."""
        if self._endpoint is None:
            raise EnvironmentFailure("this generator has no OpenAI endpoint")
        session = await self._endpoint.open(self)
        self.sessions.append(session)
        return session

    async def generate(self, token_ids: list[int], **overrides) -> Generation:
        """The policy's continuation of `token_ids`; `overrides`: `SamplingParams` fields for this call. Stops at
        the context limit (finish_reason "length", possibly with no token). Token ids outside the vocabulary, an
        empty prompt or a bad override raise `InvalidInput` before the engine sees the call."""
        token_ids = boundary.token_ids(token_ids, "token_ids", self.limits.vocab_size)
        params = boundary.sampling_params(self.sampling_params, overrides, self.limits.vocab_size)
        room = self.max_context - len(token_ids)
        if room <= 0:
            return Generation([], [], [], "length")
        # the sample's seed and the call's number (None: the engine derives one from the call's request id)
        seed = None if params.seed is None else (params.seed * 1_000_003 + self._calls) & 0x7FFFFFFF
        params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room), seed=seed)
        output = await self._submit(f"{self._request_id}@{self._calls}", token_ids, params)
        self._calls += 1
        if output.finish_reason not in ("stop", "length"):
            raise EnvironmentFailure(f"the engine ended a policy call with finish reason {output.finish_reason!r}")
        return Generation(output.token_ids, output.logprobs, output.versions, output.finish_reason,
                          output.num_retractions)

    async def sample(self, trajectory: Trajectory, **overrides) -> Generation:
        """The policy's next turn of `trajectory`, appended to it, within what is left of its response budget (none
        once `observe` ended it)."""
        left = self.response_budget - trajectory.num_response_tokens
        if left <= 0 or trajectory.finish_reason == "length":
            trajectory.finish_reason = "length"
            return Generation([], [], [], "length")
        limit = boundary.sampling_params(self.sampling_params, overrides, self.limits.vocab_size).max_new_tokens
        generation = await self.generate(trajectory.token_ids, **{**overrides, "max_new_tokens": min(limit, left)})
        trajectory.add_policy(generation)
        return generation

    def observe(self, trajectory: Trajectory, token_ids: list[int]) -> bool:
        """Append tokens the policy did not sample (a tool's result, a user turn) if they leave room for another
        policy token in the response budget and --seq-length; if not, end the trajectory as truncated (finish
        reason "length", the tokens not appended: later `sample` calls return nothing) and return False. The
        trajectory is kept either way, as the built-in tool loop keeps one whose tool turn does not fit."""
        token_ids = boundary.token_ids(token_ids, "observation", self.limits.vocab_size, allow_empty=True)
        fits = trajectory.num_response_tokens + len(token_ids) < self.response_budget and \
            len(trajectory.token_ids) + len(token_ids) < self.max_context
        if not fits or trajectory.finish_reason == "length":
            trajectory.finish_reason = "length"
            return False
        trajectory.add_observation(token_ids)
        return True
