"""Rewards: sympy-based math equivalence in crash- and hang-proof worker processes, user reward functions
(--custom-rm-path) in the same workers, rule terms, overlong shaping, and the registry behind --reward-fn."""

from megatron_rl.rewards.custom import CustomReward
from megatron_rl.rewards.math import MathScorer, marked_answer, verdict
from megatron_rl.rewards.registry import REWARD_FUNCTIONS, build_reward_fn
from megatron_rl.rewards.rules import combine, format_reward
from megatron_rl.rewards.types import EXCLUDED_STATUSES, INFRASTRUCTURE_FAILURES, STATUSES, RewardResult, RewardSample

__all__ = [
    "CustomReward", "EXCLUDED_STATUSES", "INFRASTRUCTURE_FAILURES", "MathScorer", "REWARD_FUNCTIONS",
    "RewardResult", "RewardSample", "STATUSES", "build_reward_fn", "combine", "marked_answer", "format_reward",
    "verdict",
]
