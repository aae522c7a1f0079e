"""Fault injection at exact points of a run, for the crash tests and the soak benchmark:
`MEGATRON_RL_FAILPOINT=name:n` arms the point `name` at `n`. A kill sent from outside lands wherever the run
happens to be; a failpoint lands exactly where the test needs it, every time. The points:

- checkpoint-partial:STEP  the controller, with step STEP's checkpoint written but not yet complete (renamed)
- checkpoint-saved:STEP    the controller, right after step STEP's checkpoint became the latest
- train:V                  a trainer rank, after the forward and backward passes of the step that trains weight
                           version V, before the optimizer changes the weights
- publish:V                a rank in the middle of DDMA of version V (its transfers done, the engine not yet
                           given the weights)
- generate:V               a generator rank, right after its first decode step under version V
- sglang-server-crash:V    a replica leader's SGLang server (not the rank), after taking version V
"""

from __future__ import annotations

import os
import signal

ENV = "MEGATRON_RL_FAILPOINT"


def armed(name: str, step: int) -> bool:
    return os.environ.get(ENV) == f"{name}:{step}"


def crash(name: str, step: int) -> None:
    """SIGKILL this process here when the point is armed: what it started dies with it (`lifetime`)."""
    if armed(name, step):
        os.kill(os.getpid(), signal.SIGKILL)
