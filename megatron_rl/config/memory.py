"""Memory per GPU, estimated from the model and the layouts alone (what `--dry-run` prints): the trainer's weights,
gradients, optimizer state and activations, and the generators' weights.

Static memory: the busiest trainer rank (the maximum over every pipeline stage, TP rank and, with expert
parallelism, the data-parallel ranks that hold different experts; exact shards from the layout mapping, vocabulary
padding included, and only the rank's own experts) holds its weights (2 bytes in bf16, 4 in fp32), fp32 gradients
(4; 2 with --grad-reduce-in-bf16) and Adam's fp32 main weights and two moments (12 in bf16, 8 in fp32). With the
distributed optimizer the latter are split over the data-parallel group: DP ranks for the dense parameters, and for
the experts the expert-data-parallel group of Megatron-Core, TP x DP / (EP x ETP) ranks (the ranks that hold the
same expert shard). With --kl-coef, also the frozen reference model's weights (the same shard, in the same dtype). A
generator TP rank (the busiest one, its experts only with --rollout-expert-parallel-size) holds its runtime weights:
1 byte per parameter of block-FP8 linear weights (plus their scales) and 2 bytes for the rest; its KV cache is
SGLang's (--mem-fraction-static of what is left).

Activations: what autograd keeps for the backward pass of one training micro-batch, counted per layer and token
from what each module of the layer spec saves (`layer_elements_per_token`), times the tokens of a micro-batch (the
token budget --max-tokens-per-gpu when packing, else --micro-batch-size rows of --seq-length: the worst case), times
the micro-batches a stage holds at once under the 1F1B pipeline schedule (PP - stage), less what
--recompute-granularity recomputes; plus, on the last stage, the logits [tokens, V / TP] and three fp32 chunk-sized
temporaries of the log-prob computation. TP splits what runs inside the tensor-parallel region; the norms' inputs
and outputs are split too only with --sequence-parallel. A forward-only pass (log-probs, the KL reference) keeps no
activations: one layer's working set and the logits of its --log-probs-max-tokens-per-gpu tokens.

The model's error: on the local spec (CPU, fp32) it is within 5% (at most 3.1% over, 0.3% under) of the bytes
autograd actually saves, measured by tests/cpu/test_memory_estimate.py for a Llama and a Qwen3 shape at TP 1 and 2
and each recompute mode. Sequence parallelism (which the local spec's torch norms do not support) and Transformer
Engine (fused norm + linear, flash attention, fused SwiGLU) follow the same accounting of what their modules save,
unchecked on a GPU. What it leaves out: the backward pass's transient gradients (about one layer's worth), the
CUDA context, NCCL buffers and allocator fragmentation; `FIT_FRACTION` of a GPU's memory is what it may fill.
A mixture of experts assumes balanced routing (an expert rank sees its share of top-k x tokens).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.models import weight_map
from megatron_rl.models.fp8 import is_fp8_weight, scale_shape
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.trainer import CHUNK_TOKENS

GIB = 2**30
GPUS = {"A100 40GB": 40.0, "A100/H100 80GB": 79.6, "H200": 140.4}  # GiB each reports
FIT_FRACTION = 0.9  # of a GPU's memory the estimate may fill; the rest is what it leaves out


def is_expert_param(megatron_name: str) -> bool:
    """A Megatron expert weight (local spec `mlp.experts.local_experts.j.*`, Transformer Engine's grouped GEMM
    `mlp.experts.linear_fc1.weightj`); the router is replicated and counts as dense."""
    return ".mlp.experts." in megatron_name


def expert_data_parallel_size(layout: TrainerLayout) -> int:
    """Megatron-Core's expert-data-parallel size: the ranks of a stage holding the same expert shard."""
    return layout.tensor_parallel_size * layout.data_parallel_size // (layout.expert_model_parallel_size
                                                                       * layout.expert_tp)


@dataclasses.dataclass(frozen=True)
class MicroBatchShape:
    """The largest micro-batches a step runs: `tokens` in a training one, `attention_span` the longest sequence one
    attention score matrix covers (a packed row on the local spec is one matrix), `logprob_tokens` in a forward-only
    one."""

    tokens: int
    attention_span: int
    logprob_tokens: int

    @classmethod
    def from_args(cls, args) -> MicroBatchShape:
        if args.use_dynamic_batch_size:
            logprob = args.log_probs_max_tokens_per_gpu or args.max_tokens_per_gpu
            return cls(args.max_tokens_per_gpu, args.max_tokens_per_gpu, logprob)
        return cls(args.micro_batch_size * args.seq_length, args.seq_length, args.micro_batch_size * args.seq_length)


