"""Pure-torch RL algorithms: AIPO, PPO clipping, KL terms, advantages, V-trace, gates, diagnostics, and the
registries of losses, advantage estimators and aggregations."""

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, group_baseline, grpo, rloo
from megatron_rl.algorithms.aggregation import AGGREGATIONS, aggregate
from megatron_rl.algorithms.aipo import aipo_clamp_loss, aipo_loss
from megatron_rl.algorithms.diagnostics import lag_histogram, lag_summary, offpolicy_diagnostics
from megatron_rl.algorithms.gates import GateResult, failure_gate, group_filter, token_ratio_mask, version_gate
from megatron_rl.algorithms.kl import KL_ESTIMATORS, kl_penalty, kl_reward_penalty
from megatron_rl.algorithms.losses import LOSSES, POLICY_LOSSES, AlgorithmConfig, Loss, LossInputs
from megatron_rl.algorithms.ppo import ppo_clip_loss
from megatron_rl.algorithms.vtrace import vtrace

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "KL_ESTIMATORS", "AlgorithmConfig", "GateResult", "LOSSES", "Loss",
    "LossInputs", "POLICY_LOSSES", "aggregate", "aipo_clamp_loss", "aipo_loss", "compute_advantages", "failure_gate",
    "group_baseline", "group_filter", "grpo", "kl_penalty", "kl_reward_penalty", "lag_histogram", "lag_summary",
    "offpolicy_diagnostics", "ppo_clip_loss", "rloo", "token_ratio_mask", "version_gate", "vtrace",
]
