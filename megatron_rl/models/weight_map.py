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
from collections.abc import Callable, Iterator, Mapping

import torch

from megatron_rl.models.parallelism import (
    TrainerLayout,
    experts_of,
    generator_experts,
    sglang_padded_vocab,
    validate_experts,
    validate_tp,
)
from megatron_rl.models.spec import ARCHITECTURES, ModelSpec


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



def _layout(name: str, dim: int, segments: tuple[Segment, ...], other: int | None) -> ShardLayout:
    rows = sum(s.length for s in segments)
    if other is None:
        shape = (rows,)
    else:
        shape = (rows, other) if dim == 0 else (other, rows)
    return ShardLayout(name, dim, segments, shape)


# ---- Megatron-Core (the trainer layout) ------------------------------------------------------------------------

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
            for j, e in enumerate(experts_of(spec, layout.expert_model_parallel_size, ep_rank)):
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

def sglang_shards(spec: ModelSpec, tp: int, tp_rank: int, ep: int = 1) -> dict[str, ShardLayout]:
    """Every runtime parameter of SGLang TP rank `tp_rank` (of `ep` expert-parallel groups), by SGLang's fused
    runtime names (experts: one tensor per expert, see the module docstring)."""
    validate_tp(spec, tp, "generator", allow_kv_replication=True)
    validate_experts(spec, ep, tp // ep if tp % ep == 0 else 1, "--rollout-expert-parallel-size",
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
