"""The launch scripts' multi-node settings, run as bash with the variables a scheduler or a user sets:
Slurm's variables -> NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT (examples/slurm_env.sh); the checks and the
rendezvous timeout of examples/launch_common.sh. (The launch itself across two nodes: tests/multinode/.)"""

import os
import subprocess

import pytest
from helpers import ROOT

SLURM_KEYS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NODEID",
              "SLURM_PROCID", "SLURM_JOB_ID", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _bash(script, env):
    clean = {k: v for k, v in os.environ.items() if k not in SLURM_KEYS}
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)


def _slurm(env, path=None):
    if path is not None:
        env = {**env, "PATH": path}
    r = _bash('source examples/slurm_env.sh && slurm_launch_env && echo "$NNODES $NODE_RANK $MASTER_ADDR $MASTER_PORT"',
              env)
    return r.returncode, r.stdout.strip(), r.stderr


@pytest.mark.parametrize("nodelist,first", [
    ("gpu[007-012,020],cpu3", "gpu007"),
    ("rack[2-3]-n[01-04]", "rack2-n01"),
    ("a1,a2", "a1"),
    ("node17", "node17"),
])
def test_slurm_job_gives_torchrun_its_node_settings(nodelist, first, tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH without scontrol: the node list is expanded by the script itself
    bin_dir.mkdir()
    for tool in ("bash", "head"):
        (bin_dir / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    env = {"SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": "192", "SLURM_NODEID": "5", "SLURM_JOB_ID": "4242"}
    code, out, err = _slurm(env, path=str(bin_dir))
    assert code == 0, err
    assert out == f"192 5 {first} {10000 + 4242 % 50000}"


def test_slurm_uses_scontrol_where_it_exists_and_keeps_given_values(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # Slurm's own expansion, as a script printing what scontrol would
    scontrol.write_text('#!/bin/bash\n[[ "$1 $2" == "show hostnames" ]] && printf "big-host-1\\nbig-host-2\\n"\n')
    scontrol.chmod(0o755)
    env = {"SLURM_NODELIST": "big-host-[1-2]", "SLURM_NNODES": "2", "SLURM_PROCID": "1",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    assert _slurm(env)[:2] == (0, f"2 1 big-host-1 {10000}")
    assert _slurm({**env, "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "7000"})[:2] == (0, "2 1 10.0.0.9 7000")


@pytest.mark.parametrize("env,message", [
    ({}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "n1"}, "neither SLURM_JOB_NUM_NODES nor SLURM_NNODES is set"),
    ({"SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}, "neither SLURM_NODEID nor SLURM_PROCID is set"),
])
def test_slurm_outside_a_job_names_what_is_missing(env, message):
    code, _, err = _slurm(env)
    assert code == 2 and message in err


@pytest.mark.parametrize("env,message", [
    ({"NNODES": "2", "NODE_RANK": "0", "GPUS_PER_NODE": "8", "MASTER_PORT": "6000"}, "MASTER_ADDR must be node 0"),
    ({"NNODES": "2", "NODE_RANK": "2", "GPUS_PER_NODE": "8", "MASTER_PORT": "6000", "MASTER_ADDR": "h"},
     "NODE_RANK must be in [0, NNODES): got NODE_RANK=2, NNODES=2"),
    ({"NNODES": "2", "NODE_RANK": "x", "GPUS_PER_NODE": "8", "MASTER_PORT": "6000"},
     "NODE_RANK must be a whole number, got 'x'"),
    ({"NNODES": "2", "GPUS_PER_NODE": "8", "MASTER_PORT": "6000"}, "NODE_RANK is not set"),
])
def test_a_launch_across_nodes_refuses_incomplete_settings(env, message):
    r = _bash("source examples/launch_common.sh && launch --model tiny-arith", env)
    assert r.returncode == 2 and message in r.stderr


@pytest.mark.parametrize("flags,seconds", [
    ("", 30 * 30),
    ("--lr 1 --distributed-timeout-minutes 4", 4 * 30),
    ("--distributed-timeout-minutes=2 --distributed-timeout-minutes 6", 6 * 30),
])
def test_rendezvous_waits_half_the_distributed_timeout_per_attempt(flags, seconds):
    r = _bash(f"source examples/launch_common.sh && rendezvous_timeout_s {flags}", {})
    assert r.returncode == 0 and r.stdout.strip() == str(seconds)
    r = _bash("source examples/launch_common.sh && rendezvous_timeout_s --distributed-timeout-minutes 0", {})
    assert r.returncode == 2 and "--distributed-timeout-minutes must be a whole number of minutes >= 1" in r.stderr


def test_the_socket_interface_is_the_one_that_reaches_master_addr():
    r = _bash("source examples/launch_common.sh && interface_to 127.0.0.1 && interface_to no-such-host.invalid", {})
    has_ip = subprocess.run(["bash", "-c", "command -v ip"], capture_output=True).returncode == 0
    assert r.returncode == 0 and r.stdout.split() == (["lo"] if has_ip else [])
