"""Rewards: sympy-based math equivalence in crash- and hang-proof worker processes, and rule terms."""

from megatron_rl.rewards.math import (
    INFRASTRUCTURE_FAILURES, STATUSES, MathScorer, RewardResult, extract_answer, score_math, verdict,
)
from megatron_rl.rewards.rules import REGISTRY, combine, format_reward, length_penalty, load_reward_fn

__all__ = [
    "INFRASTRUCTURE_FAILURES", "MathScorer", "REGISTRY", "RewardResult", "STATUSES", "combine", "extract_answer",
    "format_reward", "length_penalty", "load_reward_fn", "score_math", "verdict",
]
