"""The model as Megatron-Core's `TransformerConfig`: every field of a `ModelSpec` and a `TrainerLayout` that
Megatron-Core takes, in one place. The trainer builds its GPTModel from it, and the run setup builds it before any
weight exists so that Megatron-Core's own checks (uneven pipeline stages included) run at start.

Architecture fields map to Megatron-Core's TransformerConfig: the head size (`kv_channels`, Qwen3's is not hidden /
heads), Qwen3's per-head q/k RMSNorm (`qk_layernorm`), Mistral's sliding window W (Megatron's `window_size` (W - 1,
0): each token sees itself and the W - 1 before it), and experts. A mixture of experts is Megatron's MoE layer with
a softmax router: HF's top-k renormalized (`moe_norm_topk_prob`, Qwen3-MoE's norm_topk_prob and always Mixtral's) is
top-k of the logits then a softmax over those k (moe_router_pre_softmax False); without renormalization it is a
softmax over all experts, then top-k (moe_router_pre_softmax True). The router's load-balancing loss is Megatron's
"aux_loss" with `moe_aux_loss_coeff` (--moe-aux-loss-coeff, 0: none).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from megatron_rl.models.parallelism import KERNEL_FUSIONS, TrainerLayout
from megatron_rl.models.spec import ModelSpec


def transformer_config(spec: ModelSpec, layout: TrainerLayout, *, params_dtype: torch.dtype = torch.float32,
                       use_cpu_initialization: bool = True, moe_aux_loss_coeff: float = 0.0, fused: bool = False,
                       **overrides):
    """`fused`: turn on the layout's kernel fusions (the trainer on a GPU with Transformer Engine: their kernels are
    TE's and CUDA's; `fusion_fields`)."""
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
    else:  # unused without experts; Megatron-Core refuses its default (allgather) with variable_seq_lengths
        moe = dict(moe_token_dispatcher_type="alltoall")
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
        persist_layer_norm=False,
        **fusion_fields(layout, fused),
        tensor_model_parallel_size=layout.tensor_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_parallel_size,
        num_layers_in_first_pipeline_stage=layout.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=layout.decoder_last_pipeline_num_layers,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        # micro-batches are as long as their own rows (or packed by a token budget): stages send shapes first
        variable_seq_lengths=layout.pipeline_parallel_size > 1,
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


def fusion_fields(layout: TrainerLayout, fused: bool) -> dict[str, bool]:
    """TransformerConfig's kernel-fusion fields: the layout's (Megatron-LM's defaults, less its --no-*-fusion flags)
    when `fused` and the layer spec is Transformer Engine's, else all off (the local spec on a CPU has none of the
    kernels)."""
    on = set(layout.kernel_fusions) if fused and layout.transformer_engine else set()
    return {name: name in on for name in KERNEL_FUSIONS.values()}


def check_megatron_config(spec: ModelSpec, trainer: TrainerLayout) -> None:
    """Build the TransformerConfig the trainer will build: Megatron-Core's own checks run here too."""
    import warnings

    try:
        with warnings.catch_warnings():  # Megatron-Core's deprecation notes: the trainer prints them when it builds
            warnings.simplefilter("ignore")
            transformer_config(spec, trainer,
                               params_dtype=torch.bfloat16 if trainer.dtype_bytes == 2 else torch.float32)
    except (ValueError, AssertionError) as e:
        raise ValueError(f"Megatron-Core refuses the trainer layout ({trainer.describe()}, model {spec.name!r}): "
                         f"{e}") from None
    if spec.is_moe and trainer.tensor_parallel_size > 1 and not trainer.sequence_parallel:
        raise ValueError(f"a mixture of experts with --tensor-model-parallel-size {trainer.tensor_parallel_size} "
                         "trains only with --sequence-parallel (Megatron-Core's MoE layer refuses tensor parallelism "
                         "without it in training), which needs Transformer Engine or Apex norms; without them keep "
                         "--tensor-model-parallel-size 1 and split the experts with --expert-model-parallel-size and "
                         "--expert-tensor-parallel-size")
    if trainer.sequence_parallel and not trainer.transformer_engine and importlib.util.find_spec("apex") is None:
        raise ValueError("--sequence-parallel needs norms that Megatron-Core can run on sequence shards: "
                         "--transformer-impl transformer_engine, or Apex for the local spec (its torch norm refuses "
                         "sequence parallelism)")
