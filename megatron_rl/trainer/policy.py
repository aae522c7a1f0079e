"""The policy as Megatron-Core trains it: GPTModel in DDP, Megatron's optimizer, and the micro-batch
runner over Megatron's pipeline schedules (`get_forward_backward_func`).

Loss normalization is exact across micro-batches and data-parallel ranks: the caller's `loss_fn` returns
a SUM over its tokens already divided by the global normalizer (for example the number of valid tokens in
the whole global batch); the runner multiplies by the number of micro-batches and the DP size, which is
exactly what Megatron's schedule (divides by micro-batches) and DDP (averages over DP) then undo.

A mixture of experts adds its routers' load-balancing loss (--moe-aux-loss-coeff) as Megatron-LM does: each
micro-batch's router attaches coeff x its aux loss to the backward pass (MoEAuxLossAutoScaler), scaled by the
schedule by 1 / micro-batches and averaged over DP by DDP, so the step's aux loss is coeff x the mean over all
its micro-batches (every DP rank's) of each micro-batch's own load-balancing loss, whatever the layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.models.megatron_config import transformer_config
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import ModelSpec
from megatron_rl.trainer import packing, routing_replay
from megatron_rl.trainer.model import build_gpt_model


@dataclasses.dataclass
class Policy:
    spec: ModelSpec
    layout: TrainerLayout
    model: Any  # megatron DistributedDataParallel around GPTModel
    optimizer: Any  # megatron MegatronOptimizer
    config: Any  # TransformerConfig
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))  # parameters and batches

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel (this rank's shard)."""
        return self.model.module


