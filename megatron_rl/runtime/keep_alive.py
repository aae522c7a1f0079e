"""Keep-alives for ranks that wait: every wait on a peer is bounded by --distributed-timeout-minutes (a peer that
vanished must be noticed), so a rank that has nothing to say for that long says "keep-alive" instead.

`KeepAlive` runs a thread that calls `send()` whenever `last_sent()` (the time of the sender's last real message,
`time.monotonic()`; infinity while the peers are known to be busy with it) is more than `interval_s` ago.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class KeepAlive:
    def __init__(self, interval_s: float, last_sent: Callable[[], float], send: Callable[[], None],
                 lock: threading.Lock | None = None, name: str = "keep-alive"):
        """`lock`: held around each `send()` (the sender's own messages take it too, so that the two never
        interleave)."""
        self.interval_s, self.last_sent, self.send = interval_s, last_sent, send
        self.lock = lock or threading.Lock()
        self._stopped, self._last = threading.Event(), time.monotonic()
        self.sent = 0  # keep-alives sent so far
        self._sent_changed = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s / 4):
            now = time.monotonic()
            if now - max(min(self.last_sent(), now), self._last) >= self.interval_s:
                with self.lock:
                    if self._stopped.is_set():
                        return
                    try:
                        self.send()
                    except Exception:  # noqa: BLE001 - a lost peer: the sender's own next message says so
                        return
                    self._last = time.monotonic()
                with self._sent_changed:
                    self.sent += 1
                    self._sent_changed.notify_all()

    def wait_sent(self, count: int, timeout_s: float) -> bool:
        """Block until `count` keep-alives were sent (a phase of that many intervals without a message); False
        after `timeout_s`."""
        with self._sent_changed:
            return self._sent_changed.wait_for(lambda: self.sent >= count, timeout_s)

    def stop(self) -> None:
        """No keep-alive after this returns."""
        with self.lock:
            self._stopped.set()
