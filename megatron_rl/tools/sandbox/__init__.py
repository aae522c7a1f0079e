"""The Python executor tool: the policy's code in a sandbox of its own, one per call (--python-sandbox).

- `bwrap` (the default): an OS sandbox from bubblewrap: Linux namespaces, a file system of the interpreter only,
  read-only, and a small tmpfs work directory; rlimits and a seccomp filter inside as a second layer (`bwrap.py`).
  It is checked once when the tool is built; without a working bubblewrap the run refuses to start
  (`SandboxUnavailable`) naming the cause and the flag of the weaker sandbox.
- `weak`: only when asked for: a `python -I` process that contains itself (seccomp, rlimits, a network namespace
  where the kernel allows one, an audit hook; `harness.py`). Not a boundary against code that means harm.

Either way the code's stdout and stderr are its output, read in bounded chunks, and the outcome (the exit status,
a time-out after `timeout_s`, output over `max_output_bytes`) is what the caller itself observed (`process.py`);
a sandbox that never gets ready is the environment failing: `EnvironmentFailure`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shutil
import sys
import tempfile

from megatron_rl.tools.sandbox import bwrap
from megatron_rl.tools.sandbox.process import HARNESS, report, run_contained
from megatron_rl.tools.types import ToolResult

SANDBOXES = ("bwrap", "weak")
WEAK_ENV = {"PATH": "/usr/bin:/bin", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code (the standard library only) in a sandbox with no network and no processes, "
                       "and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string",
                                                                 "description": "the program; print the result"}},
                       "required": ["code"]},
    },
}


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall time per call, from the sandbox's "ready"
    memory_mb: int = 1024  # address space
    max_output_chars: int = 4000  # what the policy reads
    max_output_bytes: int = 2**20  # what the caller reads at most: more stops the code
    workdir_mb: int = 64  # the work directory's size, and the largest file

    @property
    def cpu_s(self) -> int:
        return math.ceil(self.timeout_s) + 1


def python_tool(limits: SandboxLimits, sandbox: str = "bwrap"):
    """The `python` tool's function for a tool set: checks now that the sandbox works (SandboxUnavailable)."""
    if sandbox == "bwrap":
        bwrap.ensure()
    elif sandbox != "weak":
        raise ValueError(f"--python-sandbox {sandbox!r}: expected one of {', '.join(SANDBOXES)}")
    return functools.partial(run_python, limits=limits, sandbox=sandbox)


async def run_python(code: str, limits: SandboxLimits = SandboxLimits(), sandbox: str = "bwrap") -> ToolResult:
    """Run `code` in a fresh sandbox of the kind `sandbox`; what it did, as the policy reads it."""
    if sandbox == "bwrap":
        path = bwrap.ensure()
        observed = await run_contained(
            lambda fd: bwrap.command(path, fd, limits.memory_mb, limits.cpu_s, limits.workdir_mb), code,
            limits.timeout_s, limits.max_output_bytes, env={})
    elif sandbox == "weak":
        workdir = tempfile.mkdtemp(prefix="sandbox-")
        try:
            observed = await run_contained(
                lambda fd: [sys.executable, "-I", HARNESS, str(fd), str(limits.memory_mb), str(limits.cpu_s),
                            str(limits.workdir_mb * 2**20), "--weak"],
                code, limits.timeout_s, limits.max_output_bytes, env=WEAK_ENV, cwd=workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    else:
        raise ValueError(f"--python-sandbox {sandbox!r}: expected one of {', '.join(SANDBOXES)}")
    return report(observed, limits.timeout_s, limits.max_output_bytes, limits.max_output_chars)
