"""The REINFORCE family: per token -sg(w) * A * log pi, an importance weight w held constant times the policy
gradient of every token (no token loses its gradient to a trust region). mu is the behavior policy.

- `reinforce`: w = 1, no correction: what training on lagged data without any correction means in an ablation.
- `icepop` (masked importance sampling: IcePop; the token mask of verl's rollout_rs token_k1; NeMo-RL's
  truncated_importance_sampling_type "icepop"): w = pi/mu where low <= pi/mu <= high, 0 outside, where the two
  policies disagree too much to trust the token. NeMo-RL's ProRLv2 configuration uses [0.5, 5.0].
- `cispo` (MiniMax-M1, arXiv:2506.13585): w = clip(pi/mu, 1 - eps_low, 1 + eps_high). MiniMax-M1 sets no lower
  bound (eps_low large) and tunes only eps_high; without eps_low, cispo is AIPO with rho = 1 + eps_high.

AIPO (aipo.py) is the member with w = min(pi/mu, rho).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms import checks, ratios
from megatron_rl.algorithms.aggregation import aggregate
from megatron_rl.algorithms.gates import token_ratio_mask
from megatron_rl.algorithms.losses.base import Hyperparameter, Loss, LossInputs


def reinforce_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-A * log pi per token; no statistics (nothing is clipped or masked)."""
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask)
    per_token = ratios.weighted_log_likelihood(torch.ones_like(logprobs), advantages, logprobs, loss_mask)
    return aggregate(per_token, loss_mask, aggregation, normalizer, constant), {}


def icepop_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    low: float = 0.5,
    high: float = 5.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sg(pi/mu) * A * log pi for tokens with low <= pi/mu <= high, 0 for the others (statistic: `masked`)."""
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask)
    kept, _ = token_ratio_mask(logprobs.detach(), behavior_logprobs, loss_mask, low, high)
    masked = loss_mask & ~kept
    ratio = ratios.ratio(logprobs.detach(), behavior_logprobs, loss_mask)
    weight = torch.where(masked, torch.zeros_like(ratio), ratio)
    per_token = ratios.weighted_log_likelihood(weight, advantages, logprobs, loss_mask)
    return aggregate(per_token, loss_mask, aggregation, normalizer, constant), ratios.on_valid({"masked": masked},
                                                                                                loss_mask)


def cispo_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float | None = None,
    eps_high: float = 3.0,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sg(clip(pi/mu, 1 - eps_low, 1 + eps_high)) * A * log pi; no lower clip when `eps_low` is None.
    Statistics: clip_high and (with `eps_low`) clip_low, the tokens whose weight was clipped."""
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask)
    checks.require(eps_high > 0, "eps_high", eps_high, "> 0")
    checks.require(eps_low is None or 0 <= eps_low <= 1, "eps_low", eps_low, "in [0, 1]")
    ratio = ratios.ratio(logprobs.detach(), behavior_logprobs, loss_mask)
    indicators = {"clip_high": ratio > 1 + eps_high}
    if eps_low is not None:
        indicators["clip_low"] = ratio < 1 - eps_low
    weight = ratio.clamp(min=None if eps_low is None else 1 - eps_low, max=1 + eps_high)
    per_token = ratios.weighted_log_likelihood(weight, advantages, logprobs, loss_mask)
    return aggregate(per_token, loss_mask, aggregation, normalizer, constant), ratios.on_valid(indicators, loss_mask)


# ---- registry entries --------------------------------------------------------------------------------------------

IS_MASK_LOW = Hyperparameter("is_mask_low", "--is-mask-low", 0.5,
                             "icepop: tokens whose pi/mu is below this are masked (NeMo-RL's ProRLv2 configuration: "
                             "0.5)")
IS_MASK_HIGH = Hyperparameter("is_mask_high", "--is-mask-high", 5.0,
                              "icepop: tokens whose pi/mu is above this are masked (NeMo-RL's ProRLv2 configuration: "
                              "5.0)")
CISPO_EPS_LOW = Hyperparameter("cispo_eps_low", "--cispo-eps-low", None,
                               "cispo: the weight is clipped below at 1 - this; default none (MiniMax-M1 sets no "
                               "lower bound)", lambda v: 0 <= v <= 1, "must be in [0, 1]")
CISPO_EPS_HIGH = Hyperparameter("cispo_eps_high", "--cispo-eps-high", 3.0,
                                "cispo: the weight is clipped above at 1 + this (MiniMax-M1 tunes it per run; the "
                                "default caps the weight at 4); without --cispo-eps-low, cispo equals aipo with rho = "
                                "1 + this", lambda v: v > 0, "must be > 0")


def _reinforce(x: LossInputs, p):
    return reinforce_loss(*x.tensors, **x.aggregation)


def _icepop(x: LossInputs, p):
    return icepop_loss(*x.tensors, p.is_mask_low, p.is_mask_high, **x.aggregation)


def _icepop_bounds(p) -> str | None:
    if not 0 <= p.is_mask_low < 1 < p.is_mask_high:
        return (f"--is-mask-low and --is-mask-high must satisfy 0 <= --is-mask-low < 1 < --is-mask-high, got "
                f"{p.is_mask_low} and {p.is_mask_high}")
    return None


def _cispo(x: LossInputs, p):
    return cispo_loss(*x.tensors, p.cispo_eps_low, p.cispo_eps_high, **x.aggregation)


REINFORCE = Loss(_reinforce, (), "no correction: -A log pi")
ICEPOP = Loss(_icepop, (IS_MASK_LOW, IS_MASK_HIGH),
              "weight pi/mu, tokens outside [--is-mask-low, --is-mask-high] masked", check=_icepop_bounds)
CISPO = Loss(_cispo, (CISPO_EPS_LOW, CISPO_EPS_HIGH),
             "clipped weight clip(pi/mu, 1 - --cispo-eps-low, 1 + --cispo-eps-high) (MiniMax-M1)")
