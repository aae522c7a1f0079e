"""DDMA vs gather-and-broadcast weight sync, measured on real processes (gloo) in the same run.

Trainer TP=n/2 ranks hold their Megatron shards of a bf16 model of a few hundred MB; n/2 generator ranks
(one engine at TP=n/2) receive. Gather-and-broadcast: every trainer rank sends its shards to trainer rank
0, which rebuilds the full HF tensors and broadcasts each to all generator ranks, which slice their shards
(the common design DDMA replaces). DDMA: `ddma.sync.publish`. Raw send: every (trainer, generator) pair of the
DDMA plan moves the same number of bytes as one message per pair, all pairs at once, from and into buffers
allocated beforehand: the link's own speed for the same traffic, no layout, no engine. Reported: wall time to the
new version installed everywhere, the bytes of the busiest rank, and DDMA's share of the raw send's speed
(`ddma_vs_raw_send` = raw seconds / DDMA seconds; 1.0 would be DDMA at the link's speed).
"""

from __future__ import annotations

import time

import torch


def _spec(quick: bool):
    from megatron_rl.models.spec import get_model_spec

    return get_model_spec("tiny-llama").replace(
        name="bench-ddma", hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8, num_key_value_heads=8,
        num_layers=4 if quick else 8, vocab_size=32000)


def _rank_main(quick: bool, repeats: int):
    import torch.distributed as dist

    from megatron_rl.ddma.plan import make_plan
    from megatron_rl.ddma.sync import publish
    from megatron_rl.ddma.transport import TorchDistTransport
    from megatron_rl.models import weight_map
    from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
    from megatron_rl.rollout.local.decoder import TPDecoder
    from megatron_rl.rollout.local.engine import LocalEngine
    from megatron_rl.trainer.weights import merge_to_hf

    spec = _spec(quick)
    world, rank = dist.get_world_size(), dist.get_rank()
    half = world // 2
    trainer = TrainerLayout(half, 1, 1, dtype_bytes=2)
    generator = GeneratorLayout(half, 1, first_rank=half)
    plan = make_plan(spec, trainer, generator)
    g = torch.Generator().manual_seed(rank)
    tensors = {}
    if rank < half:  # random bf16 shards (content does not matter for timing; shapes do)
        for name, shard in weight_map.megatron_shards(spec, trainer, rank, 0).items():
            tensors[name] = torch.randn(shard.shape, generator=g).to(torch.bfloat16)
    engine = LocalEngine(TPDecoder(spec, half, rank - half, None, dtype=torch.bfloat16, max_slots=2, max_seq_len=8)) \
        if rank >= half else None
    bcast_group = dist.new_group([0] + list(range(half, world)))
    hf_shapes = weight_map.hf_shapes(spec)

    def ddma(version):
        transport = TorchDistTransport()
        publish(plan, rank, version, trainer_tensors=tensors or None, engine=engine, transport=transport,
                dtype=torch.bfloat16)
        return transport.bytes_sent, transport.bytes_received

    def gather_broadcast(version):
        sent = received = 0
        full = {}
        if rank < half:  # gather every shard on trainer rank 0
            names = sorted(tensors)
            if rank == 0:
                shards = {(0, 0): tensors}
                for src in range(1, half):
                    shards[(src, 0)] = {}
                    for n in names:
                        buf = torch.empty_like(tensors[n])
                        dist.recv(buf, src)
                        received += buf.numel() * 2
                        shards[(src, 0)][n] = buf
                full = merge_to_hf(spec, trainer, shards)
            else:
                for n in names:
                    dist.send(tensors[n].contiguous(), 0)
                    sent += tensors[n].numel() * 2
        if rank == 0 or rank >= half:  # broadcast every full tensor to the generators
            for n, shape in hf_shapes.items():
                buf = full[n] if rank == 0 else torch.empty(shape, dtype=torch.bfloat16)
                dist.broadcast(buf, 0, group=bcast_group)
                if rank == 0:
                    sent += buf.numel() * 2 * half
                else:
                    received += buf.numel() * 2
                    full[n] = buf
        if rank >= half:
            engine.begin_weight_update()
            engine.load_weights((n, weight_map.assemble(s, weight_map.slicer(full)))
                                for n, s in engine.decoder.layouts.items())
            engine.end_weight_update(version)
        return sent, received

    pairs: dict[tuple[int, int], int] = {}
    for p in plan.pieces:
        pairs[(p.src, p.dst)] = pairs.get((p.src, p.dst), 0) + p.nbytes
    raw_buffers = {pair: torch.empty(n, dtype=torch.uint8) for pair, n in pairs.items() if rank in pair}

    def raw_send(version):
        works = [dist.isend(buf, dst) if src == rank else dist.irecv(buf, src)
                 for (src, dst), buf in raw_buffers.items()]
        for w in works:
            w.wait()
        sent = sum(b.numel() for (src, _), b in raw_buffers.items() if src == rank)
        return sent, sum(b.numel() for b in raw_buffers.values()) - sent

    results = {}
    for name, fn in (("gather_broadcast", gather_broadcast), ("ddma", ddma), ("raw_send", raw_send)):
        times, moved = [], None
        for i in range(repeats + 1):  # first run warms up
            dist.barrier()
            start = time.perf_counter()
            moved = fn(i + 1)
            dist.barrier()
            if i:
                times.append(time.perf_counter() - start)
        results[name] = {"seconds": min(times), "sent": moved[0], "received": moved[1]}
    return results


def run(quick: bool = False) -> dict:
    from megatron_rl.runtime.spawn import run_on_ranks

    spec = _spec(quick)
    out = {"model_mb_bf16": spec.num_parameters() * 2 / 2**20}
    for procs in (2, 4):
        ranks = run_on_ranks(_rank_main, procs, quick, 5, timeout_s=1200)  # the best of 5: the machine is noisy
        row = {}
        for method in ("gather_broadcast", "ddma", "raw_send"):
            row[method] = {
                "seconds": max(r[method]["seconds"] for r in ranks),
                "busiest_rank_bytes": max(max(r[method]["sent"], r[method]["received"]) for r in ranks),
            }
        row["speedup_vs_gather_broadcast"] = row["gather_broadcast"]["seconds"] / row["ddma"]["seconds"]
        row["ddma_vs_raw_send"] = row["raw_send"]["seconds"] / row["ddma"]["seconds"]
        out[f"processes_{procs}"] = row
    out["speedup_vs_gather_broadcast"] = out["processes_4"]["speedup_vs_gather_broadcast"]
    out["ddma_vs_raw_send"] = out["processes_4"]["ddma_vs_raw_send"]
    out["ddma_busiest_bytes_2_to_4"] = (out["processes_2"]["ddma"]["busiest_rank_bytes"],
                                        out["processes_4"]["ddma"]["busiest_rank_bytes"])
    return out
