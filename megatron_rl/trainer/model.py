"""Llama/Qwen2/Qwen3/Mistral-style GPT on Megatron-Core: RMSNorm, SwiGLU, RoPE, grouped-query attention, and the
mixture-of-experts Qwen3-MoE and Mixtral.

Everything about the model's shape on this rank comes from the run's `TrainerLayout`: TP and PP sizes, the
layers of each pipeline stage (uneven first/last stages as Megatron-Core's `num_layers_in_first/last_
pipeline_stage`), vocabulary padding, and the layer spec (`--transformer-impl`: Megatron's local modules, or
Transformer Engine's, whose parameter names the layout mapping then uses). As in Megatron-LM, weights are created
on the rank's GPU unless `use_cpu_initialization` (Megatron's --use-cpu-initialization, always on for a CPU rank):
then every TP layout of the same seed holds the same full weights, which is what the parity tests rely on.

The TransformerConfig itself is `models.megatron_config.transformer_config` (built by the run setup too, for
Megatron-Core's checks). Experts are Megatron's local SequentialMLP in the local spec and Transformer Engine's grouped
GEMM in its spec, whose parameter names `models.weight_map` maps.
"""

from __future__ import annotations

import importlib.util

import torch

from megatron_rl.models.megatron_config import transformer_config
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import ModelSpec


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def layer_spec(transformer_impl: str, spec: ModelSpec | None = None):
    """Megatron-Core's layer spec for `--transformer-impl` and the model's q/k norms and experts (Transformer
    Engine's experts are its grouped GEMM, the names models.weight_map uses); Transformer Engine must be importable
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
