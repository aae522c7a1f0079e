"""The Python executor tool: the policy's code in a contained interpreter of its own, one per call.

Each call starts `sandbox_harness.py` in a fresh `python -I` process in a session of its own (see the harness
for what contains it: no network, no new processes, memory, CPU time and file limits, dies with the rank), sends
the code, and waits at most `timeout_s`; then the whole session is killed. What the code did (its output, its
exception, a timeout, a memory limit hit) is the policy's observation. A harness that never says it is ready
(the interpreter cannot start, the sandbox cannot be set up) is the environment failing: `EnvironmentFailure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import sys

from megatron_rl.tools.types import EnvironmentFailure, ToolResult

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")

SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a sandbox (no network, no processes) and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string",
                                                                 "description": "the program; print the result"}},
                       "required": ["code"]},
    },
}


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall time per call
    memory_mb: int = 1024  # address space
    max_output_chars: int = 4000


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> ToolResult:
    nonce = secrets.token_hex(8)
    request = {"code": code, "memory_mb": limits.memory_mb, "cpu_s": int(limits.timeout_s) + 1,
               "max_output_chars": limits.max_output_chars, "nonce": nonce}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    try:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-I", HARNESS, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
                                                    env=env)
    except OSError as e:
        raise EnvironmentFailure(f"python sandbox: cannot start the interpreter ({e})") from e
    try:
        stdout, timed_out = await _communicate(proc, json.dumps(request).encode() + b"\n", limits.timeout_s)
    finally:
        _kill_session(proc)
        await proc.wait()
    lines = stdout.decode(errors="replace").splitlines()
    ready = [line.split(" ", 3) for line in lines if line.startswith(f"{nonce} ready ")]
    if not ready:
        raise EnvironmentFailure(f"python sandbox: the harness exited with status {proc.returncode} before it was "
                                 "ready (the sandbox could not be set up)")
    shutil.rmtree(ready[0][3], ignore_errors=True)  # its working directory
    if timed_out:
        return ToolResult(f"error: the code ran longer than {limits.timeout_s:g} s and was stopped", is_error=True)
    results = [line for line in lines if line.startswith(f"{nonce} result ")]
    if not results:
        status = proc.returncode
        how = f"was killed by signal {-status}" if status is not None and status < 0 else f"exited with status {status}"
        return ToolResult(f"error: the code {how} before it finished", is_error=True)
    result = json.loads(results[-1][len(nonce) + 8:])
    text = result["output"]
    if result["error"]:
        return ToolResult(f"{text}{result['error']}" if text else result["error"], is_error=True)
    return ToolResult(text)


async def _communicate(proc, request: bytes, timeout_s: float) -> tuple[bytes, bool]:
    """The harness's stdout once it exits (True: it ran past `timeout_s`; its output so far)."""
    proc.stdin.write(request)
    await proc.stdin.drain()
    proc.stdin.close()
    chunks = []

    async def read():
        while chunk := await proc.stdout.read(65536):
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
        return b"".join(chunks), False
    except TimeoutError:
        return b"".join(chunks), True


def _kill_session(proc) -> None:
    """Kill the harness and anything it started (its session's process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
