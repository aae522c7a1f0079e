"""GSPO: Group Sequence Policy Optimization (Qwen, arXiv:2507.18071), in its GSPO-token form.

GSPO clips one ratio per sequence, the geometric mean of its token ratios to the behavior policy mu,

    s_i = exp(mean over the valid tokens t of sequence i of log(pi_t / mu_t)),

and its loss per sequence is -min(s_i A_i, clip(s_i, 1 - eps, 1 + eps_high) A_i) (the paper clips at 3e-4 / 4e-4).
To fit the per-token losses and aggregations, each token carries

    s_{i,t} = sg(s_i) * exp(log pi_t - sg(log pi_t)),

whose value is s_i and whose gradient is s_i * grad log pi_t, in PPO's clipped surrogate (`ppo.clipped_surrogate`).
Under --loss-aggregation seq-mean-token-mean the gradient is exactly GSPO's: the sequence mean of
s_i * grad log pi_t is s_i * grad log s_i. Token-level advantages A_{i,t} are allowed (GSPO-token); with one
advantage per sequence every token of a sequence is clipped or not together.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms import checks, ratios
from megatron_rl.algorithms.aggregation import aggregate
from megatron_rl.algorithms.losses.base import Loss, LossInputs
from megatron_rl.algorithms.losses.ppo import CLIP_EPS, CLIP_EPS_HIGH, check_clip, clipped_surrogate


def sequence_ratio(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i [B], held constant: the geometric mean of pi/mu over each sequence's valid tokens (1 for none)."""
    log_ratio = ratios.valid(logprobs.detach(), mask) - ratios.valid(behavior_logprobs, mask)
    mean = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
    return torch.exp(mean.clamp(-ratios.LOG_RATIO_LIMIT, ratios.LOG_RATIO_LIMIT))


def gspo_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    aggregation: str = "seq-mean-token-mean",
    normalizer: float | None = None,
    constant: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token loss and its statistics: clip_high / clip_low, each sequence's clipping on its valid tokens."""
    advantages = checks.loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask)
    high = check_clip(clip_eps, clip_eps_high, None)
    lp = ratios.valid(logprobs, loss_mask)
    token_ratio = sequence_ratio(logprobs, behavior_logprobs, loss_mask)[:, None] * torch.exp(lp - lp.detach())
    per_token, indicators = clipped_surrogate(token_ratio, advantages, 1 - clip_eps, 1 + high)
    return aggregate(per_token, loss_mask, aggregation, normalizer, constant), ratios.on_valid(indicators, loss_mask)


# ---- registry entry ----------------------------------------------------------------------------------------------

def _gspo(x: LossInputs, p):
    return gspo_loss(*x.tensors, p.clip_eps, p.clip_eps_high, **x.aggregation)


GSPO = Loss(_gspo, (CLIP_EPS, CLIP_EPS_HIGH), "sequence-level geometric-mean ratio, clipped")
