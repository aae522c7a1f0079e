"""Megatron-Core's parallel state for the trainer's ranks, from the run's one `TrainerLayout`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl import cpu_compat
from megatron_rl.models.layout import TrainerLayout
from megatron_rl.models.spec import ModelSpec


def initialize(layout: TrainerLayout, spec: ModelSpec | None = None, seed: int = 1234) -> None:
    """Set up Megatron-Core's parallel state and RNG on an already initialized process group whose ranks are
    exactly the trainer's."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized (torchrun, or megatron_rl.launch) first")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"the trainer has {world} ranks but its layout needs {layout.world_size} "
                         f"({layout.describe()})")
    if spec is not None:
        layout.validate(spec)
    cpu_compat.apply()
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_parallel_size,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
