"""The Python tool's harness: the interpreter's first code in the sandbox. It reads the policy's code on stdin, adds
the sandbox's second layer (rlimits, a seccomp filter), says it is ready, then runs the code. Stdlib only: it runs
as `python -I -S harness.py` inside bubblewrap, where nothing else of the project or of site-packages exists.

    python -I -S harness.py READY_FD MEMORY_MB CPU_S FILE_BYTES [--weak] [--no-filter]

READY_FD: the caller's pipe; the harness writes one byte to it once contained and closes it before the code runs,
so the code can neither reach it nor say "ready" for a sandbox that failed. The code's stdout and stderr are the
tool's output, as they are; an exception that ends the code adds its traceback's last line on stderr and exit
status 1. The outcome the caller reports (exit status, time-out, output over its cap) is the caller's own
observation: nothing the code prints is read as a message.

--weak: the sandbox without bubblewrap (--python-sandbox weak): the harness also contains itself with
PR_SET_PDEATHSIG, a network namespace where the kernel allows one, and an audit hook that refuses writes outside
its working directory. The audit hook is not a security boundary (Python's documentation says so): code can
switch it off. --no-filter leaves the seccomp filter out (tests of the namespaces on their own).
"""

import ctypes
import os
import platform
import resource
import signal
import struct
import sys
import traceback

PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 1, 22, 38, 2
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
MAX_OPEN_FILES = 256
# audit architecture of each machine, and the syscalls the filter refuses (EPERM) by number there (x86-64, arm64;
# arm64 has no fork, vfork or mknod): new processes and threads, exec, signals to other processes, another
# process's memory, sockets, namespaces and mounts, keyrings, BPF, perf, io_uring, userfaultfd, modules.
ARCHITECTURES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
REFUSED_SYSCALLS = {
    "clone": (56, 220), "clone3": (435, 435), "fork": (57, None), "vfork": (58, None), "execve": (59, 221),
    "execveat": (322, 281), "ptrace": (101, 117), "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138), "rt_tgsigqueueinfo": (297, 240), "pidfd_open": (434, 434),
    "pidfd_send_signal": (424, 424), "pidfd_getfd": (438, 438), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "socket": (41, 198), "socketpair": (53, 199), "unshare": (272, 97),
    "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442), "mknod": (133, None),
    "mknodat": (259, 33), "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "kexec_load": (246, 104),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "reboot": (169, 142),
    "swapon": (167, 224), "swapoff": (168, 225), "acct": (163, 89),
}
BLOCKED_EVENTS = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
                  "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
                  "os.kill", "os.killpg", "pty.spawn", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata")
WRITE_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
                "os.symlink", "os.link", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move")


def seccomp_filter(libc) -> bool:
    """Install the filter: REFUSED_SYSCALLS fail with EPERM, another architecture's calls kill the process, the rest
    pass. False on a machine it has no numbers for; an error when the kernel refuses it."""
    if platform.machine() not in ARCHITECTURES:
        return False
    arch, column = ARCHITECTURES[platform.machine()]
    refused = sorted({numbers[column] for numbers in REFUSED_SYSCALLS.values() if numbers[column] is not None})
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
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "the kernel refused the seccomp filter")
    return True


def set_limits(memory_mb: int, cpu_s: int, file_bytes: int) -> None:
    """Address space, CPU time (a SIGKILL at the limit), file size, open files; no core dumps."""
    for limit, value in ((resource.RLIMIT_AS, memory_mb * 2**20), (resource.RLIMIT_CPU, cpu_s),
                         (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))


def die_with_the_caller(libc) -> None:
    """--weak: PR_SET_PDEATHSIG, and a network namespace of its own where the kernel allows one."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)
    libc.unshare(CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET)


def audit_hook(workdir: str):
    """--weak: an audit hook that refuses sockets, processes, signals, ctypes calls and writes outside `workdir`."""

    def inside(path) -> bool:
        if isinstance(path, int):
            return True
        full = os.path.realpath(os.fsdecode(path))
        return full == workdir or full.startswith(workdir + os.sep) or full == os.devnull

    def audit(event, args):
        if event in BLOCKED_EVENTS:
            raise PermissionError(f"{event} is not allowed in the sandbox")
        writes = event == "open" and args[0] is not None and (args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
                                                               or any(m in str(args[1] or "") for m in "wax+"))
        if writes and not inside(args[0]):
            raise PermissionError(f"writing {args[0]!r} is not allowed in the sandbox (only the working directory)")
        if event in WRITE_EVENTS and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, int))):
            raise PermissionError(f"{event} outside the working directory is not allowed in the sandbox")

    return audit


def run(code: str, memory_mb: int) -> None:
    """Run the code as `__main__`; an exception ends it with its traceback's last line on stderr and status 1."""
    sys.stdout.reconfigure(line_buffering=True)
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        print(f"MemoryError: the code used more than {memory_mb} MiB", file=sys.stderr)
        sys.exit(1)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the code's exception is the policy's observation
        print(traceback.format_exception_only(type(e), e)[-1].strip(), file=sys.stderr)
        sys.exit(1)


def main() -> None:
    ready, memory_mb, cpu_s, file_bytes = (int(a) for a in sys.argv[1:5])
    code = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    libc, weak = ctypes.CDLL(None, use_errno=True), "--weak" in sys.argv
    if weak:
        die_with_the_caller(libc)
    set_limits(memory_mb, cpu_s, file_bytes)
    if "--no-filter" not in sys.argv:
        seccomp_filter(libc)
    if weak:
        sys.addaudithook(audit_hook(os.path.realpath(os.getcwd())))
    os.write(ready, b"R")
    os.close(ready)
    run(code, memory_mb)


if __name__ == "__main__":
    main()
