"""The parent of a rank that is killed in the middle of a python tool call (test_sandbox.py): it starts the rank,
waits until the sandbox runs the code, kills the rank with SIGKILL (no clean-up of its own) and prints, as JSON,
how many sandbox processes it saw and which of them are still alive 10 s later.

It is a child subreaper, as a launcher that outlives its ranks is: the orphaned sandbox comes here, and is not left
to whatever the machine's init does with orphans. It kills what is left before it exits.
"""

import ctypes
import json
import os
import subprocess
import sys
import time

import psutil

from megatron_rl.tools.sandbox import bwrap

PR_SET_CHILD_SUBREAPER = 36
RANK = ("import asyncio\nfrom megatron_rl.tools import SandboxLimits, run_python\n"
        "from megatron_rl.tools.sandbox import bwrap\nbwrap.ensure()\nprint('checked', flush=True)\n"
        "asyncio.run(run_python('while True: pass', SandboxLimits(timeout_s=600)))")


def running_sandbox(rank: subprocess.Popen) -> list[psutil.Process]:
    """bubblewrap and the harness, once the harness has closed its ready pipe (0, 1 and 2 are left: it runs the
    code)."""
    interpreter = os.path.realpath(sys.executable)
    while rank.poll() is None:
        found = psutil.Process(rank.pid).children(recursive=True)
        harness = [p for p in found if p.cmdline()[:1] == [interpreter] and bwrap.HARNESS_INSIDE in p.cmdline()
                   and p.num_fds() == 3]
        if harness:
            return [*harness, *(p for p in found if p.name() == "bwrap")]
        time.sleep(0.01)
    raise RuntimeError(f"the rank exited with status {rank.returncode}")


def main() -> None:
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
    assert rank.stdout.readline() == "checked\n"  # the check's own sandbox has come and gone
    sandbox = running_sandbox(rank)
    rank.kill()
    rank.wait()
    _, alive = psutil.wait_procs(sandbox, timeout=10)
    print(json.dumps({"sandbox": len(sandbox), "alive": [p.pid for p in alive]}))
    for p in alive:
        p.kill()
    psutil.wait_procs(alive)


if __name__ == "__main__":
    main()
