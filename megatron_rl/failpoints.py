"""Fault injection at exact points of a run, for the crash tests: `MEGATRON_RL_FAILPOINT=name:step` arms the
point `name` at `step` (a training step, or a weight version). A kill sent from outside lands wherever the run
happens to be; a failpoint lands exactly where the test needs it, every time."""

from __future__ import annotations

import os
import signal

ENV = "MEGATRON_RL_FAILPOINT"


def armed(name: str, step: int) -> bool:
    return os.environ.get(ENV) == f"{name}:{step}"


def crash(name: str, step: int) -> None:
    """SIGKILL this process here when the point is armed, with the processes it started when it leads their
    process group (a torchrun worker does): a crashed machine leaves no helper process behind (Megatron's
    checkpoint writer keeps a multiprocessing Manager server, the reward pool its workers)."""
    if armed(name, step):
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
