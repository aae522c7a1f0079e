"""The PPO family: the clipped surrogate of a ratio r to an old policy, max(-A r, -A clip(r, 1 - eps, 1 + eps_high)),
which gives zero gradient to tokens outside the trust region on the side the advantage pushes them.

- `ppo`: the old policy is the behavior policy mu (r = pi/mu). Kept beside AIPO for the comparison of the LlamaRL
  appendix. Optional dual clip (Ye et al. 2020, arXiv:1912.09729; verl's `clip_ratio_c`, slime's `--eps-clip-c`):
  where A < 0 the per-token loss is min(surrogate, -C A), which bounds what a token with a huge ratio can cost.
- `tis`: slime's --use-tis: the surrogate of r = pi/pi_prox times the truncated importance weight
  min(pi_prox/mu, C) held constant (slime's `--tis-clip`, default 2.0).
- `decoupled-ppo` (AReaL, arXiv:2505.24298): the surrogate of r = pi/pi_prox times the behavior weight pi_prox/mu held
  constant; with `behav_imp_weight_cap` (AReaL's name), tokens whose behavior weight exceeds the cap are masked.

pi_prox is the proximal policy: the trainer's own weights at the start of the optimizer step. The trainer takes
exactly one optimizer step per rollout batch, so pi_prox IS the current policy and pi/pi_prox = 1 in value (with
the gradient of log pi): the trust region never binds, `tis` reduces to a truncated importance weight (the same
gradient as AIPO with rho = the tis clip) and `decoupled-ppo` to a masked, untruncated behavior weight (the same
gradient as icepop with no lower bound and the cap as upper one). The functions take a general proximal tensor all
the same (several optimizer steps per batch would need it).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms import checks, ratios
from megatron_rl.algorithms.aggregation import aggregate
from megatron_rl.algorithms.losses.base import Hyperparameter, Loss, LossInputs


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per token max(-A r, -A clip(r, clip_low, clip_high)), then min(that, -C A) where A < 0 with `dual_clip_c`.

    Written as a choice between -A r and a constant, so that each token's indicator says what happened to it:
    clip_high (A > 0, r > clip_high), clip_low (A < 0, r < clip_low), dual_clip (A < 0, r > C). A clipped token
    has zero gradient; the values are those of the max / min form.
    """
    high = (advantages > 0) & (ratio > clip_high)
    low = (advantages < 0) & (ratio < clip_low)
    bound = torch.where(high, torch.full_like(ratio, clip_high), torch.full_like(ratio, clip_low))
    per_token = torch.where(high | low, -advantages * bound, -advantages * ratio)
    indicators = {"clip_high": high, "clip_low": low}
    if dual_clip_c is not None:
        dual = (advantages < 0) & (ratio > dual_clip_c)
        per_token = torch.where(dual, -advantages * dual_clip_c, per_token)
        indicators["dual_clip"] = dual
    return per_token, indicators


def check_clip(clip_eps: float, clip_eps_high: float | None, dual_clip_c: float | None) -> float:
    """The PPO parameters' ranges; returns the upper clip eps (`clip_eps` when `clip_eps_high` is None)."""
    checks.require(0 < clip_eps < 1, "clip_eps", clip_eps, "in (0, 1)")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    checks.require(high > 0, "clip_eps_high", high, "> 0")
    checks.require(dual_clip_c is None or dual_clip_c > 1, "dual_clip_c", dual_clip_c, "> 1")
    return high


