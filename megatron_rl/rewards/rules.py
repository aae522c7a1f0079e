"""Rule-based reward terms and their composition with a base reward function.

A reward function takes a list of `RewardSample`s and returns one `RewardResult` per sample. Rule terms are
plain functions of one response text; `combine` adds weighted terms to a base reward function.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from megatron_rl.rewards.types import RewardResult, RewardSample

RewardFn = Callable[[list[RewardSample]], list[RewardResult]]


def format_reward(response: str, pattern: str = r"\\boxed\{.+\}", reward: float = 0.1) -> float:
    """`reward` if the response matches the regular expression `pattern`, else 0."""
    return reward if re.search(pattern, response or "", flags=re.DOTALL) else 0.0


class combine:
    """`base` plus weighted rule terms. Terms are added only to scored or wrong-format results: an
    infrastructure failure stays a failure (excluded), it does not become a small reward."""

    def __init__(self, base: RewardFn, terms: Sequence[tuple[Callable[[str], float], float]]):
        self.base, self.terms = base, list(terms)

    def __call__(self, samples: list[RewardSample]) -> list[RewardResult]:
        out = []
        for result, sample in zip(self.base(samples), samples):
            if result.is_failure:
                out.append(result)
                continue
            extra = sum(weight * term(sample.response) for term, weight in self.terms)
            out.append(dataclasses.replace(result, reward=result.reward + extra))
        return out

    def close(self) -> None:
        close = getattr(self.base, "close", None)
        if close is not None:
            close()