def layer_elements_per_token(spec, layout: TrainerLayout, attention_span: int) -> tuple[float, float]:
    """(elements in the activation dtype, bytes of masks) one layer saves for its backward, per token of a micro-batch
    on one rank, with neither recompute nor selective recompute."""
    tp, local = layout.tensor_parallel_size, layout.transformer_impl == "local"
    h, d, heads, kv = spec.hidden_size, spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
    # Each of the two norms keeps its input and its output (the next linear's input); the local spec's composite
    # RMSNorm also its normalized input. Outside the TP region: split only under sequence parallelism.
    norms = (6 if local else 4) * h
    rotary = 4 * d if local else 0  # the local spec's cos / sin of each position, per query and key
    replicated = (norms + rotary) / (tp if layout.sequence_parallel else 1)
    # q, k, v and the attention's output (the projection's input). The local spec repeats k and v to every query
    # head, except under selective recompute, whose checkpoint keeps q and k as rotated and v in the fused QKV output.
    selective = layout.recompute_granularity == "selective"
    qkv_output = (heads + 2 * kv) * d
    if not local:
        attention = heads * d * 2 + kv * d * 2
    else:
        attention = heads * d * 2 + kv * d + qkv_output if selective else heads * d * 4
    if spec.qk_layernorm:  # the norms' input (the fused QKV output); the local spec's also their outputs, and q's
        # input is a copy when a rank holds several KV groups (q is then no contiguous slice of the QKV output)
        q_copy = heads * d if kv > tp else 0
        attention += qkv_output if not local else q_copy + heads * d + kv * d + (0 if selective else qkv_output)
    masks = 0.0
    if local and not selective:  # softmax probabilities and the mask they used
        attention += heads * attention_span
        masks = attention_span  # [s, s] bool on every TP rank
    mlp_factor = 5 if local else 3  # fc1's [gate, up] output and fc2's input; the local SwiGLU also silu(gate), up
    if spec.is_moe:  # router logits, the permuted tokens (the experts' input), each token's top-k experts' MLPs
        topk = spec.moe_router_topk
        mlp = spec.num_experts + topk * h + topk * mlp_factor * spec.moe_ffn_hidden_size
    else:
        mlp = mlp_factor * spec.ffn_hidden_size
    return replicated + (attention + mlp) / tp, masks


def stage_activation_bytes(spec, layout: TrainerLayout, stage: int, shape: MicroBatchShape, dtype_bytes: int
                           ) -> dict:
    """Activation memory of pipeline stage `stage`: `saved_per_micro_batch` (what autograd keeps of one training
    micro-batch: the layers' activations or checkpoints, and on the last stage the logits and the final norm's),
    `transient` (one recomputed group of layers in the backward; the log-prob temporaries), `train_bytes` (the peak
    of a training step: `in_flight` micro-batches saved at once) and `forward_only_bytes` (a log-prob pass)."""
    layers = layout.stage_sizes(spec)[stage]
    elements, masks = layer_elements_per_token(spec, layout, shape.attention_span)
    layer = shape.tokens * (elements * dtype_bytes + masks)
    sp_split = layout.tensor_parallel_size if layout.sequence_parallel else 1
    checkpoint = shape.tokens * spec.hidden_size * dtype_bytes / sp_split
    saved, transient = layers * layer, 0.0
    if layout.recompute_granularity == "full":
        n = layout.recompute_num_layers or 1
        if layout.recompute_method == "block":
            n = min(n, layers)
            saved, transient = n * checkpoint + (layers - n) * layer, layer if n else 0.0
        else:  # uniform: one checkpoint per group of n layers, a group recomputed at a time
            saved, transient = math.ceil(layers / n) * checkpoint, min(n, layers) * layer
    vocab = spec.padded_vocab_size(layout.tensor_parallel_size, layout.make_vocab_size_divisible_by)
    vocab /= layout.tensor_parallel_size
    last = stage == layout.pipeline_parallel_size - 1

    def logits(tokens: int) -> tuple[float, float]:  # (saved: the logits, the final norm's; the log-prob temporaries)
        if not last:
            return 0.0, 0.0
        norm = tokens * (3 if layout.transformer_impl == "local" else 2) * spec.hidden_size * dtype_bytes / sp_split
        return tokens * vocab * dtype_bytes + norm, 3 * min(CHUNK_TOKENS, tokens) * vocab * 4

    head_saved, head_transient = logits(shape.tokens)
    # per token, once per stage: its id, the rotary table (fp32), the log-prob statistics (targets, lse, ...)
    saved += head_saved + shape.tokens * (8 + 4 * spec.head_dim + (17 if last else 0))
    transient += head_transient
    in_flight = layout.pipeline_parallel_size - stage  # 1F1B: micro-batches whose backward has not run yet
    forward_only = shape.logprob_tokens * (elements * dtype_bytes + masks) + sum(logits(shape.logprob_tokens))
    return {"layers": layers, "in_flight": in_flight, "saved_per_micro_batch": saved, "transient": transient,
            "train_bytes": in_flight * saved + transient, "forward_only_bytes": forward_only}


