"""Scoring in worker processes that no single item can hang or break: the pool, the base of reward functions that
score on it, and the in-worker time limit.

`WorkerPool`. Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop one task that runs too long (a sympy
power tower spends minutes inside C code, where signal-based timeouts never fire), and one worker killed by
the OS breaks the whole executor. Here the parent holds a deadline per item: an item past its deadline has
its worker killed and is reported as "timeout"; an item whose worker died is reported as "crashed"; an
exception inside the function is reported as "error" with its traceback. Each lost worker is replaced.
Workers die with the process that started them, however it dies (SIGKILL included): a rank killed mid-run
leaves no scoring processes behind. (Strictly, with the thread that started it: a pool belongs to long-lived
threads, the controller's and the reward stage's.)

`PooledReward`, the base of reward functions that score each sample on a `WorkerPool`: one process per verdict, a
time limit per sample, and the pool's outcomes turned into statuses. A verdict past its limit is "timeout"; a crashed
worker or an exception in the scoring code is "scorer-failure" with the error: both are excluded from training,
never a reward of 0.

`time_limit`, a whole-second limit on code running in a scoring worker's main thread (SIGALRM). Its exception
derives from BaseException, not Exception: scoring code wraps its work in `except Exception` (math-verify does,
around every parse and comparison), and would otherwise swallow the alarm and report a verdict it never reached.
Outside the main thread no signal can be delivered and the limit does nothing; the pool's own deadline still
applies there.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing as mp
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from megatron_rl.rewards.types import RewardResult


@dataclasses.dataclass
class Outcome:
    status: str  # "ok", "timeout", "crashed", "error"
    value: Any = None
    error: str = ""


def _worker_main(conn, warmup: Callable[[], None] | None) -> None:
    import signal

    from megatron_rl.runtime.early_exit import SIGNALS
    from megatron_rl.runtime.lifetime import die_with_parent

    die_with_parent()
    for name in SIGNALS:  # a scheduler signals every process: the rank that started the worker decides, and it dies
        signal.signal(getattr(signal, name), signal.SIG_IGN)  # with the rank (the pool kills it with SIGKILL)
    try:
        if warmup is not None:
            warmup()
    except BaseException:  # noqa: BLE001 - a worker that cannot start stops the pool with the reason
        conn.send(("warmup-failed", "error", traceback.format_exc(limit=5)))
        return
    conn.send(("ready", None, None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        task_id, fn, args = message
        try:
            conn.send((task_id, "ok", fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which decides what it means
            conn.send((task_id, "error", traceback.format_exc(limit=5)))


class _Worker:
    def __init__(self, ctx, warmup):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, warmup), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.task: tuple[int, float] | None = None  # (item index, deadline)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class WorkerPool:
    """`map(fn, items, timeout_s)` runs `fn(*item)` for every item on `num_workers` processes."""

    def __init__(self, num_workers: int = 2, warmup: Callable[[], None] | None = None, start_timeout_s: float = 120):
        if num_workers < 1:
            raise ValueError(f"--reward-num-workers must be >= 1, got {num_workers}")
        self._ctx = mp.get_context("spawn")
        self._warmup = warmup
        self._start_timeout_s = start_timeout_s
        self.num_workers = num_workers
        self.replaced_workers = 0
        self._workers = [_Worker(self._ctx, warmup) for _ in range(num_workers)]
        # Workers ignore SIGTERM (`_worker_main`), which multiprocessing's own exit handler sends its daemonic
        # children before it joins them: killed here first (atexit runs later registrations first), the process
        # exits however it ends, an exception included.
        atexit.register(self.kill)

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self._warmup)
        self.replaced_workers += 1

    def map(self, fn: Callable, items: Sequence[tuple], timeout_s: float) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(items)
        pending = list(range(len(items)))[::-1]
        start_deadline = time.monotonic() + self._start_timeout_s
        while pending or any(w.task for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and pending:
                    i = pending.pop()
                    w.conn.send((i, fn, items[i]))
                    w.task = (i, time.monotonic() + timeout_s)
            now = time.monotonic()
            deadlines = [w.task[1] for w in self._workers if w.task] or [now + 1.0]
            waitables = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
            ready = wait(waitables, timeout=max(0.0, min(deadlines) - now))
            for k, w in enumerate(self._workers):
                if w.conn in ready:
                    try:
                        task_id, status, value = w.conn.recv()
                    except (EOFError, OSError):
                        self._lose(k, results, "crashed", "worker process died")
                        continue
                    if task_id == "ready":
                        w.ready = True
                    elif task_id == "warmup-failed":
                        raise RuntimeError(f"a scoring worker failed to start:\n{value}")
                    elif w.task and task_id == w.task[0]:
                        results[task_id] = Outcome("ok", value) if status == "ok" else Outcome("error", error=value)
                        w.task = None
                elif w.process.sentinel in ready:
                    self._lose(k, results, "crashed", f"worker process died (exit code {w.process.exitcode})")
            now = time.monotonic()
            for k, w in enumerate(self._workers):
                if w.task and now > w.task[1]:
                    self._lose(k, results, "timeout", f"no verdict within {timeout_s:g} s; worker killed")
            if not any(w.ready for w in self._workers) and now > start_deadline:
                raise RuntimeError(f"no scoring worker started within {self._start_timeout_s:.0f} s")
        return results  # type: ignore[return-value]

    def _lose(self, k: int, results: list, status: str, error: str) -> None:
        w = self._workers[k]
        if w.task is not None:
            results[w.task[0]] = Outcome(status, error=error)
        self._replace(k)

    def close(self) -> None:
        for w in self._workers:
            with contextlib.suppress(OSError, BrokenPipeError):
                w.conn.send(None)
            w.process.join(timeout=2)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every worker (those that already exited are only reaped)."""
        atexit.unregister(self.kill)
        for w in self._workers:
            w.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


class TimeLimitExceeded(BaseException):
    pass


def _on_alarm(signum, frame):
    raise TimeLimitExceeded()


@contextlib.contextmanager
def time_limit(seconds: int):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
