"""AIPO: Asynchronous Importance-weighted Policy Optimization (LlamaRL, section 5 and appendix A).

Per token, the gradient is

    min(pi_t / mu_t, rho) * A * grad log pi_t

with the clipped ratio held constant (stop-gradient) and clipped on one side only (no lower clip). mu is
the behavior policy that sampled the token (its log-prob as the generator computed it), pi the policy being
trained. With pi == mu it is REINFORCE with the group baseline.

`aipo_clamp_loss` is a different estimator kept under its own name: it writes the ratio without the
stop-gradient, clamp(pi/mu, max=rho) * A, whose gradient is ZERO for tokens above rho.

Both return the loss and their statistics: `clip_high`, the valid tokens whose ratio exceeds rho.
"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms import checks, ratios
from megatron_rl.algorithms.aggregation import aggregate
from megatron_rl.algorithms.losses.base import Hyperparameter, Loss, LossInputs


def _check_rho(rho) -> None:
    checks.require(isinstance(rho, (int, float)) and rho > 0 and math.isfinite(rho), "rho", rho,
                   "a positive finite number")


def aipo_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rho: float = 4.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AIPO loss and its per-token statistics.

    logprobs [B, T] (carries the gradient), behavior_logprobs [B, T], advantages [B] or [B, T],
    loss_mask [B, T] bool (False for prompt, padding and observation tokens). See `aggregate` for
    `aggregation`, `normalizer` and `constant`.
    """
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask)
    _check_rho(rho)
    ratio = ratios.ratio(logprobs.detach(), behavior_logprobs, loss_mask)
    per_token = ratios.weighted_log_likelihood(ratio.clamp(max=rho), advantages, logprobs, loss_mask)
    loss = aggregate(per_token, loss_mask, aggregation, normalizer, constant)
    return loss, ratios.on_valid({"clip_high": ratio > rho}, loss_mask)


def aipo_clamp_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rho: float = 4.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clamp-without-stop-gradient variant: -clamp(pi/mu, max=rho) * A. Zero gradient above rho."""
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask)
    _check_rho(rho)
    ratio = ratios.ratio(logprobs, behavior_logprobs, loss_mask)  # gradient flows; the clamp kills it above rho
    per_token = -ratio.clamp(max=rho) * advantages
    loss = aggregate(per_token, loss_mask, aggregation, normalizer, constant)
    return loss, ratios.on_valid({"clip_high": ratio.detach() > rho}, loss_mask)


# ---- registry entries --------------------------------------------------------------------------------------------

RHO = Hyperparameter("rho", "--aipo-rho", 4.0, "one-sided importance weight clip of aipo and aipo-clamp (paper: 2-10)",
                     lambda v: v > 0 and math.isfinite(v), "must be a positive finite number")


def _aipo(x: LossInputs, p):
    return aipo_loss(*x.tensors, rho=p.rho, **x.aggregation)


def _aipo_clamp(x: LossInputs, p):
    return aipo_clamp_loss(*x.tensors, rho=p.rho, **x.aggregation)


AIPO = Loss(_aipo, (RHO,), "the paper's one-sided clipped importance weight min(pi/mu, rho), held constant")
AIPO_CLAMP = Loss(_aipo_clamp, (RHO,), "clamp(pi/mu, max=rho) without the stop-gradient (zero gradient above rho)")
