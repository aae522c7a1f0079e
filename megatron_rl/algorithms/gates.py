"""Gates that decide which data may be trained on (GLM-5's three layers, from the seed chapter), each
returning what it dropped and why. Dropping stale or broken data is a correct choice, not a waste; what
matters is that every drop is counted with its reason.

- token: a two-sided ratio interval masks tokens whose pi/mu is outside [low, high];
- trajectory: a sample whose oldest behavior version lags the trainer by more than `max_lag` is discarded;
- environment / infrastructure: samples whose reward is an infrastructure failure are excluded, never
  scored 0 (a policy trained on machine faults learns to avoid machines);
- group: groups whose rewards are all equal carry no signal under a group baseline and are dropped.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import torch

from megatron_rl.algorithms import checks


@dataclasses.dataclass
class GateResult:
    """`keep[i]` says whether item i survives; `reasons[i]` is why it did not (None if kept)."""

    keep: torch.Tensor
    reasons: list[str | None]

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(r for r in self.reasons if r is not None))

    def __and__(self, other: GateResult) -> GateResult:
        """Combine two gates over the same items; the first reason found is kept."""
        reasons = [a if a is not None else b for a, b in zip(self.reasons, other.reasons)]
        return GateResult(self.keep & other.keep, reasons)


def token_ratio_mask(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                     low: float = 0.5, high: float = 2.0) -> tuple[torch.Tensor, dict[str, int]]:
    """Mask valid tokens whose ratio pi/mu is outside [low, high]. Returns (new mask, counts)."""
    checks.bool_mask("loss_mask", loss_mask)
    checks.same_shape("logprobs", logprobs, behavior_logprobs=behavior_logprobs, loss_mask=loss_mask)
    if not 0 <= low < 1 < high:
        raise ValueError(f"ratio interval must satisfy 0 <= low < 1 < high, got [{low}, {high}]")
    zero = torch.zeros((), dtype=logprobs.dtype)
    log_ratio = torch.where(loss_mask, logprobs.detach() - behavior_logprobs, zero)
    log_low = torch.log(torch.tensor(low, dtype=torch.float64)).item() if low > 0 else float("-inf")
    log_high = torch.log(torch.tensor(high, dtype=torch.float64)).item()
    below = loss_mask & (log_ratio < log_low)
    above = loss_mask & (log_ratio > log_high)
    return loss_mask & ~below & ~above, {"ratio_below_low": int(below.sum()), "ratio_above_high": int(above.sum())}


def version_gate(trainer_version: int, oldest_behavior_versions: Sequence[int], max_lag: int) -> GateResult:
    """Discard samples whose oldest behavior version is more than `max_lag` versions behind the trainer."""
    if max_lag < 0:
        raise ValueError(f"max_lag (--max-staleness) must be >= 0, got {max_lag}")
    lags = [trainer_version - v for v in oldest_behavior_versions]
    if any(lag < 0 for lag in lags):
        raise ValueError(f"a behavior version is newer than the trainer version {trainer_version}: "
                         f"{max(oldest_behavior_versions)}")
    reasons = [f"stale: lag {lag} > max staleness {max_lag}" if lag > max_lag else None for lag in lags]
    return GateResult(torch.tensor([r is None for r in reasons], dtype=torch.bool), reasons)


def failure_gate(statuses: Sequence[str], failure_statuses: Sequence[str] = ("scorer-failure", "timeout",
                                                                          "generator-failure")) -> GateResult:
    """Exclude samples whose reward could not be computed for infrastructure reasons."""
    failed = set(failure_statuses)
    reasons = [f"infrastructure failure: {s}" if s in failed else None for s in statuses]
    return GateResult(torch.tensor([r is None for r in reasons], dtype=torch.bool), reasons)


def group_filter(rewards: torch.Tensor, group_ids: torch.Tensor, keep: torch.Tensor | None = None) -> GateResult:
    """Drop every member of a group whose (kept) rewards are all equal: zero advantage, no signal."""
    keep = torch.ones_like(rewards, dtype=torch.bool) if keep is None else keep
    reasons: list[str | None] = [None] * rewards.shape[0]
    out = keep.clone()
    for gid in torch.unique(group_ids):
        members = (group_ids == gid) & keep
        values = rewards[members]
        if values.numel() and bool((values == values[0]).all()):
            for i in torch.nonzero(members).flatten().tolist():
                out[i] = False
                reasons[i] = "group rewards all equal"
    return GateResult(out, reasons)
