"""A user's reward function, given by --custom-rm-path `path/to/file.py:function` or `package.module:function`.

The function takes one `RewardSample` and returns a float, a dict with "reward" (its other keys are kept in
`RewardResult.extras`), or a `RewardResult`. It runs in the same isolated worker processes as the math scorer,
with the same time limit per sample and the same statuses: past the limit "timeout", an exception or a crashed
worker "scorer-failure" with the error, a return value of another type (or a reward that is not a finite
number) "scorer-failure" naming it. The parent loads the function once at setup, so that a missing file or
function stops the run before any work, naming --custom-rm-path; each worker loads it again by path or module
name (spawned processes share no imports).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers

from megatron_rl.rewards.types import STATUSES, RewardResult, RewardSample
from megatron_rl.rewards.workers import PooledReward, TimeLimitExceeded, time_limit
from megatron_rl.runtime import plugins

FLAG = "--custom-rm-path"


def as_result(value, spec: str) -> RewardResult:
    """What the function returned, as a RewardResult; a scorer-failure that names what is wrong with it."""
    def failure(problem: str) -> RewardResult:
        return RewardResult(0.0, "scorer-failure", None, f"reward function {spec}: {problem}")

    if isinstance(value, RewardResult):
        if value.status not in STATUSES:
            return failure(f"returned status {value.status!r}, not one of {list(STATUSES)}")
        reward, extras = value.reward, value.extras
    elif isinstance(value, dict):
        if "reward" not in value:
            return failure(f"returned a dict without 'reward' (keys {sorted(map(str, value))})")
        reward, extras = value["reward"], {k: v for k, v in value.items() if k != "reward"}
    else:
        reward, extras = value, {}
    if not isinstance(reward, numbers.Real):
        return failure(f"returned {type(reward).__name__}: expected a float, a dict with 'reward', or a RewardResult")
    if not math.isfinite(reward):
        return failure(f"returned the reward {reward}")
    try:
        json.dumps(extras)  # extras travel to the logs and checkpoints
    except (TypeError, ValueError) as e:
        return failure(f"returned extras that are not JSON ({e})")
    if isinstance(value, RewardResult):
        return dataclasses.replace(value, reward=float(reward))
    return RewardResult(float(reward), "scored", None, "", extras)


def score(spec: str, sample: RewardSample, timeout_s: int) -> RewardResult:
    """One sample's reward (runs inside a worker process)."""
    fn = plugins.load(spec, FLAG)
    try:
        with time_limit(timeout_s):
            value = fn(sample)
    except TimeLimitExceeded:
        return RewardResult(0.0, "timeout", None, f"no reward within {timeout_s} s")
    return as_result(value, spec)


class CustomReward(PooledReward):
    def __init__(self, spec: str, num_workers: int = 2, timeout_s: int = 5):
        self.spec = plugins.resolve(spec, FLAG)
        plugins.load(self.spec, FLAG)  # fails here, in the parent, before any worker starts
        super().__init__(num_workers, timeout_s, warmup=functools.partial(plugins.load, self.spec, FLAG))

    def __call__(self, samples: list[RewardSample], timeout_s: int | None = None) -> list[RewardResult]:
        timeout = self._timeout(timeout_s)
        return self._score(score, [(self.spec, s, timeout) for s in samples], timeout)
