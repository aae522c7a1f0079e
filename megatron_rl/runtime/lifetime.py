"""Every process a rank starts dies with it, however the rank dies (SIGKILL included).

A rank starts processes it does not control: reward workers, an SGLang server, Megatron's checkpoint writer (a
multiprocessing Manager server and forked writers), multiprocessing's resource tracker. When the rank is killed,
nothing would stop them: they are re-parented to init and keep their memory, ports and files. Two mechanisms:

- `die_with_parent`, for the processes this project starts itself: the kernel SIGKILLs the child when its parent
  dies (Linux PR_SET_PDEATHSIG).
- `reap_when_gone`, for everything else: the rank marks its environment with a token that every process it
  executes inherits, and starts a small watcher process that, once the rank is gone, kills every process carrying
  the token and, when the rank leads its session (a torchrun worker does), every process of its group
  (forked children, which show their parent's environment as it was at its start, without the token). The
  watcher acts once it has been re-parented, that is once the rank is gone, whether killed or at the end of a
  normal exit.

`processes_with_env` is how tests count what a run left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

OWNER_ENV = "MEGATRON_RL_PROCESS_OWNER"

# The watcher: wait for the rank (its parent) to be gone, then kill its marked descendants. It is gone once the
# watcher has been re-parented; the kernel signals that moment (PR_SET_PDEATHSIG), and the one-second poll covers a
# rank that died before the request took effect. (End of file on a pipe would come too early: a rank that exits
# normally closes its files before it is gone, and killing its group then would turn its exit status into -9.)
# multiprocessing's resource tracker is killed last, after a grace period: it exits by itself once the processes it
# tracks are gone, and removes what they leaked (shared memory, semaphores) on the way. Zombies are skipped: they
# are dead already, and only their parent can remove them.
_WATCHER = r"""
import ctypes, os, signal, sys, time
token, group, parent = sys.argv[1].encode(), int(sys.argv[2]), int(sys.argv[3])
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGUSR1)  # 1 = PR_SET_PDEATHSIG
while os.getppid() == parent:
    signal.sigtimedwait([signal.SIGUSR1], 1.0)
def marked():
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                if fields[0] == b"Z":
                    continue
                in_group = group and int(fields[2]) == group
                with open(f"/proc/{name}/environ", "rb") as f:
                    if in_group or token in f.read().split(b"\0"):
                        with open(f"/proc/{name}/cmdline", "rb") as f:
                            found[int(name)] = b"resource_tracker" in f.read()
            except (OSError, ValueError, IndexError):
                pass
    return found
deadline = time.monotonic() + 5.0
while found := marked():
    for pid, tracker in found.items():
        if not tracker or time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.1)
"""


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies, however the parent dies (Linux
    PR_SET_PDEATHSIG). torchrun starts each worker in a session of its own, so a SIGKILL of the launcher's
    process group would otherwise leave the workers running; the same holds for a launched SGLang server."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


_watcher: subprocess.Popen | None = None


def reap_when_gone() -> None:
    """Mark this process's environment (before it starts any child) and start the watcher that kills every
    marked process once this one is gone. Idempotent; a no-op where there is no /proc to find them in."""
    global _watcher
    if _watcher is not None or not os.path.isdir("/proc"):
        return
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ[OWNER_ENV] = token
    # A torchrun worker leads its session, and so its process group, whose other members are its forked children.
    # A group leader in a shell's pipeline (`... | tee log`) does not own the pipeline's other processes.
    group = os.getpid() if os.getsid(0) == os.getpid() else 0
    # The rank's pid is passed: if the rank is gone before the watcher starts, the watcher's parent is not it.
    _watcher = subprocess.Popen([sys.executable, "-S", "-c", _WATCHER, f"{OWNER_ENV}={token}", str(group),
                                 str(os.getpid())],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


def processes_with_env(name: str, value: str) -> list[int]:
    """The ids of the live processes whose environment has `name=value` (descendants inherit it), this one
    excepted; zombies (dead, waiting to be reaped by their parent) are not counted."""
    marker, found = f"{name}={value}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return found


def wait_until_gone(name: str, value: str, timeout_s: float) -> list[str]:
    """Wait (at most `timeout_s`) for every process whose environment has `name=value` to exit; returns
    `pid: command line` of those still there (empty when all are gone)."""
    import time

    deadline = time.monotonic() + timeout_s
    while (left := processes_with_env(name, value)) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = []
    for pid in left:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                described.append(f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")[:200])
        except OSError:
            pass  # it exited meanwhile
    return described
