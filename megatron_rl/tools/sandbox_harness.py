"""The Python executor's harness: runs in a fresh interpreter (`python -I sandbox_harness.py`), contains itself,
then runs the policy's code. Imports nothing of the project (no torch, no heavy start-up).

Protocol: one JSON object on stdin ({"code", "memory_mb", "cpu_s", "max_output_chars", "nonce"}); the line
"<nonce> ready <containment> <working directory>" once contained, then, after the code ran, "<nonce> result
<json>" with "output" (stdout and stderr, truncated) and "error" (the traceback's last line, or null). A
process that exits before "ready" is a sandbox failure (the environment's); anything after it is the code's own.

Containment, in order: dies with the rank (PR_SET_PDEATHSIG); a network namespace of its own when the kernel
allows one; a seccomp filter (x86-64 and arm64) that makes the kernel refuse sockets, new processes and threads,
exec, ptrace and signals to other processes; an audit hook that refuses the same from Python, foreign calls through
ctypes, and writes outside its temporary working directory; address space, CPU time, file size and core limits.
It is not a container: the code can read what the rank's user can read.
"""

import contextlib
import ctypes
import io
import json
import os
import resource
import signal
import sys
import tempfile
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 1, 22, 38, 2
# audit architecture -> syscalls refused: socket, socketpair, clone, clone3, fork, vfork, execve, execveat, ptrace,
# kill, tkill, tgkill (arm64 has no fork or vfork)
REFUSED_SYSCALLS = {
    "x86_64": (0xC000003E, (41, 53, 56, 435, 57, 58, 59, 322, 101, 62, 200, 234)),
    "aarch64": (0xC00000B7, (198, 199, 220, 435, 221, 281, 117, 129, 130, 131)),
}
BLOCKED_EVENTS = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
                  "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
                  "os.kill", "os.killpg", "pty.spawn", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata")
WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move")


def seccomp(libc) -> bool:
    """Install the filter of REFUSED_SYSCALLS (EPERM); False on an architecture it does not know."""
    import platform
    import struct

    if platform.machine() not in REFUSED_SYSCALLS:
        return False
    arch, refused = REFUSED_SYSCALLS[platform.machine()]
    errno_eperm, allow, kill = 0x00050001, 0x7FFF0000, 0x80000000
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    program = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0), (jge, 0, 1, 0x40000000),
               (ret, 0, 0, errno_eperm)]
    for nr in refused:
        program += [(jeq, 0, 1, nr), (ret, 0, 0, errno_eperm)]
    program.append((ret, 0, 0, allow))
    filters = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *f) for f in program))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Program(len(program), ctypes.addressof(filters))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0


def contain(request: dict) -> tuple[str, str]:
    """Contain this process: (how, the working directory), reported with "ready"."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)
    how = []
    if libc.unshare(CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET) == 0:
        how.append("network-namespace")
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="sandbox-"))
    os.chdir(workdir)
    memory = request["memory_mb"] * 2**20
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, request["cpu_s"]),
                         (resource.RLIMIT_FSIZE, 16 * 2**20), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    if seccomp(libc):
        how.append("seccomp")

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # a descriptor the code already holds
        full = os.path.realpath(os.fsdecode(path))
        return full == workdir or full.startswith(workdir + os.sep) or full == os.devnull

    def audit(event, args):
        if event in BLOCKED_EVENTS:
            raise PermissionError(f"{event} is not allowed in the sandbox")
        writes = event == "open" and args[0] is not None and (args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
                                                               or any(m in str(args[1] or "") for m in "wax+"))
        if writes and not inside(args[0]):
            raise PermissionError(f"writing {args[0]!r} is not allowed in the sandbox (only the working "
                                      "directory)")
        if event in WRITE_EVENTS and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, int))):
            raise PermissionError(f"{event} outside the working directory is not allowed in the sandbox")

    sys.addaudithook(audit)
    how.append("audit-hook")
    return "+".join(how), workdir


def main() -> None:
    request = json.loads(sys.stdin.readline())
    out, nonce = sys.stdout, request["nonce"]
    containment, workdir = contain(request)
    print(f"{nonce} ready {containment} {workdir}", file=out, flush=True)
    captured, error = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            exec(compile(request["code"], "<code>", "exec"), {"__name__": "__main__"})
    except MemoryError:
        error = f"MemoryError: the code used more than {request['memory_mb']} MiB"
    except BaseException as e:  # noqa: BLE001 - the code's exception is the policy's observation
        error = traceback.format_exception_only(type(e), e)[-1].strip()
    text = captured.getvalue()
    limit = request["max_output_chars"]
    if len(text) > limit:
        text = text[:limit] + f"\n... ({len(text) - limit} more characters)"
    print(f"{nonce} result {json.dumps({'output': text, 'error': error})}", file=out, flush=True)


if __name__ == "__main__":
    main()
