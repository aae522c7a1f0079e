"""A stand-in for a generator rank in the sandbox's hostile-code tests (test_sandbox.py): a process of its own that
runs the python tool for the test and holds what a rank holds, for the probes to go after.

It holds the run's API keys in its environment (the test starts it with them), a listening TCP port on loopback
and a listening abstract unix socket (a thread counts every connection), a memory canary at an address it reports
(the test reads it through /proc/<pid>/mem after each probe), and it is a child subreaper, so that any process a
probe leaves behind is reparented to it and shows up among its children (it reaps those that ended, as init would,
and waits for those that were killed to go).

Protocol, one JSON object a line. In: the memory canary's bytes (hex) first, then requests {"code", "timeout_s",
"sandbox", "seccomp"}. Out: {"pid", "port", "unix", "canary_address"} once, then per request {"text", "is_error",
"environment_failure", "leftover" (descendants still alive LINGER_S after the call), "connections" (since the
start), "rss" (bytes), "fds" (open descriptors)}.
"""

import asyncio
import contextlib
import ctypes
import json
import os
import socket
import sys
import threading

import psutil

from megatron_rl.tools import EnvironmentFailure, SandboxLimits, run_python
from megatron_rl.tools.sandbox import bwrap
from megatron_rl.tools.sandbox.process import report, run_contained

PR_SET_CHILD_SUBREAPER = 36
LINGER_S = 5  # how long a process that was killed may take to go before it counts as left behind
connections = 0


def listen(sock: socket.socket) -> None:
    global connections
    sock.listen(16)
    while True:
        peer, _ = sock.accept()
        connections += 1
        peer.close()


def reap() -> None:
    """Reap what was reparented here and has ended, as init would (the sandbox's PID 1 outlives bubblewrap for a
    moment when bubblewrap is killed)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


async def call(request: dict):
    limits = SandboxLimits(timeout_s=request["timeout_s"], memory_mb=512, workdir_mb=16)
    if request["seccomp"]:
        return await run_python(request["code"], limits, request["sandbox"])
    path = bwrap.ensure()
    observed = await run_contained(
        lambda fd: bwrap.command(path, fd, limits.memory_mb, limits.cpu_s, limits.workdir_mb, seccomp=False),
        request["code"], limits.timeout_s, limits.max_output_bytes, env={})
    return report(observed, limits.timeout_s, limits.max_output_bytes, limits.max_output_chars)


def main() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    canary = bytearray(bytes.fromhex(sys.stdin.readline()))
    address = ctypes.addressof((ctypes.c_char * len(canary)).from_buffer(canary))
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_name = f"megatron-rl-rank-{os.getpid()}"
    unix.bind("\0" + unix_name)
    for sock in (tcp, unix):
        threading.Thread(target=listen, args=(sock,), daemon=True).start()
    print(json.dumps({"pid": os.getpid(), "port": tcp.getsockname()[1], "unix": unix_name,
                      "canary_address": address}), flush=True)
    me = psutil.Process()
    for line in sys.stdin:
        request = json.loads(line)
        answer = {"environment_failure": None, "text": None, "is_error": None}
        try:
            result = asyncio.run(call(request))
            answer.update(text=result.text, is_error=result.is_error)
        except EnvironmentFailure as e:
            answer["environment_failure"] = str(e)
        reap()
        _, alive = psutil.wait_procs(me.children(recursive=True), timeout=LINGER_S)
        answer["leftover"] = [f"{p.pid} {p.name()}" for p in alive]
        answer.update(connections=connections, rss=me.memory_info().rss, fds=len(os.listdir("/proc/self/fd")))
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
