"""`--dry-run`: the whole plan of a launch without a single weight: the same validation as a launch (the layouts
against the world size and the model, Megatron-Core's TransformerConfig checks, the DDMA plan, a --load
checkpoint), the rank map, memory per GPU for trainer and generators, and the DDMA estimate. It checks the
launch, not this machine: Transformer Engine or GPUs need not be here.

Memory per GPU (weights, gradients and optimizer state; activations and the KV cache depend on batch and
sequence and are not included): the trainer rank with the most parameters (exact shards from the layout
mapping, vocabulary padding included) holds its weights (2 bytes in bf16, 4 in fp32), fp32 gradients (4) and
Adam's fp32 main weights and two moments (12 in bf16, 8 in fp32), the latter divided by DP with the
distributed optimizer; with --kl-coef, also the frozen reference model's weights (the same shard, in the same
dtype). A generator TP rank holds its runtime weights: 1 byte per parameter of block-FP8 linear weights (plus
their scales) and 2 bytes for the rest.
"""

from __future__ import annotations

import json
import math

from megatron_rl.ddma.plan import gather_broadcast_baseline, summarize
from megatron_rl.models import layout as L
from megatron_rl.models.fp8 import is_fp8_weight, scale_shape

GIB = 2**30


def trainer_memory(spec, layout: L.TrainerLayout, bf16: bool, distributed_optimizer: bool,
                   reference: bool = False) -> dict:
    params = max(sum(s.numel for s in L.megatron_shards(spec, layout, 0, pp).values())
                 for pp in range(layout.pipeline_parallel_size))
    weights = params * (2 if bf16 else 4)
    grads = params * 4
    optimizer = params * (12 if bf16 else 8) / (layout.data_parallel_size if distributed_optimizer else 1)
    reference_weights = weights if reference else 0
    return {"params": params, "weights_gib": weights / GIB, "grads_gib": grads / GIB,
            "optimizer_gib": optimizer / GIB, "reference_gib": reference_weights / GIB,
            "total_gib": (weights + grads + optimizer + reference_weights) / GIB}


def generator_memory(spec, tp: int, fp8: bool) -> dict:
    shards = L.sglang_shards(spec, tp, 0)
    params = sum(s.numel for s in shards.values())
    quantized = {n: s for n, s in shards.items() if fp8 and is_fp8_weight(n)}
    fp8_params = sum(s.numel for s in quantized.values())
    scales = sum(math.prod(scale_shape(s.shape)) for s in quantized.values())
    total = fp8_params + scales * 4 + (params - fp8_params) * 2
    return {"params": params, "weights_gib": total / GIB}


def dry_run(args, world_size: int) -> dict:
    """The launch's setup, validated exactly as a real launch validates it (`build_run_setup`), and its report."""
    import copy
    import os

    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.run_setup import build_run_setup

    # No file is needed: the architecture comes from --load-hf's config.json if it is here, else from --model; the
    # tokenizer from --tokenizer if it is here, else the character tokenizer stands in; --prompt-data and --ref-load
    # are checked if they are here.
    args = copy.copy(args)
    if args.load_hf and not os.path.isfile(os.path.join(args.load_hf, "config.json")):
        args.load_hf = None
    if args.prompt_data and not os.path.isfile(args.prompt_data):
        args.prompt_data = None
    if args.sft_data and not os.path.isfile(args.sft_data):
        args.sft_data = None
    pairs = args.eval_prompt_data or []
    args.eval_prompt_data = [x for name, path in zip(pairs[::2], pairs[1::2]) if os.path.isfile(path)
                             for x in (name, path)] or None
    if args.ref_load and not os.path.isdir(args.ref_load):
        args.ref_load = None
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        args.tokenizer = None
    tokenizer = None if args.tokenizer else build_char_tokenizer()
    setup = build_run_setup(args, world_size, tokenizer=tokenizer)
    spec, trainer, generator = setup.spec, setup.trainer, setup.generator
    plan = setup.plan()
    ddma = summarize(plan)
    ddma["baseline"] = gather_broadcast_baseline(plan)
    gtp, replicas = generator.tensor_parallel_size, generator.num_replicas
    generator_ranks = [[generator.rank(r, 0), generator.rank(r, gtp - 1)] for r in range(replicas)]
    return {
        "model": spec.name, "parameters": spec.num_parameters(), "world_size": world_size,
        "rank_map": {
            "trainer": {"ranks": [0, trainer.world_size - 1], "tensor_parallel": trainer.tensor_parallel_size,
                        "pipeline_parallel": trainer.pipeline_parallel_size,
                        "data_parallel": trainer.data_parallel_size,
                        "pipeline_stage_layers": trainer.stage_sizes(spec),
                        "transformer_impl": trainer.transformer_impl, "controller": 0},
            "generators": {"replicas": replicas, "tensor_parallel": gtp, "fp8": generator.fp8,
                           "ranks": generator_ranks if replicas <= 8 else generator_ranks[:4] + ["..."]
                           + generator_ranks[-2:]},
            "reward": f"{args.reward_num_workers} worker processes beside trainer rank 0",
        },
        "memory_per_gpu": {
            "trainer": trainer_memory(spec, trainer, args.bf16, args.use_distributed_optimizer,
                                      reference=args.kl_coef > 0),
            "generator": generator_memory(spec, gtp, generator.fp8),
        },
        "ddma": ddma,
    }


def main(args) -> int:
    import os

    world = args.world_size or int(os.environ.get("WORLD_SIZE", "0"))
    if world < 1:
        raise ValueError("--dry-run needs the world size: --world-size N or env WORLD_SIZE")
    report = dry_run(args, world)
    m = report["memory_per_gpu"]
    rm = report["rank_map"]
    print(f"model {report['model']} ({report['parameters'] / 1e9:.2f}B parameters), world size {world}")
    print(f"trainer ranks {rm['trainer']['ranks']}: TP={rm['trainer']['tensor_parallel']} "
          f"PP={rm['trainer']['pipeline_parallel']} DP={rm['trainer']['data_parallel']}, stage layers "
          f"{rm['trainer']['pipeline_stage_layers']}; controller on rank 0")
    print(f"generator replicas: {rm['generators']['replicas']} x TP={rm['generators']['tensor_parallel']}"
          f"{' FP8' if rm['generators']['fp8'] else ''}, ranks {rm['generators']['ranks']}")
    print(f"memory per GPU: trainer {m['trainer']['total_gib']:.1f} GiB (weights {m['trainer']['weights_gib']:.1f}, "
          f"grads {m['trainer']['grads_gib']:.1f}, optimizer {m['trainer']['optimizer_gib']:.1f}"
          + (f", KL reference weights {m['trainer']['reference_gib']:.1f}" if args.kl_coef > 0 else "")
          + f"); generator weights {m['generator']['weights_gib']:.1f} GiB")
    d = report["ddma"]
    print(f"DDMA: {d['num_transfers']} transfers, {d['total_bytes'] / 1e9:.1f} GB, busiest GPU sends "
          f"{d['max_send_bytes'] / 1e9:.2f} GB / receives {d['max_recv_bytes'] / 1e9:.2f} GB, estimated "
          f"{d['estimated_seconds']:.2f} s (gather-and-broadcast: {d['baseline']['estimated_seconds']:.2f} s)")
    print(json.dumps(report))
    return 0
