#!/usr/bin/env python
"""Plan a DDMA weight sync for real model sizes without allocating weights, and compare it with
gather-to-one-rank-then-broadcast on the same layouts.

    python tools/plan_ddma.py --model llama3-405b --trainer-tp 8 --trainer-pp 16 --trainer-dp 8 \
        --rollout-tp 8 --rollout-replicas 64 --rollout-fp8 --inter-node-gbps 400

Prints one JSON object: total_bytes, max_send_bytes, max_recv_bytes, num_transfers, estimated_seconds and
`baseline` (the same fields for gather-and-broadcast). Time model: each GPU's busiest direction over its
link (full duplex): NVLink between GPUs of one node, the inter-node bandwidth otherwise; generators are
placed after the trainer, so trainer -> generator traffic crosses nodes.
"""

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model name (e.g. llama3-405b) or an HF config.json path")
    p.add_argument("--trainer-tp", type=int, default=1)
    p.add_argument("--trainer-pp", type=int, default=1)
    p.add_argument("--trainer-dp", type=int, default=1)
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--rollout-replicas", type=int, default=1)
    p.add_argument("--rollout-fp8", action="store_true", help="generators serve block-FP8 weights")
    p.add_argument("--trainer-dtype-bytes", type=int, default=2, help="2 for bf16 trainer weights")
    p.add_argument("--inter-node-gbps", type=float, default=400.0, help="per-GPU inter-node bandwidth, Gb/s")
    p.add_argument("--nvlink-gbps", type=float, default=3600.0, help="per-GPU NVLink bandwidth, Gb/s")
    p.add_argument("--gpus-per-node", type=int, default=8)
    args = p.parse_args(argv)

    from megatron_rl.ddma.plan import gather_broadcast_baseline, make_plan, summarize
    from megatron_rl.models.layout import GeneratorLayout, TrainerLayout, balanced_edge_stages
    from megatron_rl.models.spec import ModelSpec, get_model_spec

    try:
        if args.model.endswith(".json"):
            with open(args.model) as f:
                spec = ModelSpec.from_hf_config(json.load(f))
        else:
            spec = get_model_spec(args.model)
        first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
        if first is None and last is None:
            first, last = balanced_edge_stages(spec.num_layers, args.trainer_pp)
        trainer = TrainerLayout(args.trainer_tp, args.trainer_pp, args.trainer_dp,
                                dtype_bytes=args.trainer_dtype_bytes, decoder_first_pipeline_num_layers=first,
                                decoder_last_pipeline_num_layers=last)
        generator = GeneratorLayout(args.rollout_tp, args.rollout_replicas, fp8=args.rollout_fp8,
                                    first_rank=trainer.world_size)
        start = time.perf_counter()
        plan = make_plan(spec, trainer, generator)
        planning = time.perf_counter() - start
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = summarize(plan, args.inter_node_gbps, args.nvlink_gbps, args.gpus_per_node)
    out["baseline"] = gather_broadcast_baseline(plan, args.inter_node_gbps)
    delivered_per_trainer_gpu = out["total_bytes"] / trainer.world_size
    busiest_receiver = max(plan.runtime, key=plan.bytes_received)
    out.update(
        model=spec.name, trainer=trainer.describe(), generator=generator.describe(),
        pipeline_stage_layers=trainer.stage_sizes(spec),
        quantized_on_sender=len(plan.quantized_tensors) > 0,
        busiest_sender_vs_mean=out["max_send_bytes"] / delivered_per_trainer_gpu,
        busiest_receiver_vs_own_shard=out["max_recv_bytes"] / plan.shard_bytes(busiest_receiver),
        speedup_vs_gather_broadcast=out["baseline"]["estimated_seconds"] / max(out["estimated_seconds"], 1e-12),
        planning_seconds=planning,
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
