"""DDMA planning: which trainer rank sends which slice to which generator rank.

Both sides are described by the one layout mapping (`models.weight_map`): a generator rank's runtime tensor is a
list of HF row ranges (SGLang layout), and each trainer rank holds HF row ranges inside its Megatron shards.
Intersecting the two gives point-to-point pieces: (trainer rank, Megatron tensor, offset) -> (generator
rank, runtime tensor, offset), `length` rows along the split dim. Resharding TP m -> n, fused QKV per query
group -> [q; k; v], fc1 -> [gate; up], row-parallel dims, vocab padding and PP stages all fall out of that
intersection; no rank ever holds more than its own shard.

Sources are spread, and each generator rank has few: rows held by several trainer ranks (DP replicas, and TP ranks
for replicated norms) come to a generator rank from one of those holders, the one that had sent the fewest bytes
when that generator rank first needed rows from them, and from it for all such rows. So DP replicas share the
sending (each feeds its share of the generator ranks), and a generator rank hears from one holder of each set of
rows only: the fewer peers, the fewer tensors it has half-received at once (its receive buffers) and the fewer NCCL
connections it opens. The plan is a pure function of the layouts, computed identically on every rank and cached.

FP8: for a runtime weight that SGLang serves in block FP8, pieces whose rows (or columns) start and end on
128 boundaries are quantized by the sender (half the bytes of bf16); if any piece of a tensor is not
aligned, that tensor travels in the trainer's dtype and the receiving rank quantizes it, with the same block
quantizer, once it is complete (`Plan.quantized_on_receipt`): every engine is given FP8 values and their scales.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict

from megatron_rl.models import weight_map
from megatron_rl.models.fp8 import BLOCK, is_fp8_weight, scale_shape
from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
from megatron_rl.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Piece:
    """`length` rows along `dim` of one tensor, sent from `src` to `dst`."""

    src: int
    dst: int
    src_tensor: str  # Megatron local name on the source rank
    src_offset: int
    dst_tensor: str  # runtime (SGLang) name on the destination rank
    dst_offset: int
    length: int
    dim: int
    row_numel: int  # elements per row along `dim` (product of the other dims)
    quantize: bool  # the sender quantizes to block FP8
    nbytes: int


@dataclasses.dataclass
class Plan:
    spec: ModelSpec
    trainer: TrainerLayout
    generator: GeneratorLayout
    pieces: list[Piece]
    runtime: dict[int, dict[str, weight_map.ShardLayout]]  # generator global rank -> its runtime tensors
    quantized_tensors: frozenset[str]  # runtime names sent as FP8 by the trainer
    schedules: dict = dataclasses.field(default_factory=dict, repr=False)  # bucket size -> its rounds (ddma.sync)
    buffers: dict = dataclasses.field(default_factory=dict, repr=False)  # per-rank reused buffers (ddma.sync)

    @functools.cached_property
    def by_rank(self) -> dict[int, dict[str, list[Piece]]]:
        out: dict[int, dict[str, list[Piece]]] = defaultdict(lambda: {"send": [], "recv": []})
        for p in self.pieces:
            out[p.src]["send"].append(p)
            out[p.dst]["recv"].append(p)
        return dict(out)

    def sends(self, rank: int) -> list[Piece]:
        return self.by_rank.get(rank, {"send": []})["send"]

    def recvs(self, rank: int) -> list[Piece]:
        return self.by_rank.get(rank, {"recv": []})["recv"]

    def quantized_on_receipt(self, name: str) -> bool:
        """Whether runtime tensor `name` is an FP8 weight that travels in the trainer's dtype (a piece of it is not
        aligned to 128-row blocks), which the receiver quantizes before its engine installs it."""
        return self.generator.fp8 and is_fp8_weight(name) and name not in self.quantized_tensors

    def bytes_sent(self, rank: int) -> int:
        return sum(p.nbytes for p in self.sends(rank))

    def bytes_received(self, rank: int) -> int:
        return sum(p.nbytes for p in self.recvs(rank))

    def tensor_bytes(self, rank: int, name: str) -> int:
        """Memory of generator `rank`'s runtime tensor `name` (FP8 values or the trainer dtype; padding included)."""
        return self.runtime[rank][name].numel * (1 if name in self.quantized_tensors else self.trainer.dtype_bytes)

    def shard_bytes(self, rank: int) -> int:
        """Memory of generator `rank`'s runtime weights."""
        return sum(self.tensor_bytes(rank, name) for name in self.runtime[rank])


