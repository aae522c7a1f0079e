"""The reward functions by name: the registry behind --reward-fn.

An entry builds a reward function from the run's reward options (worker processes, timeout); a reward function
maps (responses, references) to one `RewardResult` per pair, and may have a `close()` that the run calls at the
end. Users plug in their own with `--reward-fn package.module:function` (a plain function of that signature), or
add an entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from megatron_rl.rewards.math import MathScorer
from megatron_rl.rewards.result import RewardResult
from megatron_rl.rewards.rules import combine, format_reward

RewardFn = Callable[[list[str], list[str]], list[RewardResult]]

REWARD_FUNCTIONS: dict[str, Callable[[int, int], RewardFn]] = {  # (num_workers, timeout_s) -> reward function
    "math": lambda workers, timeout: MathScorer(workers, timeout),
    "math+format": lambda workers, timeout: combine(MathScorer(workers, timeout), [(format_reward, 1.0)]),
}


def build_reward_fn(name: str, num_workers: int = 2, timeout_s: int = 5) -> RewardFn:
    """A registered name (`math`, `math+format`) or `package.module:function`."""
    return reward_factory(name)(num_workers, timeout_s)


def reward_factory(name: str) -> Callable[[int, int], RewardFn]:
    """What builds --reward-fn `name` (nothing is started: the run setup checks the flag with it)."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if ":" not in name:
        raise ValueError(f"--reward-fn {name!r}: not a registered name {sorted(REWARD_FUNCTIONS)} nor "
                         "'module:function'")
    module_name, attr = name.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--reward-fn {name!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {name!r}: module {module_name!r} has no callable {attr!r}")
    return lambda workers, timeout: fn
