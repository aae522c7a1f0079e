"""Rollout engines: the built-in LocalEngine (CPU default) behind the same protocol as the SGLang adapter."""

from megatron_rl.rollout.local.engine import LocalEngine
from megatron_rl.rollout.types import LOGPROB_CONVENTION, RolloutOutput, SamplingParams

__all__ = ["LOGPROB_CONVENTION", "LocalEngine", "RolloutOutput", "SamplingParams"]
