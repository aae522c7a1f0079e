"""The supervised warm-up's loss: the negative log-likelihood of the masked tokens (not an RL loss)."""

from __future__ import annotations

from megatron_rl.algorithms.aggregation import aggregate
from megatron_rl.algorithms.losses.base import Loss, LossInputs


def _sft(x: LossInputs, params):
    return aggregate(-x.logprobs, x.loss_mask, **x.aggregation), {}


SFT = Loss(_sft, policy_gradient=False)
