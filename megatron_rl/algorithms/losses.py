"""The policy losses by name: the registry behind --loss.

mu is the behavior policy (the log-probs the generator sampled with), pi the policy being trained, A the advantage,
sg a stop-gradient; all per token:
- aipo (the default): -sg(min(pi/mu, rho)) A log pi (aipo.py); aipo-clamp: -clamp(pi/mu, max=rho) A;
- reinforce: -A log pi, no correction (reinforce.py); icepop: -sg(pi/mu) A log pi where low <= pi/mu <= high,
  0 outside; cispo: -sg(clip(pi/mu, 1 - eps_low, 1 + eps_high)) A log pi;
- ppo: PPO's clipped surrogate of pi/mu, optionally dual-clipped (ppo.py); tis: the surrogate of pi/pi_prox times
  sg(min(pi_prox/mu, C)); decoupled-ppo: the surrogate of pi/pi_prox times sg(pi_prox/mu), masked above a cap;
- gspo: the clipped surrogate of each sequence's geometric-mean ratio, in GSPO-token form (gspo.py).

pi_prox, the proximal policy, is the policy at the start of the optimizer step (`LossInputs.proximal_logprobs`; the
current log-probs held constant when None). The trainer takes exactly one optimizer step per rollout batch, so
pi_prox is the current policy and pi/pi_prox = 1: tis reduces to a truncated importance weight, the same gradient
as aipo with rho = the tis clip, and decoupled-ppo to a masked behavior weight, the same gradient as icepop with
bounds [0, cap].

Every entry turns one micro-batch's log-probs into an aggregated loss and its statistics: per-token boolean
indicators of what it did to each valid token (clip_high, clip_low, dual_clip, tis_clip, masked), which the
trainer reports as the fractions `<name>_fraction` of the valid tokens of the batch. A new loss is a function
`(LossInputs, AlgorithmConfig) -> (loss, indicators)` in a file of its own plus one line in `LOSSES`; --loss offers
it at once. For example:

    # my_loss.py
    def my_loss(x: LossInputs, config: AlgorithmConfig):
        ratio = torch.exp(x.logprobs.detach() - x.behavior_logprobs)
        per_token = -ratio.clamp(max=config.rho) * x.advantages[:, None] * x.logprobs
        return aggregate(per_token, x.loss_mask, **x.aggregation), {"clip_high": ratio > config.rho}

    # here
    "my-loss": Loss(my_loss),
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from megatron_rl.algorithms.aggregation import AGGREGATIONS, aggregate
from megatron_rl.algorithms.aipo import aipo_clamp_loss, aipo_loss
from megatron_rl.algorithms.gspo import gspo_loss
from megatron_rl.algorithms.kl import KL_ESTIMATORS
from megatron_rl.algorithms.ppo import decoupled_ppo_loss, ppo_clip_loss, tis_loss
from megatron_rl.algorithms.reinforce import cispo_loss, icepop_loss, reinforce_loss

DUAL_CLIP_LOSSES = ("decoupled-ppo", "ppo", "tis")  # the PPO surrogates of pi/mu or pi/pi_prox


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    loss: str = "aipo"
    rho: float = 4.0  # AIPO's one-sided clip
    clip_eps: float = 0.2  # PPO, tis, decoupled-ppo; gspo's sequence-ratio clip
    clip_eps_high: float | None = None  # None: clip_eps
    dual_clip_c: float | None = None  # None: no dual clip
    tis_clip: float = 2.0
    is_mask_low: float = 0.5  # icepop
    is_mask_high: float = 5.0
    cispo_eps_low: float | None = None  # None: no lower clip
    cispo_eps_high: float = 3.0
    behav_imp_weight_cap: float | None = None  # decoupled-ppo; None: no masking
    aggregation: str = "token-mean"
    kl_coef: float = 0.0  # weight of the KL to the reference policy (0: no reference)
    kl_estimator: str = "k3"  # --kl-loss-type
    kl_in_reward: bool = False  # True: the KL was subtracted from the rewards; the loss only reports it
    entropy_coef: float = 0.0
    temperature: float = 1.0

    def __post_init__(self):
        for flag, value, registry in (("--loss", self.loss, LOSSES), ("--loss-aggregation", self.aggregation,
                                                                        AGGREGATIONS)):
            if value not in registry:
                raise ValueError(f"{flag} {value!r} is unknown; choose one of {sorted(registry)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"--kl-loss-type {self.kl_estimator!r} is unknown; choose one of {list(KL_ESTIMATORS)}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if self.temperature <= 0:
            raise ValueError(f"--rollout-temperature must be > 0 for training, got {self.temperature}")
        self._check_loss_parameters()

    def _check_loss_parameters(self):
        """Each loss parameter in its range, named by its flag; the optional ones only with a loss that uses them."""
        problems = [
            (self.rho > 0 and math.isfinite(self.rho), f"--aipo-rho must be a positive finite number, got {self.rho}"),
            (0 < self.clip_eps < 1, f"--ppo-clip-eps must be in (0, 1), got {self.clip_eps}"),
            (self.clip_eps_high is None or self.clip_eps_high > 0,
             f"--ppo-clip-eps-high must be > 0, got {self.clip_eps_high}"),
            (self.dual_clip_c is None or self.dual_clip_c > 1,
             f"--ppo-dual-clip-c must be > 1 (it bounds the loss of a negative-advantage token at C |A|, above "
             f"the clip range), got {self.dual_clip_c}"),
            (self.dual_clip_c is None or self.loss in DUAL_CLIP_LOSSES,
             f"--ppo-dual-clip-c applies to --loss {', '.join(DUAL_CLIP_LOSSES)}, not {self.loss}"),
            (self.tis_clip > 0, f"--tis-clip must be > 0, got {self.tis_clip}"),
            (0 <= self.is_mask_low < 1 < self.is_mask_high,
             f"--is-mask-low and --is-mask-high must satisfy 0 <= --is-mask-low < 1 < --is-mask-high, got "
             f"{self.is_mask_low} and {self.is_mask_high}"),
            (self.cispo_eps_low is None or 0 <= self.cispo_eps_low <= 1,
             f"--cispo-eps-low must be in [0, 1], got {self.cispo_eps_low}"),
            (self.cispo_eps_high > 0, f"--cispo-eps-high must be > 0, got {self.cispo_eps_high}"),
            (self.behav_imp_weight_cap is None or self.behav_imp_weight_cap > 1,
             f"--behav-imp-weight-cap must be > 1, got {self.behav_imp_weight_cap}"),
            (self.behav_imp_weight_cap is None or self.loss == "decoupled-ppo",
             f"--behav-imp-weight-cap applies to --loss decoupled-ppo, not {self.loss}"),
        ]
        for ok, message in problems:
            if not ok:
                raise ValueError(message)


@dataclasses.dataclass
class LossInputs:
    """One micro-batch, [B, T] per token: `logprobs` carries the gradient; `aggregation` holds the keyword
    arguments of `aggregate` (mode, global normalizer, constant) that make micro-batch losses add up exactly;
    `proximal_logprobs`: the policy at the start of the optimizer step (None: `logprobs` held constant)."""

    logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor  # [B]
    loss_mask: torch.Tensor
    aggregation: dict
    proximal_logprobs: torch.Tensor | None = None


Indicators = dict[str, torch.Tensor]  # name -> [B, T] bool, True where the loss clipped / masked a valid token


@dataclasses.dataclass(frozen=True)
class Loss:
    compute: Callable[[LossInputs, AlgorithmConfig], tuple[torch.Tensor, Indicators]]
    policy_gradient: bool = True  # False: not an RL loss (the supervised warm-up), not offered by --loss


def _tensors(x: LossInputs) -> tuple[torch.Tensor, ...]:
    return x.logprobs, x.behavior_logprobs, x.advantages, x.loss_mask


def _aipo(x: LossInputs, c: AlgorithmConfig):
    return aipo_loss(*_tensors(x), rho=c.rho, **x.aggregation)


def _aipo_clamp(x: LossInputs, c: AlgorithmConfig):
    return aipo_clamp_loss(*_tensors(x), rho=c.rho, **x.aggregation)


def _reinforce(x: LossInputs, c: AlgorithmConfig):
    return reinforce_loss(*_tensors(x), **x.aggregation)


def _ppo(x: LossInputs, c: AlgorithmConfig):
    return ppo_clip_loss(*_tensors(x), c.clip_eps, c.clip_eps_high, c.dual_clip_c, **x.aggregation)


def _tis(x: LossInputs, c: AlgorithmConfig):
    return tis_loss(*_tensors(x), x.proximal_logprobs, c.tis_clip, c.clip_eps, c.clip_eps_high, c.dual_clip_c,
                    **x.aggregation)


def _icepop(x: LossInputs, c: AlgorithmConfig):
    return icepop_loss(*_tensors(x), c.is_mask_low, c.is_mask_high, **x.aggregation)


def _gspo(x: LossInputs, c: AlgorithmConfig):
    return gspo_loss(*_tensors(x), c.clip_eps, c.clip_eps_high, **x.aggregation)


def _cispo(x: LossInputs, c: AlgorithmConfig):
    return cispo_loss(*_tensors(x), c.cispo_eps_low, c.cispo_eps_high, **x.aggregation)


def _decoupled_ppo(x: LossInputs, c: AlgorithmConfig):
    return decoupled_ppo_loss(*_tensors(x), x.proximal_logprobs, c.behav_imp_weight_cap, c.clip_eps,
                              c.clip_eps_high, c.dual_clip_c, **x.aggregation)


def _sft(x: LossInputs, c: AlgorithmConfig):
    """Negative log-likelihood of the masked tokens (the supervised warm-up)."""
    return aggregate(-x.logprobs, x.loss_mask, **x.aggregation), {}


LOSSES: dict[str, Loss] = {
    "aipo": Loss(_aipo),
    "aipo-clamp": Loss(_aipo_clamp),
    "reinforce": Loss(_reinforce),
    "ppo": Loss(_ppo),
    "tis": Loss(_tis),
    "icepop": Loss(_icepop),
    "gspo": Loss(_gspo),
    "cispo": Loss(_cispo),
    "decoupled-ppo": Loss(_decoupled_ppo),
    "sft": Loss(_sft, policy_gradient=False),
}

POLICY_LOSSES = sorted(name for name, loss in LOSSES.items() if loss.policy_gradient)
