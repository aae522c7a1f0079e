"""Counting the failures that exclude samples (a reward that could not be computed, an environment that failed)
and stopping on a broken scorer or environment.

A failed verdict or trajectory is excluded from training, never scored 0; isolated failures are normal (a
pathological answer that times out, a sandbox that crashed once). A scorer or environment that fails on every
item, `limit` in a row, is broken: the run stops with its last error rather than train on nothing."""

from __future__ import annotations

from collections import Counter

from megatron_rl.rewards.types import RewardResult

ENVIRONMENT = ("environment-failure",)


class RewardFailures:
    def __init__(self, limit: int, statuses: tuple[str, ...] | None = None,
                 what: str = "the reward function failed on", flag: str = "--max-consecutive-reward-failures"):
        """Counts the results of `statuses` (default: every excluded status but the environment's)."""
        self.limit, self.statuses, self.what, self.flag = limit, statuses, what, flag
        self.counts: Counter = Counter()  # cumulative, by status
        self.streak = 0
        self.last: RewardResult | None = None

    def _counted(self, result: RewardResult) -> bool:
        if self.statuses is None:
            return result.is_failure and result.status not in ENVIRONMENT
        return result.status in self.statuses

    def check(self, results: list[RewardResult]) -> None:
        for result in results:
            if self._counted(result):
                self.counts[result.status] += 1
                self.streak += 1
                self.last = result
            elif not (self.statuses is None and result.status in ENVIRONMENT):
                self.streak = 0  # (a failed trajectory has no verdict: it neither counts nor breaks the streak)
        if self.streak >= self.limit:
            raise RuntimeError(f"{self.what} the last {self.streak} samples in a row ({self.flag} {self.limit}); "
                               f"last failure: {self.last.status}: {self.last.detail}")


def environment_failures(limit: int) -> RewardFailures:
    return RewardFailures(limit, ENVIRONMENT, "the environment failed on",
                          "--max-consecutive-environment-failures")
