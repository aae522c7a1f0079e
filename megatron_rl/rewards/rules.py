"""Rule-based reward terms, composition, and the registry behind `--reward-fn`.

A reward function takes (responses, references) and returns one `RewardResult` per pair. Rule terms are
plain functions of one response; `combine` adds weighted terms to a base reward function. Users plug in
their own with `--reward-fn package.module:function` (same signature).
"""

from __future__ import annotations

import importlib
import re
from typing import Callable, Sequence

from megatron_rl.rewards.math import RewardResult, score_math

RewardFn = Callable[[list[str], list[str]], list[RewardResult]]


def format_reward(response: str, pattern: str = r"\\boxed\{.+\}", reward: float = 0.1) -> float:
    """`reward` if the response matches the regular expression `pattern`, else 0."""
    return reward if re.search(pattern, response or "", flags=re.DOTALL) else 0.0


def length_penalty(response: str, max_chars: int = 2048, penalty: float = 0.5) -> float:
    """A penalty growing linearly from 0 at max_chars / 2 to -penalty at max_chars and beyond."""
    n, half = len(response or ""), max_chars / 2
    if n <= half:
        return 0.0
    return -penalty * min(1.0, (n - half) / half)


def combine(base: RewardFn, terms: Sequence[tuple[Callable[[str], float], float]]) -> RewardFn:
    """`base` plus weighted rule terms. Terms are added only to scored or wrong-format results: an
    infrastructure failure stays a failure (excluded), it does not become a small reward."""

    def fn(responses: list[str], references: list[str]) -> list[RewardResult]:
        out = []
        for result, response in zip(base(responses, references), responses):
            if result.is_failure:
                out.append(result)
                continue
            extra = sum(weight * term(response) for term, weight in terms)
            out.append(RewardResult(result.reward + extra, result.status, result.extracted, result.detail))
        return out

    return fn


REGISTRY: dict[str, RewardFn] = {
    "math": score_math,
    "math+format": combine(score_math, [(format_reward, 1.0)]),
}


def load_reward_fn(name: str) -> RewardFn:
    """A registered name (`math`, `math+format`) or `package.module:function`."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name:
        raise ValueError(f"--reward-fn {name!r}: not a registered name {sorted(REGISTRY)} nor 'module:function'")
    module_name, attr = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--reward-fn {name!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {name!r}: module {module_name!r} has no callable {attr!r}")
    return fn
