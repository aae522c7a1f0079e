"""The built-in rollout engine (the CPU default): SGLang's request semantics and runtime weight layout over a
TP group, in this process (`engine.LocalEngine` over `decoder.TPDecoder`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_rl.rollout.local.decoder import TPDecoder
from megatron_rl.rollout.local.engine import LocalEngine

if TYPE_CHECKING:
    from megatron_rl.config.setup import RunSetup
    from megatron_rl.runtime.roles import Roles


def build_engine(setup: RunSetup, roles: Roles) -> LocalEngine:
    """This generator rank's built-in engine: its TP shard of the decoder, on the rank's device."""
    args = setup.args
    decoder = TPDecoder(setup.spec, setup.generator.tensor_parallel_size, roles.rollout_tp_rank, roles.replica_group,
                        dtype=torch.bfloat16 if args.bf16 else torch.float32, fp8=setup.generator.fp8,
                        max_slots=args.rollout_max_running + 1, max_seq_len=args.seq_length, device=roles.device,
                        ep_size=setup.generator.expert_parallel_size)
    return LocalEngine(decoder, eos_token_ids=setup.stop_token_ids, seed=args.seed,
                       chunk_tokens=args.partial_rollout_max_tokens, record_routes=args.use_rollout_routing_replay)
