"""SGLang generators: the HTTP server per replica (`server`: launch, attach, restart), the engine adapter that
drives it (`engine`), the checks of the `--sglang-<flag>` server flags (`flags`) and the SGLang command line
(`arguments`)."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_rl.config.setup import RunSetup
    from megatron_rl.models.spec import ModelSpec
    from megatron_rl.rollout.sglang.engine import SGLangEngine
    from megatron_rl.runtime.roles import Roles


def build_engine(setup: RunSetup, roles: Roles) -> SGLangEngine:
    """The replica's leader launches its SGLang server on a config-only model directory (random start-up
    weights, never served: the first DDMA publish brings the policy) on the GPUs of the replica's ranks, or
    attaches to --rollout-server-urls."""
    args = setup.args
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("--rollout-backend sglang: the sglang package is not installed in this environment "
                           "(on CPU: bash tools/sglang_cpu/setup_env.sh, then run with .venv-sglang/bin/python)")
    if setup.generator.fp8 and not torch.cuda.is_available():
        raise RuntimeError("--rollout-fp8 with --rollout-backend sglang needs a GPU (SGLang's FP8 layers "
                           "assert CUDA or AMX); use --rollout-backend local on CPU")
    from megatron_rl.rollout.sglang.engine import required_server_flags, start_replica_engine
    from megatron_rl.rollout.sglang.server import write_model_dir

    directory = os.path.join(args.output_dir, "sglang", f"replica{roles.replica}")
    model_dir = write_model_dir(setup.spec, os.path.join(directory, "model"), setup.tokenizer.eos_token_id,
                                fp8=setup.generator.fp8) if roles.is_leader else None
    # The run's own server settings; --sglang-<flag> adds the rest (checked by the run setup, which refuses the
    # flags set here and in SGLangServer.launch: sglang.flags.RUN_CONTROLLED).
    flags = {"context_length": args.seq_length, "random_seed": args.seed,
             **server_sizing(args.rollout_max_running, args.rollout_kv_cache_tokens),
             **setup.sglang_flags}
    url = args.rollout_server_urls[roles.replica] if args.rollout_server_urls else None
    on_gpu = torch.device(roles.device).type == "cuda"
    if on_gpu and url is None:
        memory = replica_memory(setup, roles.replica, torch.cuda.get_device_properties(roles.device).total_memory)
        flags["mem_fraction_static"] = memory.fraction
        if roles.is_leader:
            print(f"[megatron-rl] replica {roles.replica}: {memory.describe()}", flush=True)
    key = getattr(args, "sglang_api_key", None)  # an arguments.Secret: unwrapped only here, for the server's client
    return start_replica_engine(setup.spec, setup.generator.tensor_parallel_size, roles.replica_group,
                                roles.is_leader, model_dir, os.path.join(directory, "server.log"), url=url,
                                api_key=key.value if key is not None else None,
                                extra_flags=flags, dtype="bfloat16" if args.bf16 else "float32",
                                timeout_s=args.rollout_server_timeout,
                                stall_timeout_s=args.rollout_server_stall_timeout,
                                max_restarts=args.rollout_server_max_restarts,
                                required_flags=required_server_flags(
                                    setup.spec, setup.generator.expert_parallel_size,
                                    in_place=args.rollout_pause_mode == "in_place",
                                    routing_replay=args.use_rollout_routing_replay),
                                return_routed_experts=args.use_rollout_routing_replay, replica=roles.replica,
                                install_in_buckets=on_gpu,
                                expert_parallel_size=setup.generator.expert_parallel_size)


def replica_memory(setup: RunSetup, replica: int, gpu_bytes: int):
    """The memory plan (`memory.ServerMemory`) of a launched replica's GPUs, of `gpu_bytes` each: the
    --mem-fraction-static its server gets, leaving room for its generator ranks' DDMA buffers."""
    from megatron_rl.ddma.sync import schedule
    from megatron_rl.rollout.sglang.memory import server_memory

    plan, layout = setup.plan(), setup.generator
    ranks = [layout.rank(replica, j) for j in range(layout.tensor_parallel_size)]
    return server_memory(plan, schedule(plan, setup.args.ddma_bucket_mb * 2**20), ranks, gpu_bytes, True,
                         setup.sglang_flags)


def server_sizing(max_running: int | None, kv_cache_tokens: int | None) -> dict:
    """How many requests and KV tokens a launched server takes: what --rollout-max-running and
    --rollout-kv-cache-tokens say; unset, SGLang sizes both from its GPUs' memory (--sglang-mem-fraction-static),
    and on CPUs `server.launch_command` gives it CPU_KV_CACHE_TOKENS."""
    flags = {}
    if max_running is not None:
        flags["max_running_requests"] = max_running
    if kv_cache_tokens is not None:
        flags["max_total_tokens"] = kv_cache_tokens
    return flags


def check_setup(args, spec: ModelSpec) -> dict:
    """What the run setup checks for SGLang before any work: that SGLang can serve the model at all (a sliding
    window it cannot), and the `--sglang-<flag>` server flags (`flags.check_server_flags`). Returns those flags,
    typed: what each launched server gets on top of the run's own server arguments."""
    from megatron_rl.rollout.sglang.flags import check_server_flags
    from megatron_rl.rollout.sglang.server import served_model_problems

    problems = served_model_problems(spec, {})  # what no SGLang server argument can fix (a sliding window)
    if problems:
        raise ValueError(f"--rollout-backend sglang cannot serve model {spec.name!r}: {'; '.join(problems)}")
    return check_server_flags(args.sglang) if getattr(args, "sglang", None) else {}
