"""Megatron-Core's parallel state for the trainer's ranks, from the run's one `TrainerLayout` (TP, PP, and with
experts EP x expert-TP groups carved out of each stage's TP x DP ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import ModelSpec
from megatron_rl.runtime import cpu_compat
from megatron_rl.runtime.device import select_device


def initialize(layout: TrainerLayout, spec: ModelSpec | None = None, seed: int = 1234,
               device: torch.device | str | None = None) -> torch.device:
    """Set up Megatron-Core's parallel state and RNG on an already initialized process group whose ranks are
    exactly the trainer's, for a rank computing on `device` (default "auto"; resolved by `select_device`: a bare
    "cuda" is this node-local rank's GPU, which becomes the current CUDA device). On a CPU, Megatron-Core's CUDA
    assumptions are patched (`cpu_compat`). Seeds torch's CPU generator, from which `use_cpu_initialization` draws
    the weights, and Megatron's CUDA generators with `seed`: every device starts from the same weights. Returns the
    device."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized (torchrun, or megatron_rl.runtime.spawn) first")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"the trainer has {world} ranks but its layout needs {layout.world_size} "
                         f"({layout.describe()})")
    if spec is not None:
        layout.validate(spec)
    device = select_device("auto" if device is None else str(device))
    if device.type == "cpu":
        cpu_compat.apply(force=True)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return device


def destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
