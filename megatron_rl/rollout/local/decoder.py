"""The built-in engine's decoder: Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE and Mixtral over a TP group, holding
SGLang's runtime parameters.

Each TP rank holds exactly what an SGLang TP rank holds (names and shapes from `models.weight_map.sglang_shards`):
fused `qkv_proj` = [q_r; k_r; v_r], `gate_up_proj` = [gate_r; up_r], row-parallel `o_proj` / `down_proj`,
vocab-parallel `embed_tokens` / `lm_head` (padded to 64), replicated norms (Qwen3's per-head `q_norm` /
`k_norm` too). Weight updates therefore arrive in the layout DDMA sends to SGLang.

Architecture fields (`models.spec`): the head size is `spec.head_dim`; Qwen3's q/k norms are an RMSNorm over
each query and key head before RoPE; Mistral's `sliding_window` W lets each position attend to itself and the
W - 1 positions before it (a mask over the full KV cache, which keeps every position).

Mixture of experts: the router (replicated) scores every token in fp32, softmax over all experts, top-k, the
k weights renormalized to sum to one when `moe_norm_topk_prob`. With SGLang's --ep-size semantics
(`layout.generator_experts`) a rank holds E / EP experts, each as its expert-TP slice ([gate; up] rows and
`down_proj` columns); it runs its experts on the tokens routed to them, and the existing TP all-reduce of the
MLP output sums the partial outputs of every rank (expert-TP slices and other ranks' experts alike). Every
rank routes identically (same replicated router, same all-reduced input).

Routes: a forward pass of a mixture-of-experts model leaves `last_routes`, int32 [S, T, layers, top-k]: for
each of its tokens the experts chosen in each layer, i.e. the route that computed that position's hidden state
(None for a dense model). The engine keeps them per request.

KV cache: one pool of `kv_cache_tokens` token positions [layers, tokens, kv_heads_local, head_dim], as SGLang's
token-to-KV pool (page size 1): its size is a token budget, not slots x max length. A slot (a running request)
holds the pool positions `reserve` gave it; `forward` writes each new token's K/V at its slot's position and
gathers each slot's keys and values for attention by those positions. A forward pass takes any set of slots, each
with its own start position, so decode steps batch requests of different lengths (continuous batching) and a
prefill is the same call with more tokens. The gather and write indices are built once per forward pass from
host-side lengths: no layer waits for the device.

Weights, KV cache and activations live on the decoder's `device`; callers may pass inputs on any device and get
logits on the decoder's. Block-FP8 weights run FP8 tensor-core GEMMs where the GPU has them (`models.fp8`), and
are dequantized to the compute dtype elsewhere.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.models import weight_map
from megatron_rl.models.fp8 import (
    SCALE_SUFFIX,
    RowwiseFP8,
    dequantize_block_fp8,
    fp8_gemm_shape_ok,
    fp8_gemm_supported,
    is_fp8_weight,
    quantize_block_fp8,
    scale_shape,
)
from megatron_rl.models.parallelism import generator_experts, sglang_padded_vocab
from megatron_rl.models.spec import ModelSpec


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3.1 frequency scaling when the spec has it (as HF computes them)."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = spec.rope_scaling
    if rs is None:
        return inv_freq
    factor, low, high, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], \
        rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TPDecoder:
    def __init__(self, spec: ModelSpec, tp_size: int = 1, tp_rank: int = 0, group=None,
                 dtype: torch.dtype = torch.float32, fp8: bool = False, max_slots: int = 64, max_seq_len: int = 512,
                 device: torch.device | str = "cpu", ep_size: int = 1, kv_cache_tokens: int | None = None):
        """`ep_size`: SGLang's --ep-size (--rollout-expert-parallel-size), which must divide `tp_size`.
        `max_slots`: sequences decoded together; `kv_cache_tokens`: the KV pool's size in tokens, shared by them
        (default max_slots x max_seq_len, enough for every slot at full length)."""
        self.spec, self.tp_size, self.tp_rank, self.group = spec, tp_size, tp_rank, group
        self.dtype, self.fp8, self.device = dtype, fp8, torch.device(device)
        # FP8 tensor-core GEMMs (row-wise scales) where the device has them; else dequantize to `dtype`.
        self.fp8_gemm = fp8 and fp8_gemm_supported(self.device)
        self.ep_size = ep_size
        self.layouts = weight_map.sglang_shards(spec, tp_size, tp_rank, ep_size)
        # This rank's experts (global numbers, consecutive) and each layer's MoE names.
        self.experts = generator_experts(spec, tp_size, tp_rank, ep_size)[0] if spec.is_moe else range(0)
        self.moe_names = [weight_map.hf_moe_names(spec, i) for i in range(spec.num_layers)] if spec.is_moe else []
        self.last_routes: torch.Tensor | None = None
        self._expected = self._expected_tensors()
        self.padded_vocab = sglang_padded_vocab(spec, tp_size)
        self.q_heads = spec.num_attention_heads // tp_size
        self.kv_heads = max(spec.num_key_value_heads // tp_size, 1)
        self.params: dict[str, torch.Tensor] = {}  # what was received, in the runtime layout (FP8 + scales)
        self._compute: dict[str, torch.Tensor | RowwiseFP8] = {}  # what the matmuls use
        self.max_slots, self.max_seq_len = max_slots, max_seq_len
        self.kv_cache_tokens = max_slots * max_seq_len if kv_cache_tokens is None else kv_cache_tokens
        if self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be positive, got {self.kv_cache_tokens}")
        shape = (spec.num_layers, self.kv_cache_tokens, self.kv_heads, spec.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self._free_positions = list(range(self.kv_cache_tokens - 1, -1, -1))  # a stack: lowest positions first
        self._positions: dict[int, tuple[list[int], torch.Tensor]] = {}  # slot -> its pool positions (host, device)
        self.inv_freq = rope_inv_freq(spec).to(self.device)

    # ---- weights -------------------------------------------------------------------------------------------------
    def expected(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Runtime tensor name -> (shape, kind) this rank accepts; kind "fp8"/"scale" in FP8 mode."""
        return self._expected

    def _expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {}
        for name, lay in self.layouts.items():
            if self.fp8 and is_fp8_weight(name):
                out[name] = (lay.shape, "fp8")
                out[name + SCALE_SUFFIX] = (scale_shape(lay.shape), "scale")
            else:
                out[name] = (lay.shape, "dense")
        return out

    def load(self, name: str, tensor: torch.Tensor, into: dict[str, torch.Tensor], copy: bool = True) -> None:
        """Check one runtime tensor and store it in `into` (a staging dict). In FP8 mode a dense linear
        weight is quantized on receipt; an FP8 weight comes with its `_scale_inv`."""
        expected = self.expected()
        if name not in expected:
            raise KeyError(f"generator TP rank {self.tp_rank}: unknown runtime tensor {name!r}")
        shape, kind = expected[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"generator TP rank {self.tp_rank}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {shape}")
        tensor = tensor.to(self.device)  # a no-op for what DDMA received on this device
        if kind == "fp8" and tensor.dtype != torch.float8_e4m3fn:
            into[name], into[name + SCALE_SUFFIX] = quantize_block_fp8(tensor)
        elif kind in ("fp8", "scale"):
            into[name] = tensor.clone() if copy else tensor
        else:
            converted = tensor.to(self.dtype)
            into[name] = converted.clone() if copy and converted is tensor else converted

    def install(self, params: dict[str, torch.Tensor]) -> None:
        """Make a complete staged set of tensors the serving weights. Raises (keeping the old weights) if any
        expected tensor is missing."""
        missing = sorted(set(self.expected()) - set(params))
        if missing:
            raise ValueError(f"generator TP rank {self.tp_rank}: weight update is missing {missing[:3]}"
                             f"{' ...' if len(missing) > 3 else ''}")
        compute = {}
        for name in self.layouts:
            if self.fp8 and is_fp8_weight(name):
                weight = dequantize_block_fp8(params[name], params[name + SCALE_SUFFIX], dtype=torch.float32)
                fast = self.fp8_gemm and fp8_gemm_shape_ok(weight.shape)
                compute[name] = RowwiseFP8.quantize(weight) if fast else weight.to(self.dtype)
            else:
                compute[name] = params[name]
        self.params, self._compute = params, compute

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W.T for the runtime weight `name` (an FP8 GEMM for a row-wise FP8 weight)."""
        weight = self._compute[name]
        if isinstance(weight, RowwiseFP8):
            return weight.linear(x)
        return x @ weight.T

    # ---- KV pool ------------------------------------------------------------------------------------------------
    @staticmethod
    def kv_bytes_per_token(spec: ModelSpec, tp_size: int, dtype: torch.dtype) -> int:
        """KV cache bytes one token takes on one TP rank (keys and values of every layer)."""
        kv_heads = max(spec.num_key_value_heads // tp_size, 1)
        return 2 * spec.num_layers * kv_heads * spec.head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def free_kv_tokens(self) -> int:
        return len(self._free_positions)

    def reserve(self, slot: int, num_tokens: int) -> bool:
        """Give `slot` pool positions for `num_tokens` tokens (its whole sequence); False, changing nothing, when
        the pool has fewer free."""
        if slot in self._positions:
            raise RuntimeError(f"KV slot {slot} already holds positions: release it first")
        if num_tokens > len(self._free_positions):
            return False
        taken = [self._free_positions.pop() for _ in range(num_tokens)]
        self._positions[slot] = (taken, torch.tensor(taken, dtype=torch.long, device=self.device))
        return True

    def release(self, slot: int) -> None:
        """Return `slot`'s pool positions (nothing to do for a slot that holds none)."""
        taken, _ = self._positions.pop(slot, ([], None))
        self._free_positions.extend(reversed(taken))

    def _indices(self, slots: list[int], starts: list[int], lengths: list[int], T: int, kv_len: int):
        """(write: pool position of each new token whose row in [S * T] is listed in `rows`, rows, read: [S, kv_len]
        pool positions of each slot's keys, its own ones first and then position 0 where it is shorter, masked)."""
        writes, rows, reads = [], [], []
        pad = torch.zeros(kv_len, dtype=torch.long, device=self.device)
        for s, (slot, start, length) in enumerate(zip(slots, starts, lengths)):
            if slot not in self._positions:
                raise RuntimeError(f"KV slot {slot} holds no pool positions: reserve them first")
            host, positions = self._positions[slot]
            if start + length > len(host):
                raise ValueError(f"KV slot {slot}: {start + length} tokens, but {len(host)} positions reserved")
            writes.append(positions[start:start + length])
            rows.append(torch.arange(s * T, s * T + length, device=self.device))
            own = positions[:min(start + T, len(host))]
            reads.append(torch.cat([own, pad[:kv_len - len(own)]]))
        return torch.cat(writes), torch.cat(rows), torch.stack(reads)

    # ---- forward ------------------------------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self._compute["model.embed_tokens.weight"]
        per = w.shape[0]
        start = self.tp_rank * per
        local = tokens - start
        inside = (local >= 0) & (local < per)
        x = F.embedding(local.clamp(0, per - 1), w) * inside.unsqueeze(-1)
        return self._all_reduce(x.contiguous())

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.spec.norm_eps)).to(self.dtype) * self._compute[name]

    def _moe(self, h: torch.Tensor, layer: int, routes: torch.Tensor) -> torch.Tensor:
        """This rank's share of the mixture of experts of `layer` for h [S, T, H]: the sum over its experts of
        routing weight x expert(h) for the tokens routed to each (the caller all-reduces it over the TP group).
        Writes the chosen experts into routes[:, layer] ([S * T, layers, k])."""
        spec, moe = self.spec, self.moe_names[layer]
        k, flat = spec.moe_router_topk, h.reshape(-1, h.shape[-1])
        logits = flat.float() @ self._compute[moe.router_weight].float().T
        weights, chosen = torch.softmax(logits, -1).topk(k, dim=-1)
        if spec.moe_norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        routes[:, layer] = chosen
        # (token, choice) pairs grouped by expert: one host sync per layer for the group sizes
        pairs = chosen.reshape(-1)
        order = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=spec.num_experts).tolist()
        weights = weights.reshape(-1)
        out = torch.zeros_like(flat)
        offset = sum(counts[:self.experts.start])
        for e in self.experts:
            if counts[e]:
                pair = order[offset:offset + counts[e]]
                token = pair // k
                gate, up = self._linear(flat[token], f"{moe.module}.experts.{e}.gate_up_proj.weight").chunk(2, dim=-1)
                y = self._linear(F.silu(gate) * up, f"{moe.module}.experts.{e}.down_proj.weight")
                out.index_add_(0, token, y * weights[pair].unsqueeze(-1).to(y.dtype))
            offset += counts[e]
        return out.view_as(h)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [S, T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype).unsqueeze(1), emb.sin().to(x.dtype).unsqueeze(1)  # [S, 1, T, d]
        return x * cos + _rotate_half(x) * sin

    @torch.no_grad()
    def forward(self, slots: list[int], tokens: torch.Tensor, starts: list[int],
                lengths: list[int] | None = None) -> torch.Tensor:
        """tokens [S, T] (right-padded) at positions starts[s] .. starts[s] + T - 1 of each slot; returns
        full-vocabulary logits [S, T, vocab] (fp32). Caches K/V of each slot's first lengths[s] tokens (default
        all T) at its reserved pool positions; the padding after them is neither cached nor attended to by real
        tokens. A mixture of experts leaves the experts each token was routed to in `last_routes`
        [S, T, layers, k] (int32)."""
        spec, d = self.spec, self.spec.head_dim
        S, T = tokens.shape
        starts = [int(s) for s in starts]
        lengths = [T] * S if lengths is None else list(lengths)
        if max(starts) + T > self.max_seq_len:
            raise ValueError(f"sequence of {max(starts) + T} tokens exceeds the engine's max_seq_len "
                             f"{self.max_seq_len}")
        tokens = tokens.to(self.device)
        kv_len = max(starts) + T
        write, rows, read = self._indices(slots, starts, lengths, T, kv_len)
        starts_t = torch.tensor(starts, dtype=torch.long, device=self.device)
        positions = starts_t.unsqueeze(1) + torch.arange(T, device=self.device).unsqueeze(0)  # [S, T]
        key_pos = torch.arange(kv_len, device=self.device)
        mask = key_pos.view(1, 1, 1, -1) <= positions.view(S, 1, T, 1)  # causal over the cached prefix
        if spec.sliding_window is not None:  # itself and the sliding_window - 1 positions before it
            mask &= key_pos.view(1, 1, 1, -1) > positions.view(S, 1, T, 1) - spec.sliding_window
        routes = torch.empty(S * T, spec.num_layers, spec.moe_router_topk, dtype=torch.int32, device=self.device) \
            if spec.is_moe else None
        q_size, kv_size = self.q_heads * d, self.kv_heads * d
        x = self._embed(tokens)
        for i in range(spec.num_layers):
            p = f"model.layers.{i}"
            h = self._norm(x, f"{p}.input_layernorm.weight")
            qkv = self._linear(h, f"{p}.self_attn.qkv_proj.weight")
            if spec.qkv_bias:
                qkv = qkv + self._compute[f"{p}.self_attn.qkv_proj.bias"]
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = q.view(S, T, self.q_heads, d), k.view(S, T, self.kv_heads, d)
            if spec.qk_layernorm:  # per head, before RoPE
                q, k = self._norm(q, f"{p}.self_attn.q_norm.weight"), self._norm(k, f"{p}.self_attn.k_norm.weight")
            q = self._rope(q.transpose(1, 2), positions)
            k = self._rope(k.transpose(1, 2), positions)
            v = v.view(S, T, self.kv_heads, d)
            self.k_cache[i].index_copy_(0, write, k.transpose(1, 2).reshape(S * T, self.kv_heads, d)[rows])
            self.v_cache[i].index_copy_(0, write, v.reshape(S * T, self.kv_heads, d)[rows])
            keys = self.k_cache[i][read].transpose(1, 2)  # [S, kv_heads, kv_len, d]
            values = self.v_cache[i][read].transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                  enable_gqa=self.q_heads != self.kv_heads)
            attn = attn.transpose(1, 2).reshape(S, T, q_size)
            x = x + self._all_reduce(self._linear(attn, f"{p}.self_attn.o_proj.weight").contiguous())
            h = self._norm(x, f"{p}.post_attention_layernorm.weight")
            if spec.is_moe:
                x = x + self._all_reduce(self._moe(h, i, routes).contiguous())
                continue
            gate, up = self._linear(h, f"{p}.mlp.gate_up_proj.weight").chunk(2, dim=-1)
            x = x + self._all_reduce(self._linear(F.silu(gate) * up, f"{p}.mlp.down_proj.weight").contiguous())
        self.last_routes = None if routes is None else routes.view(S, T, spec.num_layers, spec.moe_router_topk)
        x = self._norm(x, "model.norm.weight")
        head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        logits = (x @ self._compute[head].T).float().contiguous()
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits, group=self.group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., : spec.vocab_size]
