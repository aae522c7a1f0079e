"""The one Megatron <-> HF <-> SGLang name and layout mapping.

Every parameter shard of any runtime (a Megatron-Core TP/PP rank, an SGLang TP rank, or HF itself) is
described as a `ShardLayout`: an ordered list of `Segment`s, each a range of rows (or columns, for
row-parallel weights) of one HF tensor, or padding. The shard's tensor is exactly the concatenation of its
segments along `dim`. With that single description:

- converting HF -> Megatron is `assemble(layout, hf_tensors)` for each trainer shard;
- converting Megatron -> HF is `scatter(layout, shard, hf_tensors)` (padding is dropped);
- resharding Megatron TP m -> SGLang TP n (DDMA) is intersecting segments of the two layouts.

Layout facts encoded here (checked against Megatron-Core 0.16 and SGLang 0.5):
- Megatron `linear_qkv` is interleaved per query group: for each KV head g, [q heads of g; k_g; v_g]. A TP
  shard holds whole groups, so a shard is a contiguous range of groups.
- Megatron `linear_fc1` is [gate; up] per TP shard, i.e. [gate_r; up_r] on rank r.
- SGLang `qkv_proj` on TP rank r is [q_r; k_r; v_r]; when kv_heads < TP, KV heads are replicated and rank
  r holds KV head r // (TP / kv_heads). `gate_up_proj` is [gate_r; up_r].
- Row-parallel weights (`linear_proj`/`o_proj`, `linear_fc2`/`down_proj`) split the input dim (1).
- Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP; SGLang pads to a
  multiple of 64 and then splits evenly across TP ranks.
- Megatron's local spec keeps norms as separate modules; the Transformer-Engine spec fuses them into the
  following linear layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`): `TrainerLayout`'s
  `transformer_impl` decides which names every consumer uses. Qwen3's per-head q/k norms are
  `self_attention.q_layernorm` / `k_layernorm` (Megatron) and `self_attn.q_norm` / `k_norm` (HF, SGLang).
- Experts (mixture-of-experts models): Megatron's router `mlp.router.weight` is replicated; expert parallelism
  (EP) gives each EP rank E / EP whole experts, numbered locally (`mlp.experts.local_experts.j` in the local spec,
  `mlp.experts.linear_fc1.weight{j}` in Transformer Engine's grouped GEMM), and expert tensor parallelism (ETP)
  splits each expert's fc1 ([gate; up] per ETP rank) and fc2 like a dense MLP. The trainer's EP x ETP ranks are
  carved out of its TP x DP ranks in Megatron-Core's expert order (ETP fastest, then EP). SGLang with
  `--ep-size` k on TP n gives each group of n / k consecutive TP ranks E / k experts, each split n / k ways;
  the built-in engine holds the same rows as one 2-D tensor per expert (`experts.{e}.gate_up_proj`,
  `experts.{e}.down_proj`, global expert numbers) where SGLang stacks them into `w13_weight` / `w2_weight`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping

import torch

from megatron_rl.models.spec import ARCHITECTURES, ModelSpec

SGLANG_VOCAB_PADDING = 64


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows [start, stop) along the split dim of HF tensor `hf_name`; `hf_name=None` means padding rows."""

    hf_name: str | None
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """One runtime parameter shard: `cat([segment slices], dim)` gives a tensor of `shape`."""

    name: str
    dim: int
    segments: tuple[Segment, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


# ---- HF names -----------------------------------------------------------------------------------------------

def hf_layer(i: int) -> str:
    return f"model.layers.{i}"


@dataclasses.dataclass(frozen=True)
class MoENames:
    """HF names of one layer's mixture of experts (Qwen3-MoE `mlp.experts.E.gate_proj`, Mixtral
    `block_sparse_moe.experts.E.w1`)."""

    module: str  # e.g. model.layers.3.mlp
    router: str
    gate: str
    up: str
    down: str

    @property
    def router_weight(self) -> str:
        return f"{self.module}.{self.router}.weight"

    def expert(self, e: int, which: str) -> str:
        return f"{self.module}.experts.{e}.{getattr(self, which)}.weight"


def hf_moe_names(spec: ModelSpec, layer: int) -> MoENames:
    module, router, gate, up, down = ARCHITECTURES[spec.arch]["moe_names"]
    return MoENames(f"{hf_layer(layer)}.{module}", router, gate, up, down)


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint (the hub's per-expert names) with its shape."""
    h, f, v, d = spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(spec.num_layers):
        p = hf_layer(i)
        shapes.update({
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.post_attention_layernorm.weight": (h,),
        })
        if spec.qk_layernorm:
            shapes[f"{p}.self_attn.q_norm.weight"] = (d,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (d,)
        if spec.is_moe:
            moe, fe = hf_moe_names(spec, i), spec.moe_ffn_hidden_size
            shapes[moe.router_weight] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                shapes.update({moe.expert(e, "gate"): (fe, h), moe.expert(e, "up"): (fe, h),
                               moe.expert(e, "down"): (h, fe)})
        else:
            shapes.update({
                f"{p}.mlp.gate_proj.weight": (f, h),
                f"{p}.mlp.up_proj.weight": (f, h),
                f"{p}.mlp.down_proj.weight": (h, f),
            })
        if spec.qkv_bias:
            shapes.update({
                f"{p}.self_attn.q_proj.bias": (q,),
                f"{p}.self_attn.k_proj.bias": (kv,),
                f"{p}.self_attn.v_proj.bias": (kv,),
            })
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


# ---- segment builders -----------------------------------------------------------------------------------------

def _whole(hf_name: str, size: int) -> tuple[Segment, ...]:
    return (Segment(hf_name, 0, size),)


def _chunk(hf_name: str, size: int, tp: int, rank: int) -> tuple[Segment, ...]:
    step = size // tp
    return (Segment(hf_name, rank * step, (rank + 1) * step),)


def _vocab(hf_name: str, vocab: int, padded: int, tp: int, rank: int) -> tuple[Segment, ...]:
    step = padded // tp
    start, stop = rank * step, (rank + 1) * step
    segments = []
    if start < vocab:
        segments.append(Segment(hf_name, start, min(stop, vocab)))
    if stop > vocab:
        segments.append(Segment(None, max(start, vocab), stop))
    return tuple(segments)


def _megatron_qkv(spec: ModelSpec, prefix: str, suffix: str, tp: int, rank: int) -> tuple[Segment, ...]:
    d, hpg = spec.head_dim, spec.heads_per_group
    groups = spec.num_key_value_heads // tp
    segments = []
    for g in range(rank * groups, (rank + 1) * groups):
        segments += [
            Segment(f"{prefix}.q_proj.{suffix}", g * hpg * d, (g + 1) * hpg * d),
            Segment(f"{prefix}.k_proj.{suffix}", g * d, (g + 1) * d),
            Segment(f"{prefix}.v_proj.{suffix}", g * d, (g + 1) * d),
        ]
    return tuple(segments)


def _sglang_qkv(spec: ModelSpec, prefix: str, suffix: str, tp: int, rank: int) -> tuple[Segment, ...]:
    d = spec.head_dim
    q_heads = spec.num_attention_heads // tp
    kv_heads = spec.num_key_value_heads
    if kv_heads >= tp:
        per = kv_heads // tp
        kv_start, kv_stop = rank * per * d, (rank + 1) * per * d
    else:
        head = rank // (tp // kv_heads)
        kv_start, kv_stop = head * d, (head + 1) * d
    return (
        Segment(f"{prefix}.q_proj.{suffix}", rank * q_heads * d, (rank + 1) * q_heads * d),
        Segment(f"{prefix}.k_proj.{suffix}", kv_start, kv_stop),
        Segment(f"{prefix}.v_proj.{suffix}", kv_start, kv_stop),
    )


def _gate_up(gate: str, up: str, f: int, tp: int, rank: int) -> tuple[Segment, ...]:
    return _chunk(gate, f, tp, rank) + _chunk(up, f, tp, rank)


def _dense_gate_up(prefix: str, f: int, tp: int, rank: int) -> tuple[Segment, ...]:
    return _gate_up(f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f, tp, rank)


def _experts_of(spec: ModelSpec, ep: int, ep_rank: int) -> range:
    per = spec.num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def _layout(name: str, dim: int, segments: tuple[Segment, ...], other: int | None) -> ShardLayout:
    rows = sum(s.length for s in segments)
    if other is None:
        shape = (rows,)
    else:
        shape = (rows, other) if dim == 0 else (other, rows)
    return ShardLayout(name, dim, segments, shape)


def _validate_tp(spec: ModelSpec, tp: int, who: str, allow_kv_replication: bool) -> None:
    problems = []
    if spec.num_attention_heads % tp:
        problems.append(f"num_attention_heads {spec.num_attention_heads}")
    if spec.ffn_hidden_size % tp and not spec.is_moe:
        problems.append(f"ffn_hidden_size {spec.ffn_hidden_size}")
    kv = spec.num_key_value_heads
    if allow_kv_replication:
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            problems.append(f"num_key_value_heads {kv} (must divide TP or be divisible by it)")
    elif kv % tp:
        problems.append(f"num_key_value_heads {kv}")
    if problems:
        flag = "--tensor-model-parallel-size" if who == "trainer" else "--rollout-tensor-parallel-size"
        raise ValueError(f"{who} TP={tp} ({flag}) does not divide model {spec.name!r}: {', '.join(problems)}")


def _validate_experts(spec: ModelSpec, ep: int, etp: int, ep_flag: str, etp_flag: str) -> None:
    if ep < 1 or etp < 1:
        raise ValueError(f"{ep_flag} and {etp_flag} must be >= 1, got {ep} and {etp}")
    if not spec.is_moe:
        if ep > 1:
            raise ValueError(f"{ep_flag} {ep}: model {spec.name!r} has no experts")
        return
    if spec.num_experts % ep:
        raise ValueError(f"{ep_flag} {ep} does not divide model {spec.name!r} num_experts {spec.num_experts}")
    if spec.moe_ffn_hidden_size % etp:
        raise ValueError(f"{etp_flag} {etp} does not divide model {spec.name!r} moe_ffn_hidden_size "
                         f"{spec.moe_ffn_hidden_size}")


# ---- the two layouts of a run ------------------------------------------------------------------------------------

TRANSFORMER_IMPLS = ("local", "transformer_engine")  # Megatron-LM's --transformer-impl
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")  # Megatron-LM's --moe-token-dispatcher-type (not "flex": DeepEP)


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """The trainer's Megatron-Core layout, built once per run and read by every consumer: process groups,
    TransformerConfig, the layer spec, HF loading, the DDMA plan, checkpoints and --dry-run.

    TP x PP x DP ranks; vocabulary padding; the layer spec (`local`, or `transformer_engine` whose linear layers
    carry the norms before them); layers split evenly over PP stages unless the first and/or last stage get their
    own count (Megatron's --decoder-first/last-pipeline-num-layers, e.g. 126 layers over 16 stages as
    7 + 14 x 8 + 7); the bytes per element of the trainer's weights (what DDMA sends); and the memory-for-compute
    choices that Megatron-Core's TransformerConfig takes with them (sequence parallelism, activation recompute),
    which change no weight's shape or place. With experts: expert parallelism (EP, expert TP) and Megatron-Core's
    token dispatcher (how tokens travel to their experts' ranks).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    make_vocab_size_divisible_by: int = 128
    transformer_impl: str = "local"
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    dtype_bytes: int = 2
    sequence_parallel: bool = False
    recompute_granularity: str | None = None  # "full" | "selective"
    recompute_method: str | None = None  # "uniform" | "block" (full recompute)
    recompute_num_layers: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the TP size (Megatron-Core's default)
    moe_token_dispatcher_type: str = "alltoall"  # Megatron-Core's token dispatcher (--moe-token-dispatcher-type)

    @property
    def expert_tp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_parallel_size

    def expert_ranks(self, dp: int, tp: int) -> tuple[int, int]:
        """(EP rank, expert-TP rank) of the trainer rank (dp, tp) of any stage: Megatron-Core lays the expert
        groups over the same TP x DP ranks of a stage, expert-TP fastest, then EP."""
        local = tp + self.tensor_parallel_size * dp
        return (local // self.expert_tp) % self.expert_model_parallel_size, local % self.expert_tp

    @property
    def expert_replica_span(self) -> int:
        """How many data-parallel ranks (dp = 0, 1, ...) it takes, with all TP ranks, to hold every expert
        shard once (the period of `expert_ranks` in dp): 1 without expert parallelism."""
        return math.lcm(self.tensor_parallel_size, self.expert_model_parallel_size * self.expert_tp) \
            // self.tensor_parallel_size

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.model_parallel_size * self.data_parallel_size

    @property
    def transformer_engine(self) -> bool:
        return self.transformer_impl == "transformer_engine"

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """Global rank in Megatron-Core's default order (tp fastest, then dp, then pp)."""
        return (pp * self.data_parallel_size + dp) * self.tensor_parallel_size + tp

    def describe(self) -> str:
        experts = ""
        if self.expert_model_parallel_size > 1 or self.expert_tp != self.tensor_parallel_size:
            experts = f" EP={self.expert_model_parallel_size} ETP={self.expert_tp}"
        return (f"trainer TP={self.tensor_parallel_size} PP={self.pipeline_parallel_size} "
                f"DP={self.data_parallel_size}{experts}")

    def stage_sizes(self, spec: ModelSpec) -> list[int]:
        """Decoder layers of each pipeline stage, Megatron-Core's rule: the stages without a count of their own
        share the remaining layers evenly."""
        pp, first, last = self.pipeline_parallel_size, self.decoder_first_pipeline_num_layers, \
            self.decoder_last_pipeline_num_layers
        flags = "".join(f" --decoder-{k}-pipeline-num-layers {v}" for k, v in (("first", first), ("last", last))
                        if v is not None)
        if pp == 1 and flags:
            raise ValueError(f"{flags.strip()} need(s) --pipeline-model-parallel-size > 1")
        if pp == 1:
            return [spec.num_layers]
        fixed = [x for x in (first, last) if x is not None]
        if any(x < 1 for x in fixed):
            raise ValueError(f"{flags.strip()}: a pipeline stage needs at least one layer")
        middle_stages = pp - len(fixed)
        rest = spec.num_layers - sum(fixed)
        if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages and (rest < middle_stages or
                                                                               rest % middle_stages)):
            raise ValueError(f"--pipeline-model-parallel-size {pp}{flags} does not divide model {spec.name!r} "
                             f"num_layers {spec.num_layers} (set --decoder-first/last-pipeline-num-layers)")
        per = rest // middle_stages if middle_stages else 0
        sizes = [per] * pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        return sizes

    def layers(self, spec: ModelSpec, pp_rank: int) -> range:
        """Global layer indices held by pipeline stage `pp_rank`."""
        sizes = self.stage_sizes(spec)
        start = sum(sizes[:pp_rank])
        return range(start, start + sizes[pp_rank])

    def validate(self, spec: ModelSpec) -> None:
        """Raise ValueError naming the flag and the numbers if this layout cannot hold the model."""
        for flag, value in (("--tensor-model-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-model-parallel-size", self.pipeline_parallel_size),
                            ("data-parallel size", self.data_parallel_size),
                            ("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"--transformer-impl {self.transformer_impl!r}: choose one of {TRANSFORMER_IMPLS}")
        if self.moe_token_dispatcher_type not in MOE_TOKEN_DISPATCHERS:
            raise ValueError(f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type!r}: choose one of "
                             f"{MOE_TOKEN_DISPATCHERS}")
        _validate_tp(spec, self.tensor_parallel_size, "trainer", allow_kv_replication=False)
        _validate_experts(spec, self.expert_model_parallel_size, self.expert_tp, "--expert-model-parallel-size",
                          "--expert-tensor-parallel-size")
        group = self.expert_model_parallel_size * self.expert_tp
        if (self.tensor_parallel_size * self.data_parallel_size) % group:
            raise ValueError(f"--expert-model-parallel-size {self.expert_model_parallel_size} x "
                             f"--expert-tensor-parallel-size {self.expert_tp} must divide TP x DP = "
                             f"{self.tensor_parallel_size} x {self.data_parallel_size} ({self.describe()})")
        self.stage_sizes(spec)


@dataclasses.dataclass(frozen=True)
class GeneratorLayout:
    """The generators' layout: `num_replicas` engines of TP `tensor_parallel_size` each (SGLang's runtime
    layout), optionally block-FP8, on global ranks from `first_rank` on."""

    tensor_parallel_size: int = 1
    num_replicas: int = 1
    fp8: bool = False
    first_rank: int = 0  # global rank of replica 0, TP rank 0
    expert_parallel_size: int = 1  # SGLang's --ep-size: experts split over groups of TP / EP ranks

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.num_replicas

    def rank(self, replica: int, tp: int) -> int:
        return self.first_rank + replica * self.tensor_parallel_size + tp

    def describe(self) -> str:
        return (f"generator TP={self.tensor_parallel_size}"
                f"{f' EP={self.expert_parallel_size}' if self.expert_parallel_size > 1 else ''} x "
                f"{self.num_replicas} replicas{' FP8' if self.fp8 else ''}")

    def validate(self, spec: ModelSpec) -> None:
        for flag, value in (("--rollout-tensor-parallel-size", self.tensor_parallel_size),
                            ("--rollout-num-replicas", self.num_replicas)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        sglang_shards(spec, self.tensor_parallel_size, 0, self.expert_parallel_size)


def balanced_edge_stages(num_layers: int, pipeline_parallel_size: int) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts that make an uneven split work: middle stages get ceil(L / PP)
    layers and the two edge stages share the rest (126 over 16 -> 7, 14 x 8, 7). (None, None) if even."""
    pp = pipeline_parallel_size
    if pp == 1 or num_layers % pp == 0:
        return None, None
    per = -(-num_layers // pp)
    rest = num_layers - per * (pp - 2)
    if rest < 2:
        raise ValueError(f"cannot split {num_layers} layers over {pp} pipeline stages")
    return rest - rest // 2, rest // 2


def megatron_shards(spec: ModelSpec, layout: TrainerLayout, tp_rank: int, pp_rank: int,
                    dp_rank: int = 0) -> dict[str, ShardLayout]:
    """Every parameter of Megatron rank (tp_rank, pp_rank, dp_rank), by its local Megatron name. The DP rank
    matters only with expert parallelism: it picks the rank's experts."""
    layout.validate(spec)
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    h, f = spec.hidden_size, spec.ffn_hidden_size
    padded = spec.padded_vocab_size(tp, layout.make_vocab_size_divisible_by)
    te = layout.transformer_engine
    out: dict[str, ShardLayout] = {}

    def add(name, dim, segments, other):
        out[name] = _layout(name, dim, segments, other)

    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        add("embedding.word_embeddings.weight", 0,
            _vocab("model.embed_tokens.weight", spec.vocab_size, padded, tp, tp_rank), h)
    for local, i in enumerate(layout.layers(spec, pp_rank)):
        m, p = f"decoder.layers.{local}", hf_layer(i)
        attn = f"{p}.self_attn"
        norm1 = f"{m}.self_attention.linear_qkv.layer_norm_weight" if te else f"{m}.input_layernorm.weight"
        norm2 = f"{m}.mlp.linear_fc1.layer_norm_weight" if te else f"{m}.pre_mlp_layernorm.weight"
        add(norm1, 0, _whole(f"{p}.input_layernorm.weight", h), None)
        add(f"{m}.self_attention.linear_qkv.weight", 0, _megatron_qkv(spec, attn, "weight", tp, tp_rank), h)
        if spec.qkv_bias:
            add(f"{m}.self_attention.linear_qkv.bias", 0, _megatron_qkv(spec, attn, "bias", tp, tp_rank), None)
        add(f"{m}.self_attention.linear_proj.weight", 1,
            _chunk(f"{attn}.o_proj.weight", spec.num_attention_heads * spec.head_dim, tp, tp_rank), h)
        if spec.qk_layernorm:
            add(f"{m}.self_attention.q_layernorm.weight", 0, _whole(f"{attn}.q_norm.weight", spec.head_dim), None)
            add(f"{m}.self_attention.k_layernorm.weight", 0, _whole(f"{attn}.k_norm.weight", spec.head_dim), None)
        if spec.is_moe:
            add(f"{m}.pre_mlp_layernorm.weight", 0, _whole(f"{p}.post_attention_layernorm.weight", h), None)
            moe, fe, etp = hf_moe_names(spec, i), spec.moe_ffn_hidden_size, layout.expert_tp
            add(f"{m}.mlp.router.weight", 0, _whole(moe.router_weight, spec.num_experts), h)
            ep_rank, etp_rank = layout.expert_ranks(dp_rank, tp_rank)
            for j, e in enumerate(_experts_of(spec, layout.expert_model_parallel_size, ep_rank)):
                fc1, fc2 = ((f"{m}.mlp.experts.linear_fc1.weight{j}", f"{m}.mlp.experts.linear_fc2.weight{j}") if te
                            else (f"{m}.mlp.experts.local_experts.{j}.linear_fc1.weight",
                                  f"{m}.mlp.experts.local_experts.{j}.linear_fc2.weight"))
                add(fc1, 0, _gate_up(moe.expert(e, "gate"), moe.expert(e, "up"), fe, etp, etp_rank), h)
                add(fc2, 1, _chunk(moe.expert(e, "down"), fe, etp, etp_rank), h)
            continue
        add(norm2, 0, _whole(f"{p}.post_attention_layernorm.weight", h), None)
        add(f"{m}.mlp.linear_fc1.weight", 0, _dense_gate_up(f"{p}.mlp", f, tp, tp_rank), h)
        add(f"{m}.mlp.linear_fc2.weight", 1, _chunk(f"{p}.mlp.down_proj.weight", f, tp, tp_rank), h)
    if last:
        add("decoder.final_layernorm.weight", 0, _whole("model.norm.weight", h), None)
        if not spec.tie_word_embeddings or pp > 1:
            # With tied embeddings and PP > 1, the last stage keeps its own copy of the embedding.
            source = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
            add("output_layer.weight", 0, _vocab(source, spec.vocab_size, padded, tp, tp_rank), h)
    return out


# ---- SGLang runtime (the generator layout; also the built-in engine's) ------------------------------------------

def sglang_padded_vocab(spec: ModelSpec, tp: int) -> int:
    step = SGLANG_VOCAB_PADDING
    padded = -(-spec.vocab_size // step) * step
    if padded % tp:
        raise ValueError(f"generator TP={tp} does not divide the padded vocabulary {padded} of model {spec.name!r}")
    return padded


def generator_experts(spec: ModelSpec, tp: int, tp_rank: int, ep: int = 1) -> tuple[range, int, int]:
    """(the global experts of generator TP rank `tp_rank`, its expert-TP size, its expert-TP rank) with SGLang's
    --ep-size `ep`: consecutive groups of TP / EP ranks share E / EP experts, each split TP / EP ways."""
    if tp % ep:
        raise ValueError(f"--rollout-expert-parallel-size {ep} must divide --rollout-tensor-parallel-size {tp}")
    moe_tp = tp // ep
    return _experts_of(spec, ep, tp_rank // moe_tp), moe_tp, tp_rank % moe_tp


def sglang_shards(spec: ModelSpec, tp: int, tp_rank: int, ep: int = 1) -> dict[str, ShardLayout]:
    """Every runtime parameter of SGLang TP rank `tp_rank` (of `ep` expert-parallel groups), by SGLang's fused
    runtime names (experts: one tensor per expert, see the module docstring)."""
    _validate_tp(spec, tp, "generator", allow_kv_replication=True)
    _validate_experts(spec, ep, tp // ep if tp % ep == 0 else 1, "--rollout-expert-parallel-size",
                      "--rollout-tensor-parallel-size / --rollout-expert-parallel-size")
    h, f = spec.hidden_size, spec.ffn_hidden_size
    padded = sglang_padded_vocab(spec, tp)
    out: dict[str, ShardLayout] = {}

    def add(name, dim, segments, other):
        out[name] = _layout(name, dim, segments, other)

    add("model.embed_tokens.weight", 0, _vocab("model.embed_tokens.weight", spec.vocab_size, padded, tp, tp_rank), h)
    for i in range(spec.num_layers):
        p = hf_layer(i)
        add(f"{p}.input_layernorm.weight", 0, _whole(f"{p}.input_layernorm.weight", h), None)
        add(f"{p}.self_attn.qkv_proj.weight", 0, _sglang_qkv(spec, f"{p}.self_attn", "weight", tp, tp_rank), h)
        if spec.qkv_bias:
            add(f"{p}.self_attn.qkv_proj.bias", 0, _sglang_qkv(spec, f"{p}.self_attn", "bias", tp, tp_rank), None)
        add(f"{p}.self_attn.o_proj.weight", 1,
            _chunk(f"{p}.self_attn.o_proj.weight", spec.num_attention_heads * spec.head_dim, tp, tp_rank), h)
        if spec.qk_layernorm:
            for norm in ("q_norm", "k_norm"):
                add(f"{p}.self_attn.{norm}.weight", 0, _whole(f"{p}.self_attn.{norm}.weight", spec.head_dim), None)
        add(f"{p}.post_attention_layernorm.weight", 0, _whole(f"{p}.post_attention_layernorm.weight", h), None)
        if spec.is_moe:
            moe, fe = hf_moe_names(spec, i), spec.moe_ffn_hidden_size
            experts, moe_tp, moe_rank = generator_experts(spec, tp, tp_rank, ep)
            add(moe.router_weight, 0, _whole(moe.router_weight, spec.num_experts), h)
            for e in experts:
                add(f"{moe.module}.experts.{e}.gate_up_proj.weight", 0,
                    _gate_up(moe.expert(e, "gate"), moe.expert(e, "up"), fe, moe_tp, moe_rank), h)
                add(f"{moe.module}.experts.{e}.down_proj.weight", 1,
                    _chunk(moe.expert(e, "down"), fe, moe_tp, moe_rank), h)
            continue
        add(f"{p}.mlp.gate_up_proj.weight", 0, _dense_gate_up(f"{p}.mlp", f, tp, tp_rank), h)
        add(f"{p}.mlp.down_proj.weight", 1, _chunk(f"{p}.mlp.down_proj.weight", f, tp, tp_rank), h)
    add("model.norm.weight", 0, _whole("model.norm.weight", h), None)
    if not spec.tie_word_embeddings:
        add("lm_head.weight", 0, _vocab("lm_head.weight", spec.vocab_size, padded, tp, tp_rank), h)
    return out


# ---- moving tensors through a layout -----------------------------------------------------------------------------

def assemble(layout: ShardLayout, get_slice: Callable[[Segment, int], torch.Tensor],
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """Build a shard from its segments. `get_slice(segment, dim)` returns that slice of the HF tensor."""
    parts = []
    for seg in layout.segments:
        if seg.hf_name is None:
            shape = list(layout.shape)
            shape[layout.dim] = seg.length
            parts.append(torch.zeros(shape, dtype=dtype or torch.float32))
        else:
            parts.append(get_slice(seg, layout.dim))
    tensor = parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].dtype) for p in parts], layout.dim)
    if tuple(tensor.shape) != layout.shape:
        raise ValueError(f"{layout.name}: assembled shape {tuple(tensor.shape)} != expected {layout.shape}")
    return tensor.contiguous()


def slicer(hf_tensors: Mapping[str, torch.Tensor]) -> Callable[[Segment, int], torch.Tensor]:
    """A `get_slice` over an in-memory (or lazily loaded) mapping of HF tensors."""

    def get(seg: Segment, dim: int) -> torch.Tensor:
        try:
            tensor = hf_tensors[seg.hf_name]
        except KeyError:
            raise KeyError(f"HF tensor {seg.hf_name!r} is missing") from None
        return tensor.narrow(dim if tensor.dim() > 1 else 0, seg.start, seg.length)

    return get


def split(layout: ShardLayout, shard: torch.Tensor) -> Iterator[tuple[Segment, torch.Tensor]]:
    """The inverse of `assemble`: yield (segment, slice of `shard`) for each segment, padding included."""
    if tuple(shard.shape) != layout.shape:
        raise ValueError(f"{layout.name}: tensor shape {tuple(shard.shape)} != layout shape {layout.shape}")
    offset = 0
    dim = layout.dim if shard.dim() > 1 else 0
    for seg in layout.segments:
        yield seg, shard.narrow(dim, offset, seg.length)
        offset += seg.length


def scatter(layout: ShardLayout, shard: torch.Tensor, hf_tensors: dict[str, torch.Tensor],
            hf_shape: Mapping[str, tuple[int, ...]]) -> None:
    """Write a shard's slices into full HF tensors (allocated on first use); padding rows are dropped."""
    for seg, piece in split(layout, shard):
        if seg.hf_name is None:
            continue
        if seg.hf_name not in hf_tensors:
            hf_tensors[seg.hf_name] = torch.empty(hf_shape[seg.hf_name], dtype=shard.dtype)
        target = hf_tensors[seg.hf_name]
        target.narrow(layout.dim if target.dim() > 1 else 0, seg.start, seg.length).copy_(piece)
