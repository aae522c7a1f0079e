"""The main example (examples/run_tiny_aipo.sh) as the studies launch it: where it is, and its environment."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "run_tiny_aipo.sh")
LAUNCH_COMMON = os.path.join(ROOT, "examples", "launch_common.sh")


def child_env(out_dir: str) -> dict:
    """The example's environment for one run: one node, 2 processes, a free port; `python` and torchrun from this
    interpreter, and this checkout's megatron_rl first on the path."""
    from megatron_rl.runtime.spawn import free_port

    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "OUTPUT_DIR": out_dir, "GPUS_PER_NODE": "2", "NNODES": "1", "NODE_RANK": "0",
            "PYTHON": sys.executable,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "COMPARE_SYNC": "0", "OMP_NUM_THREADS": "1",
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": ROOT + (os.pathsep + path if path else "")}
