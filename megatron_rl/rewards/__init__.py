"""Rewards: sympy-based math equivalence in crash- and hang-proof worker processes, rule terms, and the
registry behind --reward-fn."""

from megatron_rl.rewards.math import MathScorer, extract_answer, verdict
from megatron_rl.rewards.registry import REWARD_FUNCTIONS, build_reward_fn
from megatron_rl.rewards.result import INFRASTRUCTURE_FAILURES, STATUSES, RewardResult
from megatron_rl.rewards.rules import combine, format_reward

__all__ = [
    "INFRASTRUCTURE_FAILURES", "MathScorer", "REWARD_FUNCTIONS", "RewardResult", "STATUSES", "build_reward_fn",
    "combine", "extract_answer", "format_reward", "verdict",
]
