"""A rank's helper processes die with it, however it dies: a process that ran `reap_when_gone` is SIGKILLed or
exits, and every process it started (a multiprocessing Manager server as Megatron's checkpoint writer starts one,
a forked child, a subprocess in a session of its own) is gone soon after; a rank that exits keeps its status."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from helpers import ROOT

from megatron_rl.runtime.lifetime import processes_with_env

RANK = """
import json, multiprocessing as mp, os, signal, subprocess, sys
from megatron_rl.runtime.lifetime import reap_when_gone

def forever():
    while True:
        signal.pause()

if __name__ == "__main__":
    reap_when_gone()
    manager = mp.get_context("spawn").Manager()
    forked = os.fork()
    if forked == 0:
        os.closerange(3, 1024)  # it keeps none of the rank's files
        forever()
    session = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], start_new_session=True)
    print(json.dumps([manager._process.pid, forked, session.pid]), flush=True)
    sys.stdin.readline()  # the test checks the children, then lets the rank exit (or kills it)
    # As a rank's teardown does, it closes its files before it is gone; its exit then shuts the Manager down.
    os.closerange(3, 1024)
"""


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


@pytest.mark.parametrize("end", ["killed", "exits"])
def test_every_process_a_rank_started_dies_with_it(tmp_path, end):
    marker = uuid.uuid4().hex
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "LIFETIME_TEST": marker, "PYTHONPATH": ROOT}
    # in a session of its own, as torchrun starts its workers
    rank = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        started = rank.stdout.readline()  # the rank's message: its children's pids
        assert started, f"the rank ended before starting its children (exit code {rank.wait()})"
        children = json.loads(started)
        assert set(children) <= set(processes_with_env("LIFETIME_TEST", marker))  # alive, and found by the marker
        if end == "killed":
            rank.send_signal(signal.SIGKILL)
            assert rank.wait() == -signal.SIGKILL
        else:
            rank.stdin.write("exit\n")
            rank.stdin.flush()
            assert rank.wait() == 0  # its watcher waits for it to be gone, and does not end it early
        _wait_for(lambda: not processes_with_env("LIFETIME_TEST", marker), 30, "the rank's processes to go")
    finally:
        for pid in processes_with_env("LIFETIME_TEST", marker):
            os.kill(pid, signal.SIGKILL)
