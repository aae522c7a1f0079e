"""The policy losses by name: the registry behind --loss.

Every entry turns one micro-batch's log-probs into an aggregated loss and says which ratio bounds its statistics
report (the fraction of tokens clipped above / below). A new loss is a function `(LossInputs, AlgorithmConfig)
-> loss` in a file of its own plus one line in `LOSSES`; --loss offers it at once. For example:

    # my_loss.py
    def my_loss(x: LossInputs, config: AlgorithmConfig) -> torch.Tensor:
        ratio = torch.exp(x.logprobs.detach() - x.behavior_logprobs).clamp(max=config.rho)
        return aggregate(-ratio * x.advantages[:, None] * x.logprobs, x.loss_mask, **x.aggregation)

    # here
    "my-loss": Loss(my_loss, clip_bounds=lambda c: (None, c.rho)),
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron_rl.algorithms.aggregation import AGGREGATIONS, aggregate
from megatron_rl.algorithms.aipo import aipo_clamp_loss, aipo_loss
from megatron_rl.algorithms.kl import KL_ESTIMATORS
from megatron_rl.algorithms.ppo import ppo_clip_loss


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    loss: str = "aipo"
    rho: float = 4.0  # AIPO's one-sided clip
    clip_eps: float = 0.2  # PPO
    clip_eps_high: float | None = None
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


@dataclasses.dataclass
class LossInputs:
    """One micro-batch, [B, T] per token: `logprobs` carries the gradient; `aggregation` holds the keyword
    arguments of `aggregate` (mode, global normalizer, constant) that make micro-batch losses add up exactly."""

    logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor  # [B]
    loss_mask: torch.Tensor
    aggregation: dict


@dataclasses.dataclass(frozen=True)
class Loss:
    compute: Callable[[LossInputs, AlgorithmConfig], torch.Tensor]
    clip_bounds: Callable[[AlgorithmConfig], tuple[float | None, float | None]] = lambda c: (None, None)
    policy_gradient: bool = True  # False: not an RL loss (the supervised warm-up), not offered by --loss


def _aipo(x: LossInputs, c: AlgorithmConfig) -> torch.Tensor:
    return aipo_loss(x.logprobs, x.behavior_logprobs, x.advantages, x.loss_mask, rho=c.rho, **x.aggregation)[0]


def _aipo_clamp(x: LossInputs, c: AlgorithmConfig) -> torch.Tensor:
    return aipo_clamp_loss(x.logprobs, x.behavior_logprobs, x.advantages, x.loss_mask, rho=c.rho,
                           **x.aggregation)[0]


def _ppo(x: LossInputs, c: AlgorithmConfig) -> torch.Tensor:
    return ppo_clip_loss(x.logprobs, x.behavior_logprobs, x.advantages, x.loss_mask, c.clip_eps, c.clip_eps_high,
                         **x.aggregation)[0]


def _sft(x: LossInputs, c: AlgorithmConfig) -> torch.Tensor:
    """Negative log-likelihood of the masked tokens (the supervised warm-up)."""
    return aggregate(-x.logprobs, x.loss_mask, **x.aggregation)


LOSSES: dict[str, Loss] = {
    "aipo": Loss(_aipo, clip_bounds=lambda c: (None, c.rho)),
    "aipo-clamp": Loss(_aipo_clamp, clip_bounds=lambda c: (None, c.rho)),
    "ppo": Loss(_ppo, clip_bounds=lambda c: (1 - c.clip_eps, 1 + (c.clip_eps_high or c.clip_eps))),
    "sft": Loss(_sft, policy_gradient=False),
}

POLICY_LOSSES = sorted(name for name, loss in LOSSES.items() if loss.policy_gradient)
