"""How per-token losses become one scalar: the aggregation modes, selectable by name.

`normalizer` overrides the denominator. The trainer passes the GLOBAL count (valid tokens, or sequences,
of the whole batch across micro-batches and DP ranks) so that summing micro-batch losses gives exactly the
loss of the whole batch.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-sum-constant")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              normalizer: float | None = None, constant: float | None = None) -> torch.Tensor:
    """Reduce [B, T] per-token values over the valid tokens of `mask`.

    - "token-mean": sum over valid tokens / number of valid tokens (the AIPO default).
    - "seq-mean-token-mean": mean over each sequence's valid tokens, then mean over sequences.
    - "seq-sum-constant": sum over valid tokens / a fixed constant (Dr.GRPO); `constant` defaults to T.
    """
    masked = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype))
    if mode == "token-mean":
        denom = normalizer if normalizer is not None else mask.sum().clamp(min=1)
        return masked.sum() / denom
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        denom = normalizer if normalizer is not None else max(per_seq.shape[0], 1)
        return per_seq.sum() / denom
    if mode == "seq-sum-constant":
        const = constant if constant is not None else per_token.shape[-1]
        denom = normalizer if normalizer is not None else max(per_token.shape[0], 1)
        return masked.sum() / (const * denom)
    raise ValueError(f"aggregation {mode!r} is unknown; choose one of {AGGREGATIONS}")
