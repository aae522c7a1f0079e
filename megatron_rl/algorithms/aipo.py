"""AIPO: Asynchronous Importance-weighted Policy Optimization (LlamaRL, section 5 and appendix A).

Per token, the gradient is

    min(pi_t / mu_t, rho) * A * grad log pi_t

with the clipped ratio held constant (stop-gradient) and clipped on one side only (no lower clip). mu is
the behavior policy that sampled the token (its log-prob as the generator computed it), pi the policy being
trained. With pi == mu it is REINFORCE with the group baseline.

`aipo_clamp_loss` is a different estimator kept under its own name: it writes the ratio without the
stop-gradient, clamp(pi/mu, max=rho) * A, whose gradient is ZERO for tokens above rho.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms import checks
from megatron_rl.algorithms.aggregation import aggregate
from megatron_rl.algorithms.diagnostics import offpolicy_diagnostics


def _validate(logprobs, behavior_logprobs, advantages, loss_mask, rho):
    checks.float_tensor("logprobs", logprobs)
    checks.float_tensor("behavior_logprobs", behavior_logprobs)
    checks.bool_mask("loss_mask", loss_mask)
    checks.same_shape("logprobs", logprobs, behavior_logprobs=behavior_logprobs, loss_mask=loss_mask)
    advantages = checks.token_advantages(advantages, logprobs)
    checks.finite_where("advantages", advantages, loss_mask)
    checks.finite_where("behavior_logprobs", behavior_logprobs, loss_mask)
    if not (isinstance(rho, (int, float)) and rho > 0 and math.isfinite(rho)):
        raise ValueError(f"rho must be a positive finite number, got {rho!r}")
    return advantages


def _safe_log_ratio(logprobs, behavior_logprobs, loss_mask):
    """log(pi/mu) on valid tokens, 0 elsewhere (masked tokens may hold -inf log-probs)."""
    zero = torch.zeros((), dtype=logprobs.dtype)
    return torch.where(loss_mask, logprobs.detach() - behavior_logprobs, zero)


def aipo_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rho: float = 4.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """AIPO loss and its diagnostics.

    logprobs [B, T] (carries the gradient), behavior_logprobs [B, T], advantages [B] or [B, T],
    loss_mask [B, T] bool (False for prompt, padding and observation tokens). See `aggregate` for
    `aggregation`, `normalizer` and `constant`.
    """
    advantages = _validate(logprobs, behavior_logprobs, advantages, loss_mask, rho)
    log_ratio = _safe_log_ratio(logprobs, behavior_logprobs, loss_mask)
    # min(exp(x), rho) = exp(min(x, log rho)): no overflow for huge ratios.
    weight = torch.exp(torch.clamp(log_ratio, max=math.log(rho)))  # no grad: log_ratio is detached
    safe_logprobs = torch.where(loss_mask, logprobs, torch.zeros((), dtype=logprobs.dtype))
    per_token = -weight * advantages * safe_logprobs
    loss = aggregate(per_token, loss_mask, aggregation, normalizer, constant)
    metrics = offpolicy_diagnostics(logprobs.detach(), behavior_logprobs, loss_mask, clip_high=rho)
    return loss, metrics


def aipo_clamp_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rho: float = 4.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clamp-without-stop-gradient variant: -clamp(pi/mu, max=rho) * A. Zero gradient above rho."""
    advantages = _validate(logprobs, behavior_logprobs, advantages, loss_mask, rho)
    zero = torch.zeros((), dtype=logprobs.dtype)
    log_ratio = torch.where(loss_mask, logprobs - behavior_logprobs, zero)
    ratio = torch.exp(torch.clamp(log_ratio, max=math.log(rho)))  # gradient flows; clamp kills it above rho
    per_token = -ratio * advantages
    loss = aggregate(per_token, loss_mask, aggregation, normalizer, constant)
    metrics = offpolicy_diagnostics(logprobs.detach(), behavior_logprobs, loss_mask, clip_high=rho)
    return loss, metrics
