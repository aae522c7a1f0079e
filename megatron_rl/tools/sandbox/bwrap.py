"""The Python tool's OS sandbox: bubblewrap (`bwrap`, the Debian package bubblewrap).

Each call gets new user, PID, mount, network, IPC, UTS and cgroup namespaces (`--unshare-all --unshare-user`),
`--disable-userns` (no namespaces of its own inside), `--new-session` (no terminal of the caller's to push input
into), `--clearenv`, `--cap-drop ALL`, uid and gid 65534 inside, and `--die-with-parent`. Its file system is a
read-only empty root with only the interpreter bound into it read-only (its executable, its standard library
without site-packages, libpython, /usr/lib and the /lib links, /etc/ld.so.cache), the harness, a `/proc` of its
own PID namespace (read-only), a minimal `/dev` (read-only; its device nodes work) and a fresh tmpfs work
directory of a fixed size. The harness runs as PID 1 of the namespace (`--as-pid-1`), so nothing of bubblewrap is
inside with it; when it ends, or the caller kills bubblewrap, the kernel kills every process left in the namespace.

Why `/proc` is read-only: bubblewrap maps the sandbox's user to the caller's, so a sandbox started by root runs as
root in the eyes of the host's kernel, without capabilities. The kernel lets that user write the host's sysctls
through any procfs (`/proc/sys`, e.g. kernel.core_pattern, which runs a program as root); a read-only mount of
`/proc` refuses every such write.
"""

from __future__ import annotations

import functools
import os
import shutil
import site
import subprocess
import sys
import sysconfig

from megatron_rl.tools.sandbox.process import HARNESS
from megatron_rl.tools.types import SandboxUnavailable

HARNESS_INSIDE = "/sandbox/harness.py"
WORKDIR = "/tmp"
UID = 65534
WEAKER = ("or pass --python-sandbox weak to accept the weaker sandbox explicitly (no namespaces: a seccomp filter, "
          "rlimits and a Python audit hook, which code can switch off)")
USERNS_SETTINGS = ("/proc/sys/user/max_user_namespaces", "/proc/sys/kernel/unprivileged_userns_clone",
                   "/proc/sys/kernel/apparmor_restrict_unprivileged_userns")


def command(bwrap: str, ready_fd: int, memory_mb: int, cpu_s: int, workdir_mb: int, seccomp: bool = True) -> list[str]:
    """The command line of one call: bubblewrap, then the harness in it (see harness.py for its arguments)."""
    size = workdir_mb * 2**20
    return [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1", "--cap-drop", "ALL", "--uid", str(UID), "--gid", str(UID), "--hostname", "sandbox",
            "--clearenv", "--setenv", "HOME", WORKDIR, "--setenv", "TMPDIR", WORKDIR, "--setenv", "LC_ALL", "C.UTF-8",
            *interpreter_mounts(), "--ro-bind", HARNESS, HARNESS_INSIDE,
            "--proc", "/proc", "--dev", "/dev", "--size", str(size), "--perms", "0700", "--tmpfs", WORKDIR,
            "--remount-ro", "/proc", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR,
            "--", os.path.realpath(sys.executable), "-I", "-S", HARNESS_INSIDE, str(ready_fd), str(memory_mb),
            str(cpu_s), str(size), *([] if seccomp else ["--no-filter"])]


@functools.cache
def interpreter_mounts() -> tuple[str, ...]:
    """bwrap arguments that bind what this interpreter needs to start and import its standard library, read-only,
    at the same paths: the executable, the standard library (site-packages under it hidden by an empty read-only
    tmpfs), libpython, /usr/lib (the C libraries), the /lib links and /etc/ld.so.cache."""
    args, bound = [], []

    def bind(path):
        if os.path.exists(path) and not any(path == b or path.startswith(b + "/") for b in bound):
            args.extend(["--ro-bind", path, path])
            bound.append(path)

    for path in ("/usr/lib", "/usr/lib64", "/usr/lib32"):
        if os.path.isdir(path) and not os.path.islink(path):
            bind(path)
    for path in ("/lib", "/lib64", "/lib32"):
        if os.path.islink(path):
            args.extend(["--symlink", os.readlink(path), path])
        elif os.path.isdir(path):
            bind(path)
    bind("/etc/ld.so.cache")
    bind(os.path.realpath(sys.executable))
    for path in sorted({sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}):
        bind(os.path.realpath(path))
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        bind(os.path.realpath(os.path.join(sysconfig.get_config_var("LIBDIR"),
                                           sysconfig.get_config_var("INSTSONAME"))))
    for path in site.getsitepackages([sys.base_prefix]) + ["/usr/lib/python3/dist-packages"]:
        path = os.path.realpath(path)
        if os.path.isdir(path) and any(path.startswith(b + "/") for b in bound):
            args.extend(["--tmpfs", path, "--remount-ro", path])
    return tuple(args)


def check(bwrap: str | None) -> None:
    """Run one call through `bwrap` (a path, or None: not installed); raise SandboxUnavailable naming the cause,
    what to change, and the flag that accepts a weaker sandbox."""
    if bwrap is None:
        raise SandboxUnavailable("--python-sandbox bwrap: bubblewrap is not installed (no `bwrap` on PATH): install "
                                 f"the bubblewrap package (apt-get install -y bubblewrap), {WEAKER}")
    ready_r, ready_w = os.pipe()
    try:
        done = subprocess.run(command(bwrap, ready_w, 256, 10, 1), input=b"print(6 * 7)", capture_output=True,
                              pass_fds=(ready_w,), env={}, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"--python-sandbox bwrap: {bwrap} did not run ({e}), {WEAKER}") from e
    finally:
        os.close(ready_r)
        os.close(ready_w)
    if done.returncode == 0 and done.stdout == b"42\n":
        return
    said = (done.stderr or done.stdout).decode(errors="replace").strip() or f"exit status {done.returncode}"
    if "namespace" in said or "uid map" in said or "unshare" in said:
        settings = "; ".join(f"{p[len('/proc/sys/'):].replace('/', '.')} = {_read(p)}" for p in USERNS_SETTINGS
                             if os.path.exists(p))
        raise SandboxUnavailable(
            f"--python-sandbox bwrap: bubblewrap cannot create its namespaces here ({said}). User namespaces are "
            f"blocked: the kernel settings {settings or 'user.max_user_namespaces'} must allow them "
            "(user.max_user_namespaces > 0, kernel.unprivileged_userns_clone = 1 where it exists, "
            "kernel.apparmor_restrict_unprivileged_userns = 0 or an AppArmor profile for bwrap); a container needs "
            f"--privileged or a seccomp profile that allows unshare and clone of user namespaces; {WEAKER}")
    raise SandboxUnavailable(f"--python-sandbox bwrap: bubblewrap could not run the interpreter in the sandbox "
                             f"({said}); {WEAKER}")


@functools.cache
def ensure() -> str:
    """The path of a working `bwrap`, checked once per process (`check`)."""
    bwrap = shutil.which("bwrap")
    check(bwrap)
    return bwrap


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable ({e.strerror})"
