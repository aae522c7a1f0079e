"""Reward shaping for responses that run into the length limit: DAPO's soft overlong punishment.

With the response limit L (--rollout-max-response-len) and a buffer B (--overlong-buffer-len), a response of n
tokens loses nothing up to L - B tokens, then linearly more up to the factor at L, where the engine truncates
it (finish_reason "length"):

    penalty(n) = 0                                    if n <= L - B
                 -factor * min(n - (L - B), B) / B    otherwise

The penalty is added to every computed reward (scored or wrong-format), so that a truncated answer never earns
more than one that finished; a failure stays a failure. The other treatment of truncation, --mask-truncated,
keeps the reward and drops the rollout's gradient instead (`TrainBatch.from_groups`).
"""

from __future__ import annotations

import dataclasses

from megatron_rl.rewards.types import RewardResult


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    excess = length - (max_len - buffer_len)
    return 0.0 if excess <= 0 else -factor * min(excess, buffer_len) / buffer_len


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    max_len: int
    buffer_len: int
    factor: float = 1.0

    def __post_init__(self):
        if not 1 <= self.buffer_len <= self.max_len:
            raise ValueError(f"--overlong-buffer-len must be in [1, --rollout-max-response-len {self.max_len}], "
                             f"got {self.buffer_len}")
        if self.factor < 0:
            raise ValueError(f"--overlong-penalty-factor must be >= 0, got {self.factor}")

    def __call__(self, result: RewardResult, length: int) -> RewardResult:
        """`result` with the penalty of a response of `length` tokens added (recorded in its extras)."""
        penalty = overlong_penalty(length, self.max_len, self.buffer_len, self.factor)
        if result.is_failure or penalty == 0.0:
            return result
        return dataclasses.replace(result, reward=result.reward + penalty,
                                   extras={**result.extras, "overlong_penalty": penalty})