def piece_nbytes(length: int, row_numel: int, quantize: bool, dtype_bytes: int) -> int:
    if not quantize:
        return length * row_numel * dtype_bytes
    blocks = math.prod(scale_shape((length, row_numel)))
    return length * row_numel + blocks * 4  # e4m3 values + fp32 scale_inv per 128 x 128 block


def validate(spec: ModelSpec, trainer: TrainerLayout, generator: GeneratorLayout,
             generator_spec: ModelSpec | None = None) -> None:
    """Fail at planning time, naming both layouts, if the generator cannot take this trainer's weights."""
    both = f"({trainer.describe()} -> {generator.describe()}, model {spec.name!r})"
    if generator_spec is not None:
        theirs = generator_spec.weight_fields()
        diff = [f"{f}: {v} vs {theirs[f]}" for f, v in spec.weight_fields().items() if theirs[f] != v]
        if diff:
            raise ValueError(f"generator model does not match the trainer's {both}: {'; '.join(diff)}")
    try:
        trainer.validate(spec)
        generator.validate(spec)
    except ValueError as e:
        raise ValueError(f"cannot plan DDMA {both}: {e}") from None
    if generator.first_rank < trainer.world_size and generator.first_rank + generator.world_size > 0:
        raise ValueError(f"generator ranks start at {generator.first_rank}, inside the trainer's "
                         f"{trainer.world_size} ranks {both}")


def _trainer_index(spec: ModelSpec, trainer: TrainerLayout):
    """hf_name -> [(hf_start, hf_stop, [(global rank, megatron_name, offset)...])]: who holds which rows. Every
    rank that holds a row is listed (DP replicas, TP ranks for replicated norms); with expert parallelism a
    data-parallel rank holds only its EP rank's experts."""
    ranges: dict[str, dict[tuple[int, int], list]] = defaultdict(dict)
    shards_of: dict[tuple, dict[str, weight_map.ShardLayout]] = {}
    for pp in range(trainer.pipeline_parallel_size):
        for dp in range(trainer.data_parallel_size):
            for tp in range(trainer.tensor_parallel_size):
                key = (tp, pp, dp % trainer.expert_replica_span)
                if key not in shards_of:
                    shards_of[key] = weight_map.megatron_shards(spec, trainer, tp, pp, key[2])
                for name, shard in shards_of[key].items():
                    if name == "output_layer.weight" and spec.tie_word_embeddings:
                        continue  # a copy of the embedding on the last stage: the first stage sends it
                    offset = 0
                    for seg in shard.segments:
                        if seg.hf_name is not None:
                            ranges[seg.hf_name].setdefault((seg.start, seg.stop), []).append(
                                (trainer.rank(dp, pp, tp), name, offset))
                        offset += seg.length
    return {h: sorted((a, b, holders) for (a, b), holders in r.items()) for h, r in ranges.items()}


def _aligned(offset: int, length: int, size: int) -> bool:
    return offset % BLOCK == 0 and (length % BLOCK == 0 or offset + length == size)


def _holder_choice(holders: list, memo: dict) -> tuple[tuple[int, ...], dict[int, tuple[str, int]]]:
    """(the ranks holding a row range, ascending; rank -> (its Megatron name, offset)), computed once per range:
    the first entry of a rank that is listed twice, as a choice among all entries by (bytes sent, rank) takes."""
    choice = memo.get(id(holders))
    if choice is None:
        first: dict[int, tuple[str, int]] = {}
        for rank, name, offset in holders:
            first.setdefault(rank, (name, offset))
        choice = memo[id(holders)] = (tuple(sorted(first)), first)
    return choice


