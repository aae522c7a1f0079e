#!/usr/bin/env python
"""Plan a DDMA weight sync for real model sizes without allocating weights, and compare it with
gather-to-one-rank-then-broadcast on the same layouts.

    python tools/plan_ddma.py --model llama3-405b --trainer-tp 8 --trainer-pp 16 --trainer-dp 8 \
        --rollout-tp 8 --rollout-replicas 64 --rollout-fp8 --inter-node-gbps 400
    python tools/plan_ddma.py --model qwen3-235b-a22b --trainer-tp 4 --trainer-pp 8 --trainer-dp 8 \
        --trainer-ep 16 --trainer-etp 1 --rollout-tp 8 --rollout-ep 8 --rollout-replicas 8 --rollout-fp8 --report

Prints one JSON object (with --report, readable lines before it): total_bytes, max_send_bytes, max_recv_bytes,
num_transfers, estimated_seconds, the busiest sender and receiver, and `baseline` (the same fields for
gather-and-broadcast). For a mixture of experts also `experts`: `full` is every generator rank receiving every
expert whole (what the expert-sharded plan is compared with), and `without_rollout_ep` the bytes a generator rank
receives when the generators split each expert over TP instead of holding whole experts (SGLang without --ep-size;
expert rows that do not fall on FP8's 128-row blocks then travel in the trainer's dtype).

Time model: each GPU's busiest direction over its link (full duplex): NVLink between GPUs of one node, the
inter-node bandwidth otherwise; generators are placed after the trainer, so trainer -> generator traffic crosses
nodes. These are estimates from byte counts and assumed link speeds, not measurements.
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
    p.add_argument("--trainer-ep", type=int, default=1,
                   help="the trainer's expert parallelism (Megatron's --expert-model-parallel-size)")
    p.add_argument("--trainer-etp", type=int, default=None,
                   help="tensor parallelism inside each expert (Megatron's --expert-tensor-parallel-size; default: "
                        "--trainer-tp)")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    p.add_argument("--rollout-tp", type=int, default=1)
    p.add_argument("--rollout-ep", type=int, default=1,
                   help="the generators' expert parallelism (SGLang's --ep-size, --rollout-expert-parallel-size)")
    p.add_argument("--rollout-replicas", type=int, default=1)
    p.add_argument("--rollout-fp8", action="store_true", help="generators serve block-FP8 weights")
    p.add_argument("--trainer-dtype-bytes", type=int, default=2, help="2 for bf16 trainer weights")
    p.add_argument("--inter-node-gbps", type=float, default=400.0, help="per-GPU inter-node bandwidth, Gb/s")
    p.add_argument("--nvlink-gbps", type=float, default=3600.0, help="per-GPU NVLink bandwidth, Gb/s")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--report", action="store_true", help="readable lines before the JSON")
    args = p.parse_args(argv)

    import dataclasses

    from megatron_rl.ddma.plan import full_experts_baseline, gather_broadcast_baseline, make_plan, summarize
    from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout, balanced_edge_stages
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
                                decoder_last_pipeline_num_layers=last, expert_model_parallel_size=args.trainer_ep,
                                expert_tensor_parallel_size=args.trainer_etp)
        generator = GeneratorLayout(args.rollout_tp, args.rollout_replicas, fp8=args.rollout_fp8,
                                    first_rank=trainer.world_size, expert_parallel_size=args.rollout_ep)
        start = time.perf_counter()
        plan = make_plan(spec, trainer, generator)
        planning = time.perf_counter() - start
        without_ep = None
        if spec.is_moe and args.rollout_ep > 1:
            # One replica is enough: what a generator rank receives does not depend on how many replicas there are.
            without_ep = make_plan(spec, trainer, dataclasses.replace(generator, num_replicas=1,
                                                                      expert_parallel_size=1))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = summarize(plan, args.inter_node_gbps, args.nvlink_gbps, args.gpus_per_node)
    out["baseline"] = gather_broadcast_baseline(plan, args.inter_node_gbps)
    delivered_per_trainer_gpu = out["total_bytes"] / trainer.world_size
    busiest_receiver = max(plan.runtime, key=plan.bytes_received)
    busiest_sender = max(range(trainer.world_size), key=plan.bytes_sent)
    out.update(
        model=spec.name, parameters=spec.num_parameters(), trainer=trainer.describe(), generator=generator.describe(),
        busiest_sender=busiest_sender, busiest_receiver=busiest_receiver,
        pipeline_stage_layers=trainer.stage_sizes(spec),
        quantized_on_sender=len(plan.quantized_tensors) > 0,
        busiest_sender_vs_mean=out["max_send_bytes"] / delivered_per_trainer_gpu,
        busiest_receiver_vs_own_shard=out["max_recv_bytes"] / plan.shard_bytes(busiest_receiver),
        speedup_vs_gather_broadcast=out["baseline"]["estimated_seconds"] / max(out["estimated_seconds"], 1e-12),
        planning_seconds=planning,
    )
    if spec.is_moe:
        full = full_experts_baseline(plan, args.inter_node_gbps)
        experts = {"full": full, "full_vs_sharded_seconds": full["estimated_seconds"] / out["estimated_seconds"]}
        if without_ep is not None:
            rank = max(without_ep.runtime, key=without_ep.bytes_received)
            expert_names = [n for n in without_ep.runtime[rank] if ".experts." in n]
            experts["without_rollout_ep"] = {
                "generator": dataclasses.replace(generator, expert_parallel_size=1).describe(),
                "max_recv_bytes": without_ep.bytes_received(rank),
                "expert_tensors_sent_fp8": sum(n in without_ep.quantized_tensors for n in expert_names),
                "expert_tensors": len(expert_names),
                "recv_ratio": without_ep.bytes_received(rank) / out["max_recv_bytes"],
            }
        out["experts"] = experts
    if args.report:
        print(report(out, args))
    print(json.dumps(out))
    return 0


def report(out: dict, args) -> str:
    gb = 1e9
    b = out["baseline"]
    lines = [
        f"{out['model']} ({out['parameters'] / gb:.1f}B parameters): {out['trainer']} -> {out['generator']}, "
        f"{args.inter_node_gbps:g} Gb/s per GPU across nodes, {args.nvlink_gbps:g} Gb/s NVLink (assumed speeds: "
        f"an estimate from byte counts, not a measurement)",
        f"DDMA: {out['num_transfers']} transfers, {out['total_bytes'] / gb:.1f} GB in all; busiest sender rank "
        f"{out['busiest_sender']} {out['max_send_bytes'] / gb:.2f} GB ({out['busiest_sender_vs_mean']:.2f}x the mean), "
        f"busiest receiver rank {out['busiest_receiver']} {out['max_recv_bytes'] / gb:.2f} GB "
        f"({out['busiest_receiver_vs_own_shard']:.4f}x its own shard); estimated {out['estimated_seconds']:.2f} s",
        f"gather-and-broadcast: {b['total_bytes'] / gb:.1f} GB, estimated {b['estimated_seconds']:.2f} s "
        f"({out['speedup_vs_gather_broadcast']:.1f}x DDMA's)",
    ]
    if "experts" in out:
        f = out["experts"]["full"]
        lines.append(
            f"experts: generator rank {f['generator_rank']} receives {f['sharded_recv_bytes'] / gb:.2f} GB "
            f"({f['sharded_expert_recv_bytes'] / gb:.2f} GB of experts); every expert whole would be "
            f"{f['max_recv_bytes'] / gb:.2f} GB ({f['full_expert_bytes'] / gb:.2f} GB of experts: "
            f"{f['expert_recv_ratio']:.2f}x the expert bytes, {f['recv_ratio']:.2f}x in all), estimated "
            f"{f['estimated_seconds']:.2f} s ({out['experts']['full_vs_sharded_seconds']:.1f}x the sharded plan's)")
        w = out["experts"].get("without_rollout_ep")
        if w:
            lines.append(
                f"without rollout EP ({w['generator']}): a generator rank receives {w['max_recv_bytes'] / gb:.2f} GB "
                f"({w['recv_ratio']:.2f}x), {w['expert_tensors_sent_fp8']} of its {w['expert_tensors']} expert "
                f"tensors sent as FP8")
    lines.append(f"planning took {out['planning_seconds']:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
