"""One sandboxed call as the caller sees it: start the process, give it the code, read its output in bounded
chunks, and tell what happened from its own observation only.

The harness (`harness.py`) says it is ready on a pipe of its own that it closes before the code runs. Before
that, whatever goes wrong is the environment's (`EnvironmentFailure`): the sandbox could not be set up. After it,
the outcome is the code's, and it comes from the caller: the exit status the kernel reports for the process, the
caller's clock for a time-out, the byte count it read for output over the cap. The output is plain bytes, capped
while it is read (the process is stopped at the cap), and never parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import Callable

from megatron_rl.tools.types import EnvironmentFailure, ToolResult

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")  # what both sandboxes run
STARTUP_TIMEOUT_S = 60.0  # from the start of the process to the harness's "ready"
DRAIN_TIMEOUT_S = 10.0  # from the kill to the end of its output: only a process that outlived the sandbox waits
CHUNK = 65536


@dataclasses.dataclass(frozen=True)
class Observed:
    output: bytes  # stdout and stderr together, at most the cap
    returncode: int | None  # the process's, when it ended on its own; None when the caller stopped it
    timed_out: bool = False
    over_cap: bool = False


async def run_contained(command: Callable[[int], list[str]], code: str, timeout_s: float, max_output_bytes: int,
                        env: dict, cwd: str | None = None, what: str = "python sandbox") -> Observed:
    """Run `command(ready_fd)` with `code` on its stdin, at most `timeout_s` seconds from its "ready"; it is killed
    afterwards, whatever happened, through a pidfd taken at its start (not by pid, which another process may have
    by then). bubblewrap's sandbox dies with it; the weak sandbox's harness cannot start processes of its own."""
    ready_r, ready_w = os.pipe()
    argv = command(ready_w)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            pass_fds=(ready_w,), start_new_session=True, env=env, cwd=cwd)
    except OSError as e:
        os.close(ready_r)
        raise EnvironmentFailure(f"{what}: cannot start {argv[0]!r} ({e})") from e
    finally:
        os.close(ready_w)
    pidfd = _pidfd(proc.pid)
    output, over_cap = bytearray(), asyncio.Event()
    reader = asyncio.create_task(_read_bounded(proc.stdout, output, max_output_bytes, over_cap))
    feeder = asyncio.create_task(_feed(proc.stdin, code.encode("utf-8", errors="surrogateescape")))
    ready, returncode, timed_out = False, None, False
    try:
        ready = await _ready(ready_r, what)
        if ready:
            waited, capped = asyncio.create_task(proc.wait()), asyncio.create_task(over_cap.wait())
            done, _ = await asyncio.wait({waited, capped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            waited.cancel()
            capped.cancel()
            timed_out = not done
            if waited in done and not over_cap.is_set():
                returncode = proc.returncode
    finally:
        if pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
        try:
            await asyncio.wait_for(asyncio.gather(proc.wait(), asyncio.shield(reader)), DRAIN_TIMEOUT_S)
        except TimeoutError:
            raise EnvironmentFailure(f"{what}: a process of the sandbox outlived it (its output stayed open "
                                     f"{DRAIN_TIMEOUT_S:g} s after the kill)") from None
        finally:
            reader.cancel()
            feeder.cancel()
    if not ready:
        raise EnvironmentFailure(f"{what}: exited with status {proc.returncode} before it was ready (the sandbox "
                                 f"could not be set up): {_tail(output)}")
    return Observed(bytes(output), returncode, timed_out, over_cap.is_set())


def report(observed: Observed, timeout_s: float, max_output_bytes: int, max_output_chars: int) -> ToolResult:
    """What the policy reads: the output (truncated to `max_output_chars`), then the outcome when it is not a
    clean exit."""
    text = observed.output.decode("utf-8", errors="replace")
    if len(text) > max_output_chars:
        text = text[:max_output_chars] + f"\n... ({len(text) - max_output_chars} more characters)"
    status = observed.returncode
    if observed.over_cap:
        outcome = f"error: the code wrote more than {max_output_bytes} bytes of output and was stopped"
    elif observed.timed_out:
        outcome = f"error: the code ran longer than {timeout_s:g} s and was stopped"
    elif status == 0:
        return ToolResult(text)
    elif _signal_name(status):
        outcome = f"error: the code was killed by {_signal_name(status)} (status {status})"
    else:
        outcome = f"error: the code exited with status {status}"
    return ToolResult(f"{text}\n{outcome}" if text and not text.endswith("\n") else text + outcome, is_error=True)


def _pidfd(pid: int) -> int | None:
    """A pidfd of the process just started; None when it has already ended and been reaped."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _signal_name(status: int) -> str | None:
    """The signal that a status means: negative from Python's subprocess, 128 + n from bubblewrap."""
    number = -status if status < 0 else status - 128 if status > 128 else None
    with contextlib.suppress(ValueError, TypeError):
        return signal.Signals(number).name
    return None


async def _ready(fd: int, what: str) -> bool:
    """True once the harness writes its byte to the ready pipe; False when it closes it without (it died)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                os.fdopen(fd, "rb", buffering=0))
    try:
        return await asyncio.wait_for(reader.read(1), STARTUP_TIMEOUT_S) == b"R"
    except TimeoutError:
        raise EnvironmentFailure(f"{what}: not ready within {STARTUP_TIMEOUT_S:g} s") from None
    finally:
        transport.close()


async def _read_bounded(stream, into: bytearray, cap: int, over_cap: asyncio.Event) -> None:
    """Read `stream` to its end, keeping at most `cap` bytes in `into`; past the cap set `over_cap` (the caller then
    kills the writer) and read on, dropping what comes, until the pipe closes."""
    while chunk := await stream.read(CHUNK):
        room = cap - len(into)
        if len(chunk) > room:
            over_cap.set()
        into += chunk[:room]


async def _feed(stdin, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stdin.write(data)
        await stdin.drain()
        stdin.close()


def _tail(output: bytearray, chars: int = 2000) -> str:
    text = output.decode("utf-8", errors="replace").strip()
    return text[-chars:] if text else "(no output)"
