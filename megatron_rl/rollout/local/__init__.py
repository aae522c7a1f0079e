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


DEFAULT_MAX_RUNNING = 64  # requests the built-in engine decodes together unless --rollout-max-running says


def kv_cache_tokens(args, spec, tp_size: int, dtype: torch.dtype, device: torch.device, fp8: bool,
                    max_slots: int, ep_size: int = 1) -> tuple[int, str]:
    """(the KV pool's size in tokens, how it was chosen) for one generator rank: --rollout-kv-cache-tokens when
    given; on a GPU, what --rollout-mem-fraction-static of its memory leaves after the weights (SGLang's rule:
    free memory - total x (1 - fraction) - weights), at most every slot at full length; on a CPU, every slot at
    full length."""
    full = max_slots * args.seq_length
    if args.rollout_kv_cache_tokens is not None:
        return args.rollout_kv_cache_tokens, "--rollout-kv-cache-tokens"
    if device.type != "cuda":
        return full, f"{max_slots} slots x --seq-length {args.seq_length}"
    per_token = TPDecoder.kv_bytes_per_token(spec, tp_size, dtype)
    free, total = torch.cuda.mem_get_info(device)
    weights = runtime_weight_bytes(spec, tp_size, dtype, fp8, ep_size)
    budget = int(free - total * (1 - args.rollout_mem_fraction_static) - weights) // per_token
    if budget < args.seq_length:
        raise ValueError(f"--rollout-mem-fraction-static {args.rollout_mem_fraction_static} of {device} "
                         f"({total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free) leaves KV cache for {max(budget, 0)} "
                         f"tokens after {weights / 2**30:.1f} GiB of weights, less than one --seq-length "
                         f"{args.seq_length} sequence: raise it, or set --rollout-kv-cache-tokens")
    return min(budget, full), f"--rollout-mem-fraction-static {args.rollout_mem_fraction_static} of {device}"


def runtime_weight_bytes(spec, tp_size: int, dtype: torch.dtype, fp8: bool, ep_size: int = 1) -> int:
    """What one generator rank's weights take: two receive sets of its runtime shards (DDMA fills one while the
    other serves) and, with FP8, the dequantized copies its matmuls use."""
    from megatron_rl.models import weight_map
    from megatron_rl.models.fp8 import is_fp8_weight

    size = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, lay in weight_map.sglang_shards(spec, tp_size, 0, ep_size).items():
        quantized = fp8 and is_fp8_weight(name)
        total += lay.numel * ((2 * 1 + size) if quantized else 2 * size)
    return total


def build_engine(setup: RunSetup, roles: Roles) -> LocalEngine:
    """This generator rank's built-in engine: its TP shard of the decoder, on the rank's device, with a KV pool of
    `kv_cache_tokens`."""
    args = setup.args
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tp, slots = setup.generator.tensor_parallel_size, (args.rollout_max_running or DEFAULT_MAX_RUNNING) + 1
    tokens, why = kv_cache_tokens(args, setup.spec, tp, dtype, torch.device(roles.device), setup.generator.fp8, slots,
                                  setup.generator.expert_parallel_size)
    if roles.is_leader:
        gib = tokens * TPDecoder.kv_bytes_per_token(setup.spec, tp, dtype) / 2**30
        print(f"[megatron-rl] replica {roles.replica}: built-in engine KV cache of {tokens} tokens ({gib:.2f} GiB per "
              f"rank; {why})", flush=True)
    decoder = TPDecoder(setup.spec, tp, roles.rollout_tp_rank, roles.replica_group, dtype=dtype,
                        fp8=setup.generator.fp8, max_slots=slots, max_seq_len=args.seq_length, device=roles.device,
                        ep_size=setup.generator.expert_parallel_size, kv_cache_tokens=tokens)
    return LocalEngine(decoder, eos_token_ids=setup.stop_token_ids, seed=args.seed,
                       chunk_tokens=args.partial_rollout_max_tokens, record_routes=args.use_rollout_routing_replay)
