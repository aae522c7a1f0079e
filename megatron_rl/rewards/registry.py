"""The reward functions by name: the registry behind --reward-fn, and --custom-rm-path or --rm-url, which
replace it.

An entry builds a reward function from the run's reward options (worker processes, timeout); a reward function
maps a list of `RewardSample`s to one `RewardResult` per sample, and may have a `close()` that the run calls at
the end. Users plug in their own per-sample function with --custom-rm-path (`rewards.custom`), a reward server
with --rm-url (`rewards.remote`), or add an entry here.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_rl.rewards.custom import FLAG, CustomReward
from megatron_rl.rewards.math import MathScorer
from megatron_rl.rewards.rules import combine, format_reward
from megatron_rl.rewards.types import RewardResult, RewardSample
from megatron_rl.runtime import plugins

RewardFn = Callable[[list[RewardSample]], list[RewardResult]]

REWARD_FUNCTIONS: dict[str, Callable[[int, int], RewardFn]] = {  # (num_workers, timeout_s) -> reward function
    "math": lambda workers, timeout: MathScorer(workers, timeout),
    "math+format": lambda workers, timeout: combine(MathScorer(workers, timeout), [(format_reward, 1.0)]),
}


def build_reward_fn(name: str = "math", num_workers: int = 2, timeout_s: int = 5,
                    custom_rm_path: str | None = None, rm_url: str | None = None, rm_retries: int = 2,
                    rm_max_concurrency: int = 32) -> RewardFn:
    """--custom-rm-path's function or --rm-url's server when given, else the registered --reward-fn `name`
    (math, math+format)."""
    if rm_url is not None:
        from megatron_rl.rewards.remote import RemoteReward

        return RemoteReward(rm_url, timeout_s, rm_retries, rm_max_concurrency)
    return reward_factory(name, custom_rm_path)(num_workers, timeout_s)


def reward_factory(name: str, custom_rm_path: str | None = None) -> Callable[[int, int], RewardFn]:
    """What builds the run's reward function. Nothing is started, but a custom function is loaded: the run setup
    checks the flags with this, so that a missing file or function fails before any work."""
    if custom_rm_path is not None:
        spec = plugins.resolve(custom_rm_path, FLAG)
        plugins.load(spec, FLAG)
        return lambda workers, timeout: CustomReward(spec, workers, timeout)
    if name not in REWARD_FUNCTIONS:
        raise ValueError(f"--reward-fn {name!r}: not a registered name {sorted(REWARD_FUNCTIONS)} (a function of "
                         "your own goes to --custom-rm-path path/to/file.py:function or package.module:function)")
    return REWARD_FUNCTIONS[name]
