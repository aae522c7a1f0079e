"""What a reward function returns for one response: the reward and whether it could be computed at all."""

from __future__ import annotations

import dataclasses

STATUSES = ("scored", "wrong-format", "timeout", "scorer-failure")
INFRASTRUCTURE_FAILURES = ("timeout", "scorer-failure")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    reward: float
    status: str
    extracted: str | None = None
    detail: str = ""

    @property
    def is_failure(self) -> bool:
        """True when the reward could not be computed: the sample must be excluded, not trained on."""
        return self.status in INFRASTRUCTURE_FAILURES
