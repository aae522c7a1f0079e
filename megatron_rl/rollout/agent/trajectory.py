"""An agent trajectory: the prompt, then an ordered list of segments, each either tokens the policy sampled (with
the engine's behavior log-prob and weight version per token) or tokens it did not (tool output, environment text,
a user turn: never trained on, no log-prob, no importance ratio).

What is trained is exactly what was sampled: segments are token ids as they came out of the engine or were
appended, never text tokenized again. `to_output` flattens the trajectory into the `RolloutOutput` every rollout
is: the segments after the prompt as its tokens, `loss_mask` False on the tokens the policy did not sample,
their log-probs 0 and versions `NOT_SAMPLED`.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.rollout.types import NOT_SAMPLED, RolloutOutput

# Why a trajectory is excluded: the environment failed (`EnvironmentFailure`: a sandbox, a tool server, the engine),
# the program or its agent broke the contract (`boundary.InvalidInput`, an HTTP 400 of the OpenAI endpoint), the
# program raised anything else, or it ran past --rollout-program-timeout.
FAILURE_KINDS = ("environment", "invalid-input", "program-error", "timeout")


@dataclasses.dataclass(frozen=True)
class AgentFailure:
    """Why a trajectory cannot be trained on: `kind` (one of FAILURE_KINDS, counted per step) and `reason` (the
    message, in the ledger and eval.json)."""

    kind: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Generation:
    """What one policy call returned (`GenerationClient.generate`)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"
    num_retractions: int = 0


@dataclasses.dataclass
class Segment:
    token_ids: list[int]
    logprobs: list[float] | None = None  # None: the policy did not sample these tokens
    versions: list[int] | None = None
    finish_reason: str | None = None  # of the policy call that sampled them

    @property
    def is_policy(self) -> bool:
        return self.logprobs is not None


@dataclasses.dataclass
class Trajectory:
    prompt_token_ids: list[int]
    segments: list[Segment] = dataclasses.field(default_factory=list)
    reward: float | None = None  # given by the program; None: the run's reward function scores `response`
    response: str | None = None  # the text the reward function scores; None: every token after the prompt
    metadata: dict = dataclasses.field(default_factory=dict)  # JSON, for the reward function and the ledger
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str | None = None  # None: that of the last policy segment
    num_retractions: int = 0

    def add_policy(self, generation: Generation) -> None:
        """Append what the policy sampled (as the engine returned it)."""
        self.segments.append(Segment(list(generation.token_ids), list(generation.logprobs),
                                     list(generation.versions), generation.finish_reason))
        self.num_retractions += generation.num_retractions

    def add_observation(self, token_ids: list[int]) -> None:
        """Append tokens the policy did not sample (a tool's output in its chat turn, a user turn)."""
        self.segments.append(Segment(list(token_ids)))

    @property
    def token_ids(self) -> list[int]:
        """The prompt and every segment: the context the next policy call continues."""
        return self.prompt_token_ids + [t for s in self.segments for t in s.token_ids]

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    @property
    def turns(self) -> int:
        """Policy calls (assistant turns)."""
        return sum(s.is_policy for s in self.segments)

    def summary(self, failure: AgentFailure | None = None) -> dict:
        """What travels with the rollout (`RolloutOutput.trajectory`) to the reward stage, the metrics and the
        ledger: `environment_failure` is the reason it is excluded (None: it is not), `failure_kind` its kind."""
        return {"reward": self.reward, "response": self.response, "metadata": self.metadata, "turns": self.turns,
                "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "environment_failure": failure and failure.reason, "failure_kind": failure and failure.kind}

    def to_output(self, request_id: str, failure: AgentFailure | None = None) -> RolloutOutput:
        tokens, logprobs, versions, mask = [], [], [], []
        for s in self.segments:
            tokens += s.token_ids
            mask += [s.is_policy] * len(s.token_ids)
            logprobs += s.logprobs if s.is_policy else [0.0] * len(s.token_ids)
            versions += s.versions if s.is_policy else [NOT_SAMPLED] * len(s.token_ids)
        policy = [s for s in self.segments if s.is_policy]
        finish = self.finish_reason or (policy[-1].finish_reason if policy else "stop")
        return RolloutOutput(request_id, list(self.prompt_token_ids), tokens, logprobs, versions, finish,
                             self.num_retractions, loss_mask=mask, trajectory=self.summary(failure))
