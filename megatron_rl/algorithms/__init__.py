"""Pure-torch RL algorithms: the policy losses (AIPO, REINFORCE, PPO with dual clip, TIS, IcePop, GSPO, CISPO,
decoupled PPO), KL terms, advantages, V-trace, gates, diagnostics, and the registries of losses, advantage
estimators and aggregations."""

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, group_baseline, grpo, rloo
from megatron_rl.algorithms.aggregation import AGGREGATIONS, aggregate
from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.algorithms.diagnostics import lag_histogram, lag_summary, offpolicy_diagnostics
from megatron_rl.algorithms.gates import GateResult, failure_gate, group_filter, token_ratio_mask, version_gate
from megatron_rl.algorithms.kl import KL_ESTIMATORS, kl_penalty, kl_reward_penalty
from megatron_rl.algorithms.losses import LOSSES, Hyperparameter, Loss, LossInputs, policy_losses
from megatron_rl.algorithms.losses.aipo import aipo_clamp_loss, aipo_loss
from megatron_rl.algorithms.losses.gspo import gspo_loss
from megatron_rl.algorithms.losses.ppo import decoupled_ppo_loss, ppo_clip_loss, tis_loss
from megatron_rl.algorithms.losses.reinforce import cispo_loss, icepop_loss, reinforce_loss
from megatron_rl.algorithms.vtrace import vtrace

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "KL_ESTIMATORS", "AlgorithmConfig", "GateResult", "Hyperparameter",
    "LOSSES", "Loss", "LossInputs", "aggregate", "aipo_clamp_loss", "aipo_loss", "cispo_loss", "compute_advantages",
    "decoupled_ppo_loss", "failure_gate", "group_baseline", "group_filter", "grpo", "gspo_loss", "icepop_loss",
    "kl_penalty", "kl_reward_penalty", "lag_histogram", "lag_summary", "offpolicy_diagnostics", "policy_losses",
    "ppo_clip_loss", "reinforce_loss", "rloo", "tis_loss", "token_ratio_mask", "version_gate", "vtrace",
]
