"""A whole-second time limit on code running in a scoring worker's main thread (SIGALRM).

The exception derives from BaseException, not Exception: scoring code wraps its work in `except Exception`
(math-verify does, around every parse and comparison), and would otherwise swallow the alarm and report a
verdict it never reached. Outside the main thread no signal can be delivered and the limit does nothing; the
worker pool's own deadline still applies there."""

from __future__ import annotations

import contextlib
import signal
import threading


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
