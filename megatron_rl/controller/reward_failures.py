"""Counting the failures that exclude samples (a reward that could not be computed, an environment that failed)
and stopping on a broken scorer or environment.

A failed verdict or trajectory is excluded from training, never scored 0; isolated failures are normal (a
pathological answer that times out, a sandbox that crashed once). A scorer or environment that fails on every
item, `limit` in a row, is broken: the run stops with its last error rather than train on nothing."""

from __future__ import annotations

from collections import Counter

from megatron_rl.rewards.types import EXCLUDED_STATUSES, RewardResult

ENVIRONMENT = ("environment-failure",)
REWARD = tuple(s for s in EXCLUDED_STATUSES if s not in ENVIRONMENT)  # the reward could not be computed


class RewardFailures:
    def __init__(self, limit: int, counted: tuple[str, ...] = REWARD, ignored: tuple[str, ...] = ENVIRONMENT,
                 what: str = "the reward function failed on", flag: str = "--max-consecutive-reward-failures"):
        """Counts the results of the `counted` statuses; a result of the `ignored` ones neither counts nor breaks
        the streak (a failed trajectory has no verdict), any other breaks it."""
        self.limit, self.counted, self.ignored, self.what, self.flag = limit, counted, ignored, what, flag
        self.counts: Counter = Counter()  # cumulative, by status
        self.streak = 0
        self.last: RewardResult | None = None

    def check(self, results: list[RewardResult]) -> None:
        for result in results:
            if result.status in self.counted:
                self.counts[result.status] += 1
                self.streak += 1
                self.last = result
            elif result.status not in self.ignored:
                self.streak = 0
        if self.streak >= self.limit:
            raise RuntimeError(f"{self.what} the last {self.streak} samples in a row ({self.flag} {self.limit}); "
                               f"last failure: {self.last.status}: {self.last.detail}")


def environment_failures(limit: int) -> RewardFailures:
    return RewardFailures(limit, ENVIRONMENT, (), "the environment failed on", "--max-consecutive-environment-failures")
