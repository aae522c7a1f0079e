"""What a policy loss is to the registry: its inputs, its hyperparameters and the entry that names them.

A loss is a function `(LossInputs, params) -> (loss, indicators)`: `params` holds its hyperparameters by name
(`params.rho`), each declared with its flag beside the loss (`Hyperparameter`), so that adding a loss is one file
and one line in the registry: --loss offers it, its flags reach the parser, their ranges are checked at start.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import torch

Indicators = dict[str, torch.Tensor]  # name -> [B, T] bool, True where the loss clipped / masked a valid token


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

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(logprobs, behavior_logprobs, advantages, loss_mask): the leading arguments of every loss function."""
        return self.logprobs, self.behavior_logprobs, self.advantages, self.loss_mask


@dataclasses.dataclass(frozen=True)
class Hyperparameter:
    """One hyperparameter of a loss: read as `params.<name>`, set by `flag` (a float; `default` None: off unless
    given, and then only with a loss that declares it), valid where `valid(value)` holds; the error says the
    flag `requirement`. The same object may serve several losses (PPO's clip range)."""

    name: str
    flag: str
    default: float | None
    help: str
    valid: Callable[[float], bool] = lambda value: True
    requirement: str = ""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def problem(self, value) -> str | None:
        if value is None and self.default is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not self.valid(value):
            return f"{self.flag} {self.requirement}, got {value}"
        return None


@dataclasses.dataclass(frozen=True)
class Loss:
    """A registry entry: `compute(inputs, params)`; its hyperparameters; `check(params)`, a constraint between
    them (returns the error, or None); `summary`, its line in --loss's help. `policy_gradient=False`: not an RL loss
    (the supervised warm-up), not offered by --loss."""

    compute: Callable[[LossInputs, types.SimpleNamespace], tuple[torch.Tensor, Indicators]]
    hyperparameters: tuple[Hyperparameter, ...] = ()
    summary: str = ""
    check: Callable[[types.SimpleNamespace], str | None] | None = None
    policy_gradient: bool = True
