"""What a reward function is given for one response (`RewardSample`) and what it returns (`RewardResult`): the
reward and whether it could be computed at all."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RewardSample:
    prompt: str  # the prompt as the model saw it, decoded without special tokens
    response: str  # the generated text, without the end-of-sequence token
    label: Any  # the dataset's reference answer ("answer"), as it is
    metadata: dict = dataclasses.field(default_factory=dict)  # the dataset record's "metadata"
    finish_reason: str = "stop"  # "stop" | "length" (truncated) | "abort"


STATUSES = ("scored", "wrong-format", "timeout", "scorer-failure", "bad-input", "environment-failure")
INFRASTRUCTURE_FAILURES = ("timeout", "scorer-failure")
# Not trained on: the reward could not be computed (infrastructure), the sample's own data is unusable (a label
# that is None, say), which is no more the policy's fault than a crashed worker, or the environment of an agent
# trajectory failed (a crashed sandbox, an unreachable tool server: `tools.EnvironmentFailure`).
EXCLUDED_STATUSES = INFRASTRUCTURE_FAILURES + ("bad-input", "environment-failure")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    status: str
    extracted: str | None = None
    detail: str = ""
    extras: dict = dataclasses.field(default_factory=dict)  # a custom reward function's other outputs (JSON)

    @property
    def is_failure(self) -> bool:
        """True when the reward could not be computed: the sample must be excluded, not trained on."""
        return self.status in EXCLUDED_STATUSES
