"""`--dry-run`: the whole plan of a launch without a single weight: the same validation as a launch (the layouts
against the world size and the model, Megatron-Core's TransformerConfig checks, the DDMA plan, a --load
checkpoint), the rank map, memory per GPU for trainer and generators, and the DDMA estimate. It checks the
launch, not this machine: Transformer Engine or GPUs need not be here.

Memory per GPU: weights, gradients, optimizer state and activations of the busiest trainer rank, and each generator
rank's weights, with the GPUs that hold them (`config.memory` says how each is estimated and how well).
"""

from __future__ import annotations

import json

from megatron_rl.config.memory import (
    FIT_FRACTION,
    GPUS,
    MicroBatchShape,
    expert_data_parallel_size,
    generator_memory,
    trainer_memory,
)
from megatron_rl.ddma import ROUNDS_IN_FLIGHT, full_experts_baseline, gather_broadcast_baseline, schedule, summarize


def dry_run(args, world_size: int) -> dict:
    """The launch's setup, validated exactly as a real launch validates it (`build_run_setup`), and its report."""
    import copy
    import os

    from megatron_rl.config.setup import build_run_setup
    from megatron_rl.data.tokenizer import build_char_tokenizer

    # No file is needed: the architecture comes from --load-hf's config.json if it is here, else from --model; the
    # tokenizer from --tokenizer if it is here, else the character tokenizer stands in; --prompt-data and --ref-load
    # are checked if they are here, and so are --tool-config and --judge-model.
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
    if args.tool_config and not os.path.isfile(args.tool_config):
        args.tool_config = None
    if args.judge_model and not os.path.isfile(os.path.join(args.judge_model, "config.json")):
        args.judge_model = None
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        args.tokenizer = None
        if args.rollout_function == "multi-turn":  # its tool turns need the tokenizer's own chat template
            args.rollout_function = "single-turn"
    tokenizer = None if args.tokenizer else build_char_tokenizer()
    setup = build_run_setup(args, world_size, tokenizer=tokenizer)
    spec, trainer, generator = setup.spec, setup.trainer, setup.generator
    plan = setup.plan()
    transport, why = expected_transport(args, world_size, trainer.world_size)
    ddma = summarize(plan, transport=transport)
    ddma["transport_why"] = why
    rounds = schedule(plan, args.ddma_bucket_mb * 2**20)
    busiest = max(plan.by_rank, key=lambda r: (plan.bytes_sent(r) + plan.bytes_received(r), -r))
    ddma["rounds_of_busiest_rank"] = len(rounds.rounds(busiest))
    ddma["max_in_flight_bytes"] = rounds.in_flight_bound(busiest)
    ddma["baseline"] = gather_broadcast_baseline(plan)
    if spec.is_moe:
        ddma["full_experts"] = full_experts_baseline(plan)
    gtp, replicas = generator.tensor_parallel_size, generator.num_replicas
    generator_ranks = [[generator.rank(r, 0), generator.rank(r, gtp - 1)] for r in range(replicas)]
    trainer_map = {"ranks": [0, trainer.world_size - 1], "tensor_parallel": trainer.tensor_parallel_size,
                   "pipeline_parallel": trainer.pipeline_parallel_size,
                   "data_parallel": trainer.data_parallel_size,
                   "pipeline_stage_layers": trainer.stage_sizes(spec),
                   "transformer_impl": trainer.transformer_impl, "controller": 0}
    generator_map = {"replicas": replicas, "tensor_parallel": gtp, "fp8": generator.fp8,
                     "ranks": generator_ranks if replicas <= 8 else generator_ranks[:4] + ["..."]
                     + generator_ranks[-2:]}
    if spec.is_moe:
        ep, etp = trainer.expert_model_parallel_size, trainer.expert_tp
        trainer_map.update(expert_parallel=ep, expert_tensor_parallel=etp,
                           expert_data_parallel=expert_data_parallel_size(trainer),
                           experts_per_rank=spec.num_experts // ep,
                           # TP x DP rank (dp, tp) of every stage -> its (EP, ETP) rank, Megatron-Core's order
                           expert_ranks_of_dp0=[list(trainer.expert_ranks(0, t))
                                                for t in range(trainer.tensor_parallel_size)],
                           expert_ranks_repeat_every_dp=trainer.expert_replica_span)
        gep = generator.expert_parallel_size
        generator_map.update(expert_parallel=gep, experts_per_rank=spec.num_experts // gep,
                             expert_tensor_parallel=gtp // gep)
    return {
        "model": spec.name, "parameters": spec.num_parameters(), "world_size": world_size,
        "active_parameters": spec.num_parameters(active=True) if spec.is_moe else spec.num_parameters(),
        "experts": ({"num_experts": spec.num_experts, "router_topk": spec.moe_router_topk,
                     "moe_ffn_hidden_size": spec.moe_ffn_hidden_size} if spec.is_moe else None),
        "rank_map": {
            "trainer": trainer_map,
            "generators": generator_map,
            "reward": f"{args.reward_num_workers} worker processes beside trainer rank 0",
        },
        "memory_per_gpu": {
            "trainer": trainer_memory(spec, trainer, args.bf16, args.use_distributed_optimizer,
                                      reference=args.kl_coef > 0, shape=MicroBatchShape.from_args(args),
                                      grad_bytes=2 if args.bf16 and args.grad_reduce_in_bf16 else 4),
            "generator": generator_memory(spec, gtp, generator.fp8, generator.expert_parallel_size),
        },
        "ddma": ddma,
        "micro_batches": _micro_batches(args),
    } | ({"sglang_memory": _sglang_memory(setup)} if args.rollout_backend == "sglang" and transport != "gloo"
         and not args.rollout_server_urls else {})


def _sglang_memory(setup) -> dict:
    """Replica 0's server memory on an 80 GB GPU (a launch plans with its GPUs' own size)."""
    import dataclasses

    from megatron_rl.rollout import replica_memory

    memory = replica_memory(setup, 0, int(GPUS["A100/H100 80GB"] * 2**30))
    return {**dataclasses.asdict(memory), "describe": memory.describe()}


def expected_transport(args, world_size: int, trainer_world_size: int) -> tuple[str, str]:
    """The DDMA transport the launch would choose (`runtime.roles.choose_transport`, given the devices its ranks
    would get): every rank on a GPU of its own unless --device cpu, except the generator ranks of attached SGLang
    servers (--rollout-server-urls), which stay on the CPU."""
    from megatron_rl.runtime.device import DeviceId
    from megatron_rl.runtime.roles import choose_transport

    def device(rank: int) -> DeviceId:
        on_cpu = args.device == "cpu" or (rank >= trainer_world_size and args.rollout_backend == "sglang"
                                          and args.rollout_server_urls)
        node = f"node{rank // 8}"
        return DeviceId(node, "cpu", "") if on_cpu else DeviceId(node, "cuda", f"GPU-{rank}")

    return choose_transport([device(r) for r in range(world_size)])


def _micro_batches(args) -> dict:
    if not args.use_dynamic_batch_size:
        return {"packed": False, "micro_batch_size": args.micro_batch_size}
    return {"packed": True, "max_tokens_per_gpu": args.max_tokens_per_gpu,
            "log_probs_max_tokens_per_gpu": args.log_probs_max_tokens_per_gpu or args.max_tokens_per_gpu}


def main(args) -> int:
    import os

    world = args.world_size or int(os.environ.get("WORLD_SIZE", "0"))
    if world < 1:
        raise ValueError("--dry-run needs the world size: --world-size N or env WORLD_SIZE")
    report = dry_run(args, world)
    m = report["memory_per_gpu"]
    rm = report["rank_map"]
    t, g = rm["trainer"], rm["generators"]
    moe = report["experts"]
    params = f"{report['parameters'] / 1e9:.2f}B parameters"
    if moe:
        params += (f", {report['active_parameters'] / 1e9:.2f}B active: {moe['router_topk']} of "
                   f"{moe['num_experts']} experts per token")
    print(f"model {report['model']} ({params}), world size {world}")
    experts = ""
    if moe:
        experts = (f" EP={t['expert_parallel']} ETP={t['expert_tensor_parallel']} (expert-DP="
                   f"{t['expert_data_parallel']}, {t['experts_per_rank']} experts per rank; (EP, ETP) rank of TP "
                   f"ranks 0..{t['tensor_parallel'] - 1} at DP 0: {t['expert_ranks_of_dp0']}, repeating every "
                   f"{t['expert_ranks_repeat_every_dp']} DP rank(s))")
    print(f"trainer ranks {t['ranks']}: TP={t['tensor_parallel']} PP={t['pipeline_parallel']} "
          f"DP={t['data_parallel']}{experts}, stage layers {t['pipeline_stage_layers']}; controller on rank 0")
    gexperts = (f" EP={g['expert_parallel']} ({g['experts_per_rank']} experts per rank, each split "
                f"{g['expert_tensor_parallel']} way(s))" if moe else "")
    print(f"generator replicas: {g['replicas']} x TP={g['tensor_parallel']}{gexperts}"
          f"{' FP8' if g['fp8'] else ''}, ranks {g['ranks']}")
    mt = m["trainer"]
    print(f"memory per GPU: trainer {mt['peak_gib']:.1f} GiB at its peak, {mt['total_gib']:.1f} GiB without "
          f"activations (weights {mt['weights_gib']:.1f}, "
          f"grads {mt['grads_gib']:.1f}, optimizer {mt['optimizer_gib']:.1f}"
          + (f", KL reference weights {mt['reference_gib']:.1f}" if args.kl_coef > 0 else "")
          + f"; busiest rank {mt['rank']}: {mt['params'] / 1e9:.2f}B parameters"
          + (f", {mt['expert_params'] / 1e9:.2f}B of them its experts, whose optimizer state is split "
             f"{mt['expert_data_parallel']} ways" if moe else "")
          + f"); generator weights {m['generator']['weights_gib']:.1f} GiB")
    mb = report["micro_batches"]
    print("micro-batches: " + (f"packed, at most {mb['max_tokens_per_gpu']} tokens per GPU (log-prob passes "
                               f"{mb['log_probs_max_tokens_per_gpu']})" if mb["packed"] else
                               f"{mb['micro_batch_size']} rollouts, each padded to its own longest"))
    recompute = args.recompute_granularity or "none"
    print(f"activations: {mt['activations_gib']:.1f} GiB on stage {mt['stage']} ({mt['micro_batches_in_flight']} "
          f"micro-batch(es) of {mt['tokens_per_micro_batch']} tokens in flight, recompute {recompute}, sequence "
          f"parallel {'on' if args.sequence_parallel else 'off'}, logits and log-prob temporaries included); a "
          f"forward-only pass {mt['forward_only_gib']:.1f} GiB")
    fits = ", ".join(mt["fits"]) or "none of " + ", ".join(GPUS)
    print(f"trainer fits (estimate <= {FIT_FRACTION:.0%} of memory): {fits}")
    if "A100/H100 80GB" not in mt["fits"]:
        print("  less memory per GPU: --sequence-parallel, --recompute-granularity full, a smaller "
              "--max-tokens-per-gpu (with --use-dynamic-batch-size) or --micro-batch-size, a larger TP or PP")
    d = report["ddma"]
    print(f"DDMA over {d['transport']} ({d['transport_why']}): {d['num_transfers']} transfers, "
          f"{d['total_bytes'] / 1e9:.1f} GB, busiest GPU sends "
          f"{d['max_send_bytes'] / 1e9:.2f} GB / receives {d['max_recv_bytes'] / 1e9:.2f} GB, estimated "
          f"{d['estimated_seconds']:.2f} s (gather-and-broadcast: {d['baseline']['estimated_seconds']:.2f} s); "
          f"the busiest rank moves {d['rounds_of_busiest_rank']} rounds of at most --ddma-bucket-mb "
          f"{args.ddma_bucket_mb}, {ROUNDS_IN_FLIGHT} in flight: {d['max_in_flight_bytes'] / 2**30:.2f} GiB at once")
    if "sglang_memory" in report:
        print(f"generator GPU (replica 0, an 80 GB GPU): {report['sglang_memory']['describe']}")
    if moe:
        f = d["full_experts"]
        print(f"DDMA experts: a generator GPU receives {f['sharded_recv_bytes'] / 1e9:.2f} GB, its own experts; "
              f"every expert in full would be {f['max_recv_bytes'] / 1e9:.2f} GB ({f['recv_ratio']:.1f}x), "
              f"estimated {f['estimated_seconds']:.2f} s")
    print(json.dumps(report))
    return 0
