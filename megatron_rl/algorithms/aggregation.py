"""How per-token losses become one scalar: the aggregation modes by name (the registry behind
--loss-aggregation).

Each mode is a sum over the batch divided by a normalizer. `normalizer` overrides the denominator: the trainer
passes each mode's GLOBAL count (`Aggregation.global_normalizer` of the whole batch's counts, across
micro-batches and DP ranks) so that summing micro-batch losses gives exactly the loss of the whole batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Aggregation:
    # (masked per-token values, mask, normalizer or None, constant or None) -> scalar
    reduce: Callable[[torch.Tensor, torch.Tensor, float | None, float | None], torch.Tensor]
    global_normalizer: Callable[[int, int], float]  # of the whole batch's (valid tokens, sequences)


def _token_mean(masked, mask, normalizer, constant):
    """Sum over valid tokens / number of valid tokens (the AIPO default)."""
    return masked.sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))


def _seq_mean_token_mean(masked, mask, normalizer, constant):
    """Mean over each sequence's valid tokens, then mean over sequences."""
    per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / (normalizer if normalizer is not None else max(per_seq.shape[0], 1))


def _seq_sum_constant(masked, mask, normalizer, constant):
    """Sum over valid tokens / a fixed constant per sequence (Dr.GRPO); `constant` defaults to T."""
    const = constant if constant is not None else masked.shape[-1]
    return masked.sum() / (const * (normalizer if normalizer is not None else max(masked.shape[0], 1)))


def _tokens(valid_tokens: int, sequences: int) -> float:
    return float(max(valid_tokens, 1))


def _sequences(valid_tokens: int, sequences: int) -> float:
    return float(sequences)


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": Aggregation(_token_mean, _tokens),
    "seq-mean-token-mean": Aggregation(_seq_mean_token_mean, _sequences),
    "seq-sum-constant": Aggregation(_seq_sum_constant, _sequences),
}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = "token-mean",
              normalizer: float | None = None, constant: float | None = None) -> torch.Tensor:
    """Reduce [B, T] per-token values over the valid tokens of `mask` (see `AGGREGATIONS`)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {aggregation!r} is unknown; choose one of {sorted(AGGREGATIONS)}")
    masked = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype))
    return AGGREGATIONS[aggregation].reduce(masked, mask, normalizer, constant)
