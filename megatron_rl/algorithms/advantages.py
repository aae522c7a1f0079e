"""Advantage estimators over groups of responses to the same prompt (critic-free).

The registry `ADVANTAGE_ESTIMATORS` is behind --advantage-estimator. `rewards` [N] and `group_ids` [N] (any
integer labels; members of a group need not be adjacent).
- group baseline (AIPO paper): A = r - mean(group rewards);
- GRPO: (r - mean) / (std + eps), std the unbiased sample std of the group (as in GRPO implementations);
- RLOO: A = r - mean of the OTHER members = n / (n - 1) * (r - mean); 0 for a group of one.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms import checks


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    checks.float_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor of shape {tuple(rewards.shape)}, "
                         f"got {group_ids.dtype} {tuple(group_ids.shape)}")
    checks.finite_where("rewards", rewards)
    _, index = torch.unique(group_ids, return_inverse=True)
    groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, index, rewards) / count
    return index, count, mean


def group_baseline(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    index, _, mean = _group_stats(rewards, group_ids)
    return rewards - mean[index]


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    index, count, mean = _group_stats(rewards, group_ids)
    centered = rewards - mean[index]
    sq = torch.zeros_like(mean).index_add_(0, index, centered ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return centered / (std[index] + eps)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    index, count, mean = _group_stats(rewards, group_ids)
    n = count[index]
    scale = torch.where(n > 1, n / (n - 1).clamp(min=1), torch.zeros_like(n))
    return scale * (rewards - mean[index])


ADVANTAGE_ESTIMATORS = {"group-baseline": group_baseline, "grpo": grpo, "rloo": rloo}  # --advantage-estimator


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "group-baseline"):
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage-estimator {estimator!r} is unknown; choose one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[estimator](rewards, group_ids)