def trainer_memory(spec, layout: TrainerLayout, bf16: bool, distributed_optimizer: bool, reference: bool = False,
                   shape: MicroBatchShape | None = None, grad_bytes: int = 4) -> dict:
    """The busiest trainer rank's memory (see the module docstring); activations too when `shape` is given.
    `grad_bytes`: 2 with --grad-reduce-in-bf16."""
    weight_bytes, adam_bytes = (2, 12) if bf16 else (4, 8)
    dp, edp = layout.data_parallel_size, expert_data_parallel_size(layout)
    busiest = None
    # Every stage and TP rank; with experts also the DP ranks that hold different ones (EP ranks repeat after
    # expert_replica_span data-parallel ranks).
    for pp in range(layout.pipeline_parallel_size):
        activations = stage_activation_bytes(spec, layout, pp, shape, weight_bytes) if shape else None
        peak_activations = max(activations["train_bytes"], activations["forward_only_bytes"]) if shape else 0.0
        for dp_rank in range(layout.expert_replica_span if spec.is_moe else 1):
            for tp in range(layout.tensor_parallel_size):
                shards = weight_map.megatron_shards(spec, layout, tp, pp, dp_rank)
                experts = sum(s.numel for n, s in shards.items() if is_expert_param(n))
                dense = sum(s.numel for s in shards.values()) - experts
                optimizer = (dense * adam_bytes / dp + experts * adam_bytes / edp if distributed_optimizer
                             else (dense + experts) * adam_bytes)
                params = dense + experts
                static = params * (weight_bytes + grad_bytes + (weight_bytes if reference else 0)) + optimizer
                if busiest is None or static + peak_activations > busiest[0] + busiest[5]:
                    busiest = (static, params, experts, optimizer, (pp, tp, dp_rank), peak_activations, activations)
    total, params, experts, optimizer, (pp, tp, dp_rank), peak_activations, activations = busiest
    weights = params * weight_bytes
    out = {"params": params, "expert_params": experts, "rank": layout.rank(dp_rank, pp, tp), "stage": pp,
           "expert_data_parallel": edp, "weights_gib": weights / GIB, "grads_gib": params * grad_bytes / GIB,
           "optimizer_gib": optimizer / GIB, "reference_gib": (weights if reference else 0) / GIB,
           "total_gib": total / GIB}
    if shape is not None:
        out.update(activations_gib=activations["train_bytes"] / GIB,
                   forward_only_gib=activations["forward_only_bytes"] / GIB,
                   micro_batches_in_flight=activations["in_flight"], tokens_per_micro_batch=shape.tokens,
                   peak_gib=(total + peak_activations) / GIB, fits=fitting_gpus((total + peak_activations) / GIB))
    return out


def fitting_gpus(gib: float) -> list[str]:
    """The GPUs of `GPUS` whose memory holds `gib` within `FIT_FRACTION`."""
    return [name for name, memory in GPUS.items() if gib <= FIT_FRACTION * memory]


def generator_memory(spec, tp: int, fp8: bool, ep: int = 1) -> dict:
    busiest = None
    for rank in range(tp):
        shards = weight_map.sglang_shards(spec, tp, rank, ep)
        params = sum(s.numel for s in shards.values())
        quantized = {n: s for n, s in shards.items() if fp8 and is_fp8_weight(n)}
        fp8_params = sum(s.numel for s in quantized.values())
        scales = sum(math.prod(scale_shape(s.shape)) for s in quantized.values())
        total = fp8_params + scales * 4 + (params - fp8_params) * 2
        if busiest is None or total > busiest["weights_gib"] * GIB:
            busiest = {"params": params, "weights_gib": total / GIB, "tp_rank": rank}
    return busiest
