"""Importance ratios on the trained tokens and the two per-token forms every policy loss here is built from.

Log-ratios are taken on valid tokens only (0 elsewhere: masked tokens may hold -inf log-probs) and clamped to
+-`LOG_RATIO_LIMIT`, so that exp stays finite in fp32 and bf16 (e^20 ~ 5e8: far past every clip bound here).
"""

from __future__ import annotations

import torch

LOG_RATIO_LIMIT = 20.0


def valid(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The log-probs on valid tokens, 0 elsewhere: no -inf reaches an exp or a product."""
    return torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype))


def ratio(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(numerator - denominator) on valid tokens, 1 elsewhere; differentiable through both log-probs."""
    log_ratio = valid(numerator, mask) - valid(denominator, mask)
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def weighted_log_likelihood(weight: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
    """-w * A * log pi per token with the weight held constant: the gradient is -w * A * grad log pi."""
    return -weight.detach() * advantages * valid(logprobs, mask)


def on_valid(indicators: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics of a loss: each per-token indicator, False off the valid tokens."""
    return {name: flag & mask for name, flag in indicators.items()}
