"""The SGLang servers a run launches, without launching one (no sglang needed): each replica's server on the GPUs
of its own generator ranks (`base_gpu_id` from the leader's torchrun LOCAL_RANK, simulated here as global rank %
GPUs per node for the 8B and 70B layouts), CUDA_VISIBLE_DEVICES and node boundaries checked, the user's
--sglang-base-gpu-id winning, SGLang's CPU flags without CUDA; and the --sglang-<flag>s a run sets itself refused
at run setup by name (typed checks against a real SGLang: tests/sglang/test_sglang_flags.py)."""

import dataclasses
import importlib.util

import pytest

from megatron_rl.config.arguments import parse_args
from megatron_rl.config.setup import build_run_setup, layouts
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.rollout.sglang import build_engine as build_sglang_engine
from megatron_rl.rollout.sglang import engine as sglang_engine
from megatron_rl.rollout.sglang import server_sizing
from megatron_rl.rollout.sglang.server import (
    CPU_FLAGS,
    CPU_KV_CACHE_TOKENS,
    launch_command,
    server_gpu_flags,
    worker_gpu,
)
from megatron_rl.runtime.roles import Roles

GPUS_PER_NODE = 8


def _command(tp, environ, cuda=True, device_count=GPUS_PER_NODE, extra=None, replica=None):
    return launch_command("/models/m", tp, 30000, environ=environ, cuda_available=cuda, device_count=device_count,
                          cpu_count=2, extra_flags=extra, replica=replica)


def _flag_values(argv, flag):
    return [argv[i + 1] for i, word in enumerate(argv) if word == flag]


def _torchrun_env(global_rank, **extra):
    """What torchrun gives a worker on nodes of GPUS_PER_NODE processes (ranks fill nodes in order)."""
    return {"RANK": str(global_rank), "LOCAL_RANK": str(global_rank % GPUS_PER_NODE),
            "LOCAL_WORLD_SIZE": str(GPUS_PER_NODE), "PATH": "/usr/bin", **extra}


