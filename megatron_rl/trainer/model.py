"""Llama/Qwen2-style GPT on Megatron-Core: RMSNorm, SwiGLU, RoPE, grouped-query attention.

Everything about the model's shape on this rank comes from the run's `TrainerLayout`: TP and PP sizes, the
layers of each pipeline stage (uneven first/last stages as Megatron-Core's `num_layers_in_first/last_
pipeline_stage`), vocabulary padding, and the layer spec (`--transformer-impl`: Megatron's local modules, or
Transformer Engine's, whose parameter names the layout mapping then uses). As in Megatron-LM, weights are created
on the rank's GPU unless `use_cpu_initialization` (Megatron's --use-cpu-initialization, always on for a CPU rank):
then every TP layout of the same seed holds the same full weights, which is what the parity tests rely on.
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
                       use_cpu_initialization: bool = True, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout.validate(spec)
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
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
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(transformer_impl: str):
    """Megatron-Core's layer spec for `--transformer-impl`; Transformer Engine must be importable for its spec."""
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_impl == "transformer_engine":
        if not have_transformer_engine():
            raise ValueError("--transformer-impl transformer_engine needs Transformer Engine and a CUDA device "
                             "(pip install 'megatron-rl[gpu]'); use --transformer-impl local without them")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


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
        transformer_layer_spec=layer_spec(layout.transformer_impl),
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
