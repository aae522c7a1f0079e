"""PPO/GRPO double-sided clipped surrogate.

Kept beside AIPO for the comparison of the LlamaRL appendix: PPO clips the ratio to [1 - eps, 1 + eps_high]
conditioned on the sign of the advantage (taking the pessimistic of the two surrogates), so tokens outside
the trust region get zero gradient.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms import checks
from megatron_rl.algorithms.aggregation import aggregate
from megatron_rl.algorithms.diagnostics import offpolicy_diagnostics


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """max(-A * r, -A * clip(r, 1 - eps, 1 + eps_high)) per token, r = pi / pi_old."""
    checks.float_tensor("logprobs", logprobs)
    checks.float_tensor("old_logprobs", old_logprobs)
    checks.bool_mask("loss_mask", loss_mask)
    checks.same_shape("logprobs", logprobs, old_logprobs=old_logprobs, loss_mask=loss_mask)
    advantages = checks.token_advantages(advantages, logprobs)
    checks.finite_where("advantages", advantages, loss_mask)
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    zero = torch.zeros((), dtype=logprobs.dtype)
    log_ratio = torch.where(loss_mask, logprobs - old_logprobs, zero).clamp(max=20.0)
    ratio = torch.exp(log_ratio)
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, 1 + high))
    loss = aggregate(surrogate, loss_mask, aggregation, normalizer, constant)
    metrics = offpolicy_diagnostics(logprobs.detach(), old_logprobs, loss_mask, clip_low=1 - clip_eps,
                                    clip_high=1 + high)
    return loss, metrics

