"""Stopping a run early on purpose, with a checkpoint: `--exit-signal-handler` (a signal: a scheduler's warning
before its time limit, a preemption) and `--exit-duration-in-mins` (Megatron-LM's names). The controller asks
`reason()` after each step and, when there is one, saves a checkpoint (with --save) and ends the run; every other
rank only records the signal, so that it is still serving when the controller stops it.

Under torchrun a SIGTERM to the agent reaches the workers too, and the agent kills them
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (default 30; examples/launch_common.sh sets 600): the step and the
save must fit in it. For a time limit, --exit-duration-in-mins is the sure way; the signal is for what cannot be
foreseen. Reward workers ignore the signal (they die with their rank); an SGLang server that a scheduler signals
too is restarted by its generator until the controller stops.
"""

from __future__ import annotations

import signal
import time

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


class EarlyExit:
    def __init__(self, signal_name: str | None = None, duration_mins: float | None = None):
        """`signal_name`: catch that signal (None: leave signals alone); `duration_mins`: stop once the run has
        lasted that long (counted from here)."""
        self.duration_mins, self.start, self.received = duration_mins, time.monotonic(), None
        if signal_name is not None:
            signal.signal(getattr(signal, signal_name), self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signal.Signals(signum).name

    def reason(self) -> str | None:
        """Why the run should stop now, or None."""
        if self.received is not None:
            return f"{self.received} received (--exit-signal-handler)"
        if self.duration_mins is not None and time.monotonic() - self.start >= 60 * self.duration_mins:
            return f"ran {self.duration_mins:g} min (--exit-duration-in-mins)"
        return None

    @classmethod
    def from_args(cls, args) -> EarlyExit:
        return cls(args.exit_signal if args.exit_signal_handler else None, args.exit_duration_in_mins)
