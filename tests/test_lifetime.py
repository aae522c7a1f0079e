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

from megatron_rl.lifetime import processes_with_env

RANK = """
import json, multiprocessing as mp, os, subprocess, sys, time
from megatron_rl.lifetime import reap_when_gone

def forever():
    time.sleep(3600)

if __name__ == "__main__":
    reap_when_gone()
    manager = mp.get_context("spawn").Manager()
    forked = os.fork()
    if forked == 0:
        os.closerange(3, 1024)  # it keeps none of the rank's files
        forever()
    session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump([manager._process.pid, forked, session.pid], f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    while not os.path.exists(sys.argv[1] + ".exit"):  # the test checks the children, then lets the rank exit
        time.sleep(0.1)
    os.closerange(3, 1024)  # as a rank's teardown does (torch, gloo), some time before it is gone
    time.sleep(1.0)
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
    script, pids_file = tmp_path / "rank.py", tmp_path / "pids.json"
    script.write_text(RANK)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "LIFETIME_TEST": marker, "PYTHONPATH": root}
    # in a session of its own, as torchrun starts its workers
    rank = subprocess.Popen([sys.executable, str(script), str(pids_file)], env=env, start_new_session=True)
    try:
        _wait_for(pids_file.exists, 120, "the rank to start its children")
        children = json.loads(pids_file.read_text())
        assert set(children) <= set(processes_with_env("LIFETIME_TEST", marker))  # alive, and found by the marker
        if end == "killed":
            rank.send_signal(signal.SIGKILL)
            assert rank.wait() == -signal.SIGKILL
        else:
            (tmp_path / "pids.json.exit").touch()
            assert rank.wait() == 0  # its watcher waits for it to be gone, and does not end it early
        _wait_for(lambda: not processes_with_env("LIFETIME_TEST", marker), 30, "the rank's processes to go")
    finally:
        for pid in processes_with_env("LIFETIME_TEST", marker):
            os.kill(pid, signal.SIGKILL)