def _placements(config_flags, world):
    """(node, base_gpu_id) of every replica's server for a launch of `world` ranks with these flags."""
    _, generator = layouts(parse_args(config_flags), world)
    out = []
    for replica in range(generator.num_replicas):
        leader = generator.rank(replica, 0)
        argv, _ = _command(generator.tensor_parallel_size, _torchrun_env(leader), replica=replica)
        out.append((leader // GPUS_PER_NODE, int(*_flag_values(argv, "--base-gpu-id"))))
    return out


def test_8b_config_puts_eight_tp1_servers_on_gpus_0_to_7_of_the_generator_node():
    # Trainer TP=2 x DP=4 fills node 0; the 8 generator replicas fill node 1.
    assert _placements(["--config", "llama3-8b", "--rollout-num-replicas", "8"], 16) == [(1, g) for g in range(8)]


def test_70b_config_puts_two_tp4_servers_per_node_at_gpus_0_and_4_on_every_generator_node():
    # Trainer TP=8 x PP=4 fills nodes 0-3; 4 replicas of TP=4 take nodes 4 and 5, LOCAL_RANK restarting at 0.
    assert _placements(["--config", "llama3-70b", "--rollout-num-replicas", "4"], 48) == [(4, 0), (4, 4), (5, 0),
                                                                                           (5, 4)]


def test_trainer_on_the_first_gpus_of_a_node_shifts_the_generators_gpus():
    tiny = ["--model", "tiny-llama", "--tensor-model-parallel-size", "2"]
    assert _placements([*tiny, "--rollout-num-replicas", "4"], 8) == [(0, 4), (0, 5), (0, 6), (0, 7)]
    assert _placements([*tiny, "--rollout-tensor-parallel-size", "2", "--rollout-num-replicas", "3"], 8) == [
        (0, 2), (0, 4), (0, 6)]


def test_server_gets_the_gpus_its_ranks_have_and_no_launcher_variables():
    argv, env = _command(4, _torchrun_env(12, CUDA_VISIBLE_DEVICES="7,6,5,4,3,2,1,0"))
    assert _flag_values(argv, "--base-gpu-id") == ["4"] and _flag_values(argv, "--tp-size") == ["4"]
    assert "--device" not in argv and "SGLANG_USE_CPU_ENGINE" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "7,6,5,4,3,2,1,0"  # SGLang indexes the visible devices itself
    assert "LOCAL_RANK" not in env and "RANK" not in env and env["PATH"] == "/usr/bin"


def test_too_short_cuda_visible_devices_is_refused_naming_the_variables_and_the_replica():
    with pytest.raises(ValueError, match=r"generator replica 3: CUDA_VISIBLE_DEVICES='0,1,2,3' lists 4 GPU\(s\).*"
                                         r"LOCAL_RANK=4.*up to index 4"):
        _command(1, _torchrun_env(12, CUDA_VISIBLE_DEVICES="0,1,2,3"), replica=3)
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='0,1,2,3,4,5' lists 6 .*up to index 7"):
        _command(4, _torchrun_env(4, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5"))
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='' lists 0"):
        _command(1, _torchrun_env(0, CUDA_VISIBLE_DEVICES=""))


def test_too_few_gpus_and_replicas_across_nodes_are_refused():
    with pytest.raises(ValueError, match=r"this node has 4 GPU\(s\).*LOCAL_RANK=4"):
        _command(1, _torchrun_env(4), device_count=4)
    # 6 trainer ranks then TP=4: replica 0's ranks are 6, 7 on node 0 and 8, 9 on node 1.
    with pytest.raises(ValueError, match=r"generator replica 0 straddles two nodes: its leader has LOCAL_RANK=6 of "
                                         r"LOCAL_WORLD_SIZE=8"):
        _command(4, _torchrun_env(6), replica=0)


def test_gpu_id_step_counts_in_the_visible_device_check():
    assert server_gpu_flags(0, 2, "0,1,2", True, gpu_id_step=2) == {"base_gpu_id": 0}  # GPUs 0 and 2
    with pytest.raises(ValueError, match=r"gpu_id_step 2\) needs visible GPUs up to index 2"):
        server_gpu_flags(0, 2, "0,1", True, gpu_id_step=2)


def test_user_base_gpu_id_overrides_the_placement_and_its_checks():
    argv, _ = _command(1, _torchrun_env(5, CUDA_VISIBLE_DEVICES="3"), extra={"base_gpu_id": 0})
    assert _flag_values(argv, "--base-gpu-id") == ["0"]


def test_without_cuda_the_server_gets_sglangs_cpu_flags_and_no_gpu_id():
    argv, env = _command(2, _torchrun_env(3, CUDA_VISIBLE_DEVICES=""), cuda=False, device_count=None)
    assert "--base-gpu-id" not in argv and server_gpu_flags(3, 2, None, False) == {}
    assert _flag_values(argv, "--device") == [CPU_FLAGS["device"]] and "--disable-cuda-graph" in argv
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"


def test_server_flags_are_appended_as_sglang_parses_them():
    argv, _ = _command(1, _torchrun_env(0), extra={"mem_fraction_static": 0.7, "enable_torch_compile": True,
                                                   "disable_radix_cache": False, "cuda_graph_bs_decode": [1, 2, 4]})
    tail = argv[argv.index("--base-gpu-id"):]
    assert tail == ["--base-gpu-id", "0", "--mem-fraction-static", "0.7", "--enable-torch-compile",
                    "--cuda-graph-bs-decode", "1", "2", "4"]


# ---- --sglang-<flag> at run setup ------------------------------------------------------------------------------------

def _setup(world, *flags):
    args = parse_args(["--model", "tiny-llama", "--rollout-backend", "sglang", *flags])
    return build_run_setup(args, world, tokenizer=build_char_tokenizer())


@pytest.mark.parametrize("flags,pattern", [
    (["--sglang-tp-size", "2"], r"--sglang-tp-size \(--rollout-tensor-parallel-size sets it\)"),
    (["--sglang-tensor-parallel-size", "2"], r"--sglang-tensor-parallel-size \(--rollout-tensor-parallel-size"),
    (["--sglang-dtype", "float16"], r"--sglang-dtype \(--bf16 sets it"),
    (["--sglang-random-seed", "1"], r"--sglang-random-seed \(--seed sets it\)"),
    (["--sglang-context-length", "4096"], r"--sglang-context-length \(--seq-length sets it\)"),
    (["--sglang-max-running-requests", "8"], r"--sglang-max-running-requests \(--rollout-max-running sets it\)"),
    (["--sglang-dp-size", "2"], r"--sglang-dp-size \(one engine per replica .*--rollout-num-replicas\)"),
    (["--sglang-port", "30000", "--sglang-model-path", "/m"], r"--sglang-port \(the run picks .*; "
                                                              r"--sglang-model-path \(the run serves"),
    (["--sglang-host", "0.0.0.0"], r"--sglang-host \(the run picks the address of each server it launches"),
    (["--sglang-skip-tokenizer-init"], r"--sglang-skip-tokenizer-init \(always on"),
    (["--sglang-load-format", "auto"], r"--sglang-load-format \(servers start on random weights"),
    (["--sglang-weight-version", "3"], r"--sglang-weight-version \(the run numbers the weight versions"),
])
def test_server_flags_the_run_sets_are_refused_at_setup_naming_the_run_flag(flags, pattern):
    with pytest.raises(ValueError, match=pattern + r".*the run sets this SGLang server argument itself"):
        _setup(2, *flags)


def test_dry_run_refuses_them_too_and_other_flags_reach_the_setup():
    from megatron_rl.config.dry_run import dry_run

    with pytest.raises(ValueError, match=r"--sglang-tp-size \(--rollout-tensor-parallel-size sets it\)"):
        dry_run(parse_args(["--model", "tiny-llama", "--rollout-backend", "sglang", "--sglang-tp-size", "2"]), 2)
    if importlib.util.find_spec("sglang") is None:  # unchecked without SGLang: passed on as given
        assert _setup(2, "--sglang-mem-fraction-static", "0.7").sglang_flags == {"mem_fraction_static": "0.7"}


def test_server_flags_with_server_urls_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rollout-backend", "sglang", "--rollout-server-urls", "http://a:1",
                    "--sglang-mem-fraction-static", "0.7"])
    assert "--sglang-mem-fraction-static: server flags go to the servers a run launches" in capsys.readouterr().err


def test_build_sglang_engine_passes_the_replica_and_the_checked_flags(tmp_path, monkeypatch):
    setup = _setup(3, "--rollout-num-replicas", "2", "--output-dir", str(tmp_path), "--sglang-mem-fraction-static",
                   "0.7", "--sglang-api-key", "sk-1")
    setup = dataclasses.replace(setup, sglang_flags={"mem_fraction_static": 0.7})  # as SGLang's parser types it
    calls = []
    monkeypatch.setattr(sglang_engine, "start_replica_engine", lambda *a, **kw: calls.append((a, kw)))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else
                        find_spec(name, *a))
    build_sglang_engine(setup, Roles(rank=2, world_size=3, trainer_world_size=1, rollout_tp=1, rollout_replicas=2,
                                     sync_group=None))
    (args, kwargs), = calls
    assert kwargs["replica"] == 1 and args[4].endswith("replica1/model") and kwargs["api_key"] == "sk-1"
    assert kwargs["extra_flags"] == {"context_length": 64, "random_seed": 1234, "mem_fraction_static": 0.7}


def test_a_generator_rank_computes_on_its_sglang_workers_gpu():
    # the replica's leader has LOCAL_RANK 4: its TP rank 1 runs on GPU 5, unless the base GPU or step is overridden
    assert worker_gpu(5, 1, {}) == 5
    assert worker_gpu(5, 1, {"base_gpu_id": 2, "gpu_id_step": 2}) == 4


def test_launched_servers_size_themselves_from_gpu_memory_unless_told():
    assert server_sizing(None, None) == {}  # SGLang's own sizing (--mem-fraction-static)
    assert server_sizing(128, 400_000) == {"max_running_requests": 128, "max_total_tokens": 400_000}
    argv, _ = launch_command("/m", 1, 30000, environ={}, cuda_available=True, device_count=1)
    assert "--max-total-tokens" not in argv and "--max-running-requests" not in argv
    # on CPUs SGLang would size the cache from the whole machine's memory
    argv, _ = launch_command("/m", 1, 30000, environ={}, cuda_available=False)
    assert argv[argv.index("--max-total-tokens") + 1] == str(CPU_KV_CACHE_TOKENS)