@functools.lru_cache(maxsize=16)
def make_plan(spec: ModelSpec, trainer: TrainerLayout, generator: GeneratorLayout) -> Plan:
    validate(spec, trainer, generator)
    index = _trainer_index(spec, trainer)
    gtp = generator.tensor_parallel_size
    # Pieces of one replica, per generator TP rank (the same for every replica): (runtime name, dst offset,
    # length, dim, row_numel, quantize, nbytes, holder ranks, rank -> (megatron name, offset), row shift), the
    # source offset being the chosen holder's offset plus the shift.
    runtime_by_tp = {j: weight_map.sglang_shards(spec, gtp, j, generator.expert_parallel_size) for j in range(gtp)}
    memo: dict[int, tuple] = {}
    template: dict[int, list] = {}
    quantized: set[str] = set()
    for j, tensors in runtime_by_tp.items():
        rows = []
        for name, shard in tensors.items():
            row_numel = shard.numel // shard.shape[shard.dim]
            size = shard.shape[shard.dim]
            tensor_rows = []
            dst_offset = 0
            for seg in shard.segments:
                if seg.hf_name is None:  # vocabulary padding: nothing to send, the receiver zero-fills
                    dst_offset += seg.length
                    continue
                cursor = seg.start
                for start, stop, holders in index[seg.hf_name]:
                    if stop <= cursor or start >= seg.stop:
                        continue
                    a, b = max(start, cursor), min(stop, seg.stop)
                    if a != cursor:
                        raise AssertionError(f"rows {cursor}:{a} of {seg.hf_name} are held by no trainer rank")
                    ranks, first = _holder_choice(holders, memo)
                    tensor_rows.append((dst_offset + a - seg.start, b - a, ranks, first, a - start))
                    cursor = b
                dst_offset += seg.length
            quantize = (generator.fp8 and is_fp8_weight(name) and row_numel % BLOCK == 0
                        and all(_aligned(r[0], r[1], size) for r in tensor_rows))
            if quantize:
                quantized.add(name)
            rows.extend((name, offset, length, shard.dim, row_numel, quantize,
                         piece_nbytes(length, row_numel, quantize, trainer.dtype_bytes), ranks, first, shift)
                        for offset, length, ranks, first, shift in tensor_rows)
        template[j] = rows

    # Sources are spread: a generator rank takes each set of holders' rows from the holder that had sent the fewest
    # bytes when it first needed one of them (ties: lowest rank).
    sent = [0] * trainer.world_size
    bytes_sent = sent.__getitem__
    pieces: list[Piece] = []
    runtime: dict[int, dict[str, weight_map.ShardLayout]] = {}
    for replica in range(generator.num_replicas):
        for j in range(gtp):
            dst = generator.rank(replica, j)
            runtime[dst] = runtime_by_tp[j]
            sources: dict[tuple[int, ...], int] = {}  # this generator rank's holder of each set of holders
            for name, dst_offset, length, dim, row_numel, quantize, nbytes, ranks, first, shift in template[j]:
                if ranks not in sources:
                    sources[ranks] = min(ranks, key=bytes_sent)
                src = sources[ranks]
                sent[src] += nbytes
                src_tensor, src_offset = first[src]
                pieces.append(Piece(src, dst, src_tensor, src_offset + shift, name, dst_offset, length, dim,
                                    row_numel, quantize, nbytes))
    return Plan(spec, trainer, generator, pieces, runtime, frozenset(quantized))


# Assumed link speeds (Gb/s per rank) of the transports other than NCCL: gloo moves bytes over TCP (about this much
# per connection on a data-center NIC or the loopback device), and the staged path adds a copy from the sender's GPU
# to host memory and one from host memory to the receiver's GPU (PCIe).
GLOO_GBPS, PCIE_GBPS = 20.0, 200.0


def link_gbps(transport: str, same_node: bool, inter_node_gbps: float, nvlink_gbps: float) -> float:
    """The speed one transfer of `transport` ("nccl", "gloo", "staged") gets (Gb/s)."""
    if transport == "nccl":
        return nvlink_gbps if same_node else inter_node_gbps
    if transport == "gloo":
        return GLOO_GBPS
    if transport == "staged":
        return 1 / (1 / GLOO_GBPS + 2 / PCIE_GBPS)
    raise ValueError(f"unknown DDMA transport {transport!r}")


