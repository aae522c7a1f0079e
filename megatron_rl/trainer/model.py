"""Llama/Qwen2/Qwen3/Mistral-style GPT on Megatron-Core: RMSNorm, SwiGLU, RoPE, grouped-query attention, and the
mixture-of-experts Qwen3-MoE and Mixtral.

Everything about the model's shape on this rank comes from the run's `TrainerLayout`: TP and PP sizes, the
layers of each pipeline stage (uneven first/last stages as Megatron-Core's `num_layers_in_first/last_
pipeline_stage`), vocabulary padding, and the layer spec (`--transformer-impl`: Megatron's local modules, or
Transformer Engine's, whose parameter names the layout mapping then uses). As in Megatron-LM, weights are created
on the rank's GPU unless `use_cpu_initialization` (Megatron's --use-cpu-initialization, always on for a CPU rank):
then every TP layout of the same seed holds the same full weights, which is what the parity tests rely on.

Architecture fields map to Megatron-Core's TransformerConfig: the head size (`kv_channels`, Qwen3's is not hidden /
heads), Qwen3's per-head q/k RMSNorm (`qk_layernorm`), Mistral's sliding window W (Megatron's `window_size` (W - 1,
0): each token sees itself and the W - 1 before it, which the local DotProductAttention's torch softmax and
Transformer Engine both apply), and experts. A mixture of experts is Megatron's MoE layer with a softmax router:
HF's top-k renormalized (`moe_norm_topk_prob`, Qwen3-MoE's norm_topk_prob and always Mixtral's) is top-k of the
logits then a softmax over those k (moe_router_pre_softmax False); without renormalization it is a softmax over all
experts, then top-k (moe_router_pre_softmax True). The router's load-balancing loss is Megatron's "aux_loss" with
`moe_aux_loss_coeff` (--moe-aux-loss-coeff, 0: none). Experts are Megatron's local SequentialMLP in the local spec
and Transformer Engine's grouped GEMM in its spec, whose parameter names models.layout maps.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megatron_rl.models.layout import TrainerLayout
from megatron_rl.models.spec import ModelSpec


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def transformer_config(spec: ModelSpec, layout: TrainerLayout, *, params_dtype: torch.dtype = torch.float32,
                       use_cpu_initialization: bool = True, moe_aux_loss_coeff: float = 0.0, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout.validate(spec)
    moe = {}
    if spec.is_moe:
        moe = dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                   moe_router_topk=spec.moe_router_topk, moe_router_pre_softmax=not spec.moe_norm_topk_prob,
                   moe_router_dtype="fp32",  # routes in fp32 whatever the compute dtype, as the built-in engine does
                   moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe_aux_loss_coeff,
                   moe_token_dispatcher_type=layout.moe_token_dispatcher_type,
                   moe_grouped_gemm=layout.transformer_engine,
                   expert_model_parallel_size=layout.expert_model_parallel_size,
                   expert_tensor_parallel_size=layout.expert_tp)
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        qk_layernorm=spec.qk_layernorm,
        window_size=(spec.sliding_window - 1, 0) if spec.sliding_window else None,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=layout.tensor_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_parallel_size,
        num_layers_in_first_pipeline_stage=layout.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=layout.decoder_last_pipeline_num_layers,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=use_cpu_initialization,
        init_method_std=0.02,
        sequence_parallel=layout.sequence_parallel,
        recompute_granularity=layout.recompute_granularity,
        recompute_method=layout.recompute_method,
        recompute_num_layers=layout.recompute_num_layers,
        **moe,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(transformer_impl: str, spec: ModelSpec | None = None):
    """Megatron-Core's layer spec for `--transformer-impl` and the model's q/k norms and experts (Transformer
    Engine's experts are its grouped GEMM, the names models.layout uses); Transformer Engine must be importable
    for its spec."""
    from megatron.core.models.gpt import gpt_layer_specs

    options = dict(num_experts=spec.num_experts or None, qk_layernorm=spec.qk_layernorm) if spec is not None else {}
    if transformer_impl == "transformer_engine":
        if not have_transformer_engine():
            raise ValueError("--transformer-impl transformer_engine needs Transformer Engine and a CUDA device "
                             "(pip install 'megatron-rl[gpu]'); use --transformer-impl local without them")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            moe_grouped_gemm=bool(options.get("num_experts")), **options)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **options)


def build_gpt_model(spec: ModelSpec, layout: TrainerLayout, config=None, *, max_sequence_length: int | None = None):
    """Build this rank's part of the model (its TP shard of its PP stage)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = config or transformer_config(spec, layout)
    rope_scaling = spec.rope_scaling is not None
    if rope_scaling and (spec.rope_scaling["low_freq_factor"], spec.rope_scaling["high_freq_factor"],
                         spec.rope_scaling["original_max_position_embeddings"]) != (1.0, 4.0, 8192):
        raise ValueError(f"model {spec.name!r}: Megatron-Core supports only Llama-3.1 rope_scaling constants")
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(layout.transformer_impl, spec),
        vocab_size=spec.padded_vocab_size(layout.tensor_parallel_size, layout.make_vocab_size_divisible_by),
        max_sequence_length=max_sequence_length or spec.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rope_scaling=rope_scaling,
        rope_scaling_factor=spec.rope_scaling["factor"] if rope_scaling else 8.0,
    )
