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
import importlib
import importlib.util
import json
import math
import numbers
import os
import re
import sys
from collections.abc import Callable

from megatron_rl.rewards.types import STATUSES, RewardResult, RewardSample
from megatron_rl.rewards.workers import PooledReward, TimeLimitExceeded, time_limit


def resolve(spec: str) -> str:
    """`spec` with a file path made absolute (workers resolve it alike wherever they run); checks its form."""
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise ValueError(f"--custom-rm-path {spec!r}: expected path/to/file.py:function or package.module:function")
    return f"{os.path.abspath(location)}:{name}" if _is_file(location) else spec


def _is_file(location: str) -> bool:
    return location.endswith(".py") or os.sep in location


@functools.cache
def load(spec: str) -> Callable[[RewardSample], object]:
    """The function `spec` names (loaded once per process). Errors name --custom-rm-path."""
    location, _, name = spec.rpartition(":")
    where = f"--custom-rm-path {spec!r}"
    if _is_file(location):
        if not os.path.isfile(location):
            raise ValueError(f"{where}: no such file {location!r}")
        module_name = "custom_reward_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(location))[0])
        module_spec = importlib.util.spec_from_file_location(module_name, location)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{where}: {location!r} cannot be loaded as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look a module up by its name
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ValueError(f"{where}: loading {location!r} failed ({type(e).__name__}: {e})") from e
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as e:
            raise ValueError(f"{where}: cannot import module {location!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where}: {location!r} has no function {name!r}")
    return fn


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
    fn = load(spec)
    try:
        with time_limit(timeout_s):
            value = fn(sample)
    except TimeLimitExceeded:
        return RewardResult(0.0, "timeout", None, f"no reward within {timeout_s} s")
    return as_result(value, spec)


class CustomReward(PooledReward):
    def __init__(self, spec: str, num_workers: int = 2, timeout_s: int = 5):
        self.spec = resolve(spec)
        load(self.spec)  # fails here, in the parent, before any worker starts
        super().__init__(num_workers, timeout_s, warmup=functools.partial(load, self.spec))

    def __call__(self, samples: list[RewardSample], timeout_s: int | None = None) -> list[RewardResult]:
        timeout = self._timeout(timeout_s)
        return self._score(score, [(self.spec, s, timeout) for s in samples], timeout)
