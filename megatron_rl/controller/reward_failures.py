"""Counting the reward's infrastructure failures (timeouts, crashed workers) and stopping on a broken scorer.

A failed verdict is excluded from training, never scored 0; isolated failures are normal (a pathological
answer that times out). A scorer that fails on every item, `limit` verdicts in a row, is broken: the run
stops with its last error rather than train on nothing."""

from __future__ import annotations

from collections import Counter

from megatron_rl.rewards.types import RewardResult


class RewardFailures:
    def __init__(self, limit: int):
        self.limit = limit
        self.counts: Counter = Counter()  # cumulative, by status
        self.streak = 0
        self.last: RewardResult | None = None

    def check(self, results: list[RewardResult]) -> None:
        for result in results:
            if result.is_failure:
                self.counts[result.status] += 1
                self.streak += 1
                self.last = result
            else:
                self.streak = 0
        if self.streak >= self.limit:
            raise RuntimeError(f"the reward function failed on the last {self.streak} samples in a row "
                               f"(--max-consecutive-reward-failures {self.limit}); last failure: "
                               f"{self.last.status}: {self.last.detail}")