def summarize(plan: Plan, inter_node_gbps: float = 400.0, nvlink_gbps: float = 3600.0,
              gpus_per_node: int = 8, transport: str = "nccl") -> dict:
    """Bytes and an estimated time: each rank's busiest direction over its link (full duplex). With NCCL, links of
    GPUs on the same node run at NVLink speed and across nodes at the inter-node speed (Gb/s per GPU); gloo and the
    staged path at `link_gbps`'s assumed speeds."""
    send, recv = defaultdict(int), defaultdict(int)
    send_time, recv_time = defaultdict(float), defaultdict(float)
    for p in plan.pieces:
        same_node = p.src // gpus_per_node == p.dst // gpus_per_node
        rate = link_gbps(transport, same_node, inter_node_gbps, nvlink_gbps) * 1e9 / 8
        send[p.src] += p.nbytes
        recv[p.dst] += p.nbytes
        send_time[p.src] += p.nbytes / rate
        recv_time[p.dst] += p.nbytes / rate
    return {
        "total_bytes": sum(send.values()),
        "max_send_bytes": max(send.values(), default=0),
        "max_recv_bytes": max(recv.values(), default=0),
        "num_transfers": len(plan.pieces),
        "estimated_seconds": max(list(send_time.values()) + list(recv_time.values()), default=0.0),
        "transport": transport,
    }


def gather_broadcast_baseline(plan: Plan, inter_node_gbps: float = 400.0) -> dict:
    """The design DDMA replaces: gather the whole model on one trainer rank, convert it, then broadcast the
    full model to every generator GPU (each narrows locally). Pipelined broadcast: every link carries the
    model once; the gather funnels the model through the root's link."""
    spec, t, g = plan.spec, plan.trainer, plan.generator
    params = spec.num_parameters()
    gathered = params * t.dtype_bytes
    broadcast = params * (1 if g.fp8 else t.dtype_bytes)
    rate = inter_node_gbps * 1e9 / 8
    shards = t.tensor_parallel_size * t.pipeline_parallel_size
    return {
        "total_bytes": gathered + broadcast * g.world_size,
        "max_send_bytes": broadcast,
        "max_recv_bytes": max(gathered, broadcast),
        "num_transfers": shards + g.world_size,
        "estimated_seconds": gathered / rate + broadcast / rate,
    }


def is_expert_tensor(runtime_name: str) -> bool:
    """A generator runtime tensor of one expert (`...mlp.experts.{e}.gate_up_proj.weight`, `...down_proj.weight`)."""
    return ".experts." in runtime_name


def full_experts_baseline(plan: Plan, inter_node_gbps: float = 400.0) -> dict:
    """What sending each generator rank only its own experts saves: the same update if every generator rank
    received every expert whole (all num_layers x num_experts gate/up/down weights, FP8 like the plan's when the
    generators serve FP8) and narrowed them itself, the way a gathered or broadcast model is consumed; the
    non-expert pieces are the plan's. `expert_recv_ratio` is full / sharded for the expert bytes of the busiest
    receiver (the generator TP size when its experts' rows fall on FP8 block boundaries), `recv_ratio` the same
    for all its bytes. Time: the busiest direction over inter-node links, the receivers' full bytes against the
    senders' total spread evenly over the trainer's ranks."""
    spec, g, t = plan.spec, plan.generator, plan.trainer
    if not spec.is_moe:
        raise ValueError(f"model {spec.name!r} has no experts")
    h, fe = spec.hidden_size, spec.moe_ffn_hidden_size
    quantize = g.fp8 and h % BLOCK == 0  # a whole tensor is aligned to FP8 blocks when its rows are
    per_expert = (piece_nbytes(2 * fe, h, quantize, t.dtype_bytes)  # gate_up_proj: [gate; up] rows
                  + piece_nbytes(fe, h, quantize, t.dtype_bytes))  # down_proj: its fe input columns
    all_experts = spec.num_layers * spec.num_experts * per_expert
    received, expert_received = defaultdict(int), defaultdict(int)
    for p in plan.pieces:
        received[p.dst] += p.nbytes
        if is_expert_tensor(p.dst_tensor):
            expert_received[p.dst] += p.nbytes
    busiest = max(received, key=lambda r: (received[r], -r))
    full = {r: received[r] - expert_received[r] + all_experts for r in received}
    rate = inter_node_gbps * 1e9 / 8
    total = sum(full.values())
    return {
        "generator_rank": busiest,
        "sharded_recv_bytes": received[busiest],
        "sharded_expert_recv_bytes": expert_received[busiest],
        "full_expert_bytes": all_experts,
        "total_bytes": total,
        "max_recv_bytes": full[busiest],
        "expert_recv_ratio": all_experts / max(expert_received[busiest], 1),
        "recv_ratio": full[busiest] / max(received[busiest], 1),
        "estimated_seconds": max(max(full.values()), total / t.world_size) / rate,
    }
