"""Run a function on N local ranks with a real torch.distributed process group.

Used by the multi-process tests and the benchmarks. Each rank is a fresh `spawn` process that joins a gloo
group (NCCL when `backend="nccl"`) on a free port, runs `fn(*args)`, and sends back its return value. If
any rank raises, every rank is stopped and the caller gets a `RankFailure` carrying that rank's
traceback; a deadline bounds the whole run, and no process outlives the call.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, backend, fn, args, env, results):
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        if backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        value = fn(*args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - any failure is reported to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; return each rank's value, in rank order.

    `fn` must be importable by name (a module-level function), as spawn requires. Each rank has torchrun's
    environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and, unless `backend` is None, a default process group.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, backend, fn, args, env, results), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    try:
        import queue
        import time

        deadline = time.monotonic() + timeout_s
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailure(f"timed out after {timeout_s:.0f} s; ranks that finished: {sorted(values)}")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    codes = {r: procs[r].exitcode for r in dead}
                    raise RankFailure(f"rank(s) {dead} died without reporting (exit codes {codes})") from None
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{payload}")
            values[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=30)
        return [values[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
