"""Generator backends by name: the registry behind --rollout-backend, and the engine protocol they implement.

An entry builds this generator rank's engine from the run setup and the rank's role. Every engine has the
request semantics and weight layout of SGLang (`Engine`): the built-in `local` engine (CPU default, tests) and
`sglang`, one real SGLang server per replica.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from megatron_rl.config.setup import RunSetup
from megatron_rl.rollout.types import RolloutOutput, SamplingParams
from megatron_rl.runtime.roles import Roles


class Engine(Protocol):
    """What the generator worker and DDMA need of a rollout engine (see `LocalEngine` for the semantics)."""

    restarts: int  # times its server was restarted after a fault (0 for an in-process engine)
    rerun_requests: int  # requests sent again after such restarts
    # True when the engine is done with a set of tensors it took from load_weights(copy=False) once a later update is
    # installed, so DDMA may receive into that set again; False when they leave the process (shared memory).
    reusable_receive_buffers: bool

    @property
    def paused(self) -> bool: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> str: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[RolloutOutput]: ...

    def pause(self, mode: str) -> list[RolloutOutput]: ...

    def continue_generation(self) -> None: ...

    def begin_weight_update(self) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], copy: bool = True) -> None: ...

    def end_weight_update(self, version: int) -> None: ...

    def abort_weight_update(self) -> None: ...

    def shutdown(self) -> None: ...


def build_local_engine(setup: RunSetup, roles: Roles) -> Engine:
    from megatron_rl.rollout.local.decoder import TPDecoder
    from megatron_rl.rollout.local.engine import LocalEngine

    args = setup.args
    decoder = TPDecoder(setup.spec, setup.generator.tensor_parallel_size, roles.rollout_tp_rank, roles.replica_group,
                        dtype=torch.bfloat16 if args.bf16 else torch.float32, fp8=setup.generator.fp8,
                        max_slots=args.rollout_max_running + 1, max_seq_len=args.seq_length, device=roles.device,
                        ep_size=setup.generator.expert_parallel_size)
    return LocalEngine(decoder, eos_token_ids=setup.stop_token_ids, seed=args.seed,
                       chunk_tokens=args.partial_rollout_max_tokens, record_routes=args.use_rollout_routing_replay)


def build_sglang_engine(setup: RunSetup, roles: Roles) -> Engine:
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
    # flags set here and in SGLangServer.launch: sglang_flags.RUN_CONTROLLED).
    flags = {"max_running_requests": args.rollout_max_running, "context_length": args.seq_length,
             "random_seed": args.seed, **setup.sglang_flags}
    url = args.rollout_server_urls[roles.replica] if args.rollout_server_urls else None
    key = getattr(args, "sglang_api_key", None)  # an arguments.Secret: unwrapped only here, for the server's client
    return start_replica_engine(setup.spec, setup.generator.tensor_parallel_size, roles.replica_group,
                                roles.is_leader, model_dir, os.path.join(directory, "server.log"), url=url,
                                api_key=key.value if key is not None else None,
                                extra_flags=flags, dtype="bfloat16" if args.bf16 else "float32",
                                max_total_tokens=max(args.rollout_max_running * args.seq_length, 8192),
                                timeout_s=args.rollout_server_timeout,
                                stall_timeout_s=args.rollout_server_stall_timeout,
                                max_restarts=args.rollout_server_max_restarts,
                                required_flags=required_server_flags(
                                    setup.spec, setup.generator.expert_parallel_size,
                                    in_place=args.rollout_pause_mode == "in_place",
                                    routing_replay=args.use_rollout_routing_replay),
                                return_routed_experts=args.use_rollout_routing_replay, replica=roles.replica)


ENGINE_BACKENDS: dict[str, Callable[[RunSetup, Roles], Engine]] = {
    "local": build_local_engine,
    "sglang": build_sglang_engine,
}