def _proximal(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor | None) -> torch.Tensor:
    """pi_prox: the given log-probs, or the current ones held constant (one optimizer step per batch)."""
    return (logprobs if proximal_logprobs is None else proximal_logprobs).detach()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate with r = pi/mu (see `clipped_surrogate`) and its per-token statistics."""
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask)
    high = check_clip(clip_eps, clip_eps_high, dual_clip_c)
    ratio = ratios.ratio(logprobs, behavior_logprobs, loss_mask)
    per_token, indicators = clipped_surrogate(ratio, advantages, 1 - clip_eps, 1 + high, dual_clip_c)
    return aggregate(per_token, loss_mask, aggregation, normalizer, constant), ratios.on_valid(indicators, loss_mask)


def tis_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    proximal_logprobs: torch.Tensor | None = None,
    tis_clip: float = 2.0,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per token surrogate(pi/pi_prox) * sg(min(pi_prox/mu, tis_clip)). Statistics: the surrogate's, and
    tis_clip (the behavior weight was truncated)."""
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask, proximal_logprobs)
    high = check_clip(clip_eps, clip_eps_high, dual_clip_c)
    checks.require(tis_clip > 0, "tis_clip", tis_clip, "> 0")
    proximal = _proximal(logprobs, proximal_logprobs)
    surrogate, indicators = clipped_surrogate(ratios.ratio(logprobs, proximal, loss_mask), advantages,
                                              1 - clip_eps, 1 + high, dual_clip_c)
    weight = ratios.ratio(proximal, behavior_logprobs, loss_mask)
    indicators["tis_clip"] = weight > tis_clip
    per_token = surrogate * weight.clamp(max=tis_clip).detach()
    return aggregate(per_token, loss_mask, aggregation, normalizer, constant), ratios.on_valid(indicators, loss_mask)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    proximal_logprobs: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip_c: float | None = None,
    aggregation: str = "token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per token surrogate(pi/pi_prox) * sg(pi_prox/mu), and 0 where pi_prox/mu > `behav_imp_weight_cap`.
    Statistics: the surrogate's, and with a cap `masked` (the behavior weight exceeded it)."""
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask, proximal_logprobs)
    high = check_clip(clip_eps, clip_eps_high, dual_clip_c)
    cap = behav_imp_weight_cap
    checks.require(cap is None or cap > 1, "behav_imp_weight_cap", cap, "> 1")
    proximal = _proximal(logprobs, proximal_logprobs)
    surrogate, indicators = clipped_surrogate(ratios.ratio(logprobs, proximal, loss_mask), advantages,
                                              1 - clip_eps, 1 + high, dual_clip_c)
    weight = ratios.ratio(proximal, behavior_logprobs, loss_mask)
    if cap is not None:
        indicators["masked"] = weight > cap
        weight = torch.where(indicators["masked"], torch.zeros_like(weight), weight)
    per_token = surrogate * weight.detach()
    return aggregate(per_token, loss_mask, aggregation, normalizer, constant), ratios.on_valid(indicators, loss_mask)


# ---- registry entries --------------------------------------------------------------------------------------------

CLIP_EPS = Hyperparameter("clip_eps", "--ppo-clip-eps", 0.2,
                          "clip range of ppo, tis and decoupled-ppo: the ratio is clipped to [1 - eps, 1 + "
                          "--ppo-clip-eps-high]; for gspo the sequence ratio's (GSPO's paper uses 3e-4 and 4e-4)",
                          lambda v: 0 < v < 1, "must be in (0, 1)")
CLIP_EPS_HIGH = Hyperparameter("clip_eps_high", "--ppo-clip-eps-high", None,
                               "upper clip range (DAPO's clip-higher); default --ppo-clip-eps", lambda v: v > 0,
                               "must be > 0")
DUAL_CLIP_C = Hyperparameter("dual_clip_c", "--ppo-dual-clip-c", None,
                             "dual clip of ppo, tis and decoupled-ppo: where A < 0 a token's loss is at most -C A "
                             "(verl's clip_ratio_c, whose default is 3); C > 1; default off", lambda v: v > 1,
                             "must be > 1 (it bounds the loss of a negative-advantage token at C |A|, above the "
                             "clip range)")
TIS_CLIP = Hyperparameter("tis_clip", "--tis-clip", 2.0,
                          "tis: the behavior importance weight pi_prox/mu is truncated at this value (slime's "
                          "--tis-clip, same default)", lambda v: v > 0, "must be > 0")
BEHAV_IMP_WEIGHT_CAP = Hyperparameter("behav_imp_weight_cap", "--behav-imp-weight-cap", None,
                                      "decoupled-ppo: tokens whose behavior weight pi_prox/mu exceeds this are "
                                      "masked (AReaL's name); > 1; default off", lambda v: v > 1, "must be > 1")
SURROGATE = (CLIP_EPS, CLIP_EPS_HIGH, DUAL_CLIP_C)


def _ppo(x: LossInputs, p):
    return ppo_clip_loss(*x.tensors, p.clip_eps, p.clip_eps_high, p.dual_clip_c, **x.aggregation)


def _tis(x: LossInputs, p):
    return tis_loss(*x.tensors, x.proximal_logprobs, p.tis_clip, p.clip_eps, p.clip_eps_high, p.dual_clip_c,
                    **x.aggregation)


def _decoupled_ppo(x: LossInputs, p):
    return decoupled_ppo_loss(*x.tensors, x.proximal_logprobs, p.behav_imp_weight_cap, p.clip_eps, p.clip_eps_high,
                              p.dual_clip_c, **x.aggregation)


PPO = Loss(_ppo, SURROGATE, "two-sided clipped surrogate of pi/mu")
TIS = Loss(_tis, SURROGATE + (TIS_CLIP,),
           "PPO surrogate times the truncated weight min(pi_prox/mu, --tis-clip) (slime's --use-tis)")
DECOUPLED_PPO = Loss(_decoupled_ppo, SURROGATE + (BEHAV_IMP_WEIGHT_CAP,), "AReaL's decoupled PPO")
