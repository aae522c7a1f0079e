"""The base of reward functions that score each sample on a `WorkerPool`: one process per verdict, a time limit
per sample, and the pool's outcomes turned into statuses. A verdict past its limit is "timeout"; a crashed
worker or an exception in the scoring code is "scorer-failure" with the error: both are excluded from
training, never a reward of 0."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_rl.rewards.pool import WorkerPool
from megatron_rl.rewards.result import RewardResult

# The pool's deadline sits this long after the in-worker alarm (`time_limit`): the alarm answers first when
# it can; the pool kills a worker stuck in C code that no signal interrupts (9^9^9^9).
KILL_MARGIN_S = 0.5


class PooledReward:
    def __init__(self, num_workers: int, timeout_s: int, warmup: Callable[[], None] | None = None):
        self.timeout_s = whole_seconds(timeout_s)
        self.pool = WorkerPool(num_workers, warmup=warmup)

    def _timeout(self, timeout_s: int | None) -> int:
        return self.timeout_s if timeout_s is None else whole_seconds(timeout_s)

    def _score(self, fn: Callable[..., RewardResult], items: Sequence[tuple], timeout_s: int) -> list[RewardResult]:
        """`fn(*item)` for every item on the workers; every verdict returns within timeout_s + 1 s."""
        results = []
        for o in self.pool.map(fn, items, timeout_s + KILL_MARGIN_S):
            if o.status == "ok":
                results.append(o.value)
            elif o.status == "timeout":
                results.append(RewardResult(0.0, "timeout", None, o.error))
            else:
                results.append(RewardResult(0.0, "scorer-failure", None, f"{o.status}: {o.error.strip()[-500:]}"))
        return results

    def close(self) -> None:
        self.pool.close()


def whole_seconds(timeout_s) -> int:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s != int(timeout_s) \
            or timeout_s < 1:
        raise ValueError(f"timeout_s must be a whole number of seconds >= 1 (SIGALRM), got {timeout_s!r}")
    return int(timeout_s)