def build_policy(
    spec: ModelSpec,
    layout: TrainerLayout,
    *,
    lr: float = 1e-5,
    min_lr: float = 0.0,
    optimizer: str = "adam",
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    bf16: bool = False,
    use_distributed_optimizer: bool = False,
    init_weights: Callable[[torch.nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    use_cpu_initialization: bool = False,
    routing_replay: bool = False,
    moe_aux_loss_coeff: float = 0.0,
    overlap_grad_reduce: bool = False,
    grad_reduce_in_bf16: bool = False,
) -> Policy:
    """Build this rank's model shard on `device` (default: the current CUDA device, else the CPU), wrap it in
    Megatron DDP and create Megatron's optimizer.

    bf16 follows Megatron: bf16 parameters and compute, gradients reduced and accumulated in fp32 (`main_grad`;
    in bf16 with `grad_reduce_in_bf16`), fp32 main parameters and Adam states in the optimizer.
    `overlap_grad_reduce`: Megatron DDP reduces each bucket during the last backward. `init_weights(module)` runs
    before the DDP wrapper copies parameters into its buffers (e.g. loading HF weights). The weights are initialized
    on the CPU first when `use_cpu_initialization` or `device` is the CPU. `moe_aux_loss_coeff`: the weight of the
    routers' load-balancing loss (a mixture of experts; see the module docstring). `routing_replay`: the MoE routers
    can replay recorded routes (`trainer.routing_replay`).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    dtype = torch.bfloat16 if bf16 else torch.float32
    replay = {"moe_enable_routing_replay": True} if routing_replay else {}
    config = transformer_config(spec, layout, params_dtype=dtype,
                                use_cpu_initialization=use_cpu_initialization or device.type == "cpu",
                                moe_aux_loss_coeff=moe_aux_loss_coeff, fused=device.type == "cuda", **replay)
    module = build_gpt_model(spec, layout, config).to(device)  # a no-op for weights made on the device
    if init_weights is not None:
        init_weights(module)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=not (bf16 and grad_reduce_in_bf16), overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    model = DistributedDataParallel(config, ddp_config, module)
    opt_config = OptimizerConfig(
        optimizer=optimizer, lr=lr, min_lr=min_lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16,
        params_dtype=dtype, adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    opt = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = opt.scale_loss if bf16 else None
    config.finalize_model_grads_func = _finalize_model_grads
    config.no_sync_func = model.no_sync
    if overlap_grad_reduce:  # each bucket's reduction starts as its gradients are ready, in the last backward
        config.grad_sync_func = model.start_grad_sync
    return Policy(spec, layout, model, opt, config, device)


def _finalize_model_grads(model, num_tokens=None, **kwargs):
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, num_tokens, **kwargs)


def run_microbatches(
    policy: Policy | torch.nn.Module,
    microbatches: list[dict[str, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, Any]]],
    *,
    forward_only: bool = False,
) -> list[dict[str, Any]]:
    """Run forward (and backward) over micro-batches with Megatron's schedule.

    `policy`: the policy (its DDP model runs), or a bare model shard of the same layout run forward-only (the
    frozen reference policy). Each micro-batch holds `tokens` [b, s] and whatever `loss_fn` needs; a packed one
    (`trainer.packing`) also its positions and sequence boundaries. Shapes may differ between micro-batches (the
    pipeline then sends each activation's shape first: `variable_seq_lengths`). `loss_fn(logits, mb)` gets this
    rank's vocab-parallel logits [b, s, V/TP] on the last pipeline stage and returns (loss, metrics) with `loss`
    normalized globally (see the module docstring). Returns the metrics of each micro-batch on the last stage
    (empty elsewhere).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_mb = len(microbatches)
    scale = num_mb * ps.get_data_parallel_world_size()
    if any("routed_experts" in mb for mb in microbatches) and not all("routed_experts" in mb for mb in microbatches):
        raise ValueError("rollout routing replay needs routes for every micro-batch or none")

    def forward_step(data_iterator: Iterable, model):
        mb = next(data_iterator)
        if "routed_experts" in mb:  # rollout routing replay: this forward uses the generator's experts
            routing_replay.replay(model, mb["routed_experts"], model.config.sequence_parallel)
        logits = packing.model_forward(model, mb)

        def loss_func(output):
            loss, metrics = loss_fn(output, mb)
            return loss * scale, metrics

        return logits, loss_func

    model = policy.model if isinstance(policy, Policy) else policy
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=num_mb,
            seq_length=max(mb["tokens"].shape[1] for mb in microbatches),
            micro_batch_size=max(mb["tokens"].shape[0] for mb in microbatches),
            forward_only=forward_only,
        )
    finally:
        if "routed_experts" in microbatches[0]:
            routing_replay.stop_replay(model)


@torch.no_grad()
def forward_logprobs(policy: Policy | torch.nn.Module, microbatches: list[dict[str, torch.Tensor]], vocab_size: int,
                     temperature: float) -> list[torch.Tensor]:
    """Log-probs of each micro-batch's next tokens as rows ([rows, width], `packing.rows_view`; temperature-scaled
    as in training) under `policy` (the policy, or the frozen reference model), forward-only through Megatron's
    schedule: one tensor per micro-batch on the last pipeline stage, none elsewhere."""
    from megatron_rl.trainer.logprobs import next_token_logprobs_and_entropy

    def fn(logits, mb):
        lp, _ = next_token_logprobs_and_entropy(logits, mb["tokens"], vocab_size, temperature)
        return logits.sum() * 0, {"logprobs": packing.rows_view(lp, mb)}

    return [out["logprobs"] for out in run_microbatches(policy, microbatches, fn, forward_only=True)]


def moe_aux_loss(policy: Policy, num_microbatches: int) -> float | None:
    """Collective over the trainer: the routers' load-balancing loss of the micro-batches just trained (without its
    coefficient), averaged over micro-batches, layers and DP ranks, as Megatron-LM logs it; None when the policy has
    none (a dense model, or --moe-aux-loss-coeff 0). Resets Megatron-Core's tracker for the next step."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    entry = moe_utils.get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    if entry is None or not policy.config.num_moe_experts or not policy.config.moe_aux_loss_coeff:
        return None
    values = entry["values"].detach().clone()  # per layer, summed over micro-batches; this stage's layers only
    num_layers = values.numel()
    # Megatron's reduce_aux_losses_tracker_across_ranks, with a sum and a division for its DP average (gloo has
    # no AVG): the stages' layers, the shares of the router's reduce group, then the DP ranks.
    dist.all_reduce(values, group=ps.get_pipeline_model_parallel_group())
    if entry.get("reduce_group") is not None:
        dist.all_reduce(values, group=entry["reduce_group"])
    dist.all_reduce(values, group=ps.get_data_parallel_group())
    moe_utils.clear_aux_losses_tracker()
    return float(values.sum()) / (ps.get_data_parallel_world_size() * num_microbatches * num_layers)


def optimizer_step(policy: Policy) -> dict[str, float]:
    """Apply the accumulated gradients, unless one of them is NaN/Inf on any trainer rank: then the step is skipped
    (weights and optimizer state untouched, as Megatron does on a loss-scale overflow; megatron's fp32 and bf16
    optimizers have no such check of their own). The check is the gradient norm that clipping computes anyway
    (Megatron's grad-stats groups span every rank holding a different part of the gradients, so a NaN anywhere
    makes it NaN everywhere), Megatron's own steps around it. Zeroes the grad buffers for the next step."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    optimizer = policy.optimizer
    found_inf = optimizer.prepare_grads()  # bf16: the model's grads into the fp32 main grads
    grad_norm = float(optimizer.get_grad_norm())
    success = not found_inf and math.isfinite(grad_norm)
    if success:
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):  # dense and expert parameters
            params = part.get_parameters()
            if params and part.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                                             use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        success = optimizer.step_with_ready_grads()
    policy.model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    return {"update_successful": bool(success), "grad_norm": grad_norm}
