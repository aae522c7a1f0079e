"""Trainer parallel layout: validation with flag-named errors, and Megatron-Core initialization."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_rl import cpu_compat
from megatron_rl.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """TP x PP x DP of one Megatron-Core model. DP is whatever the world size leaves."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    def validate(self, world_size: int, spec: ModelSpec | None = None) -> None:
        """Raise ValueError naming the flag and the numbers if this layout cannot run."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp} = {tp * pp}"
            )
        if spec is None:
            return
        checks = [
            ("num_attention_heads", spec.num_attention_heads, "--tensor-model-parallel-size", tp),
            ("num_key_value_heads", spec.num_key_value_heads, "--tensor-model-parallel-size", tp),
            ("ffn_hidden_size", spec.ffn_hidden_size, "--tensor-model-parallel-size", tp),
            ("num_layers", spec.num_layers, "--pipeline-model-parallel-size", pp),
        ]
        for field, size, flag, value in checks:
            if size % value:
                raise ValueError(f"{flag} {value} does not divide the model's {field} {size} (model {spec.name!r})")


def initialize(layout: ParallelLayout, spec: ModelSpec | None = None, seed: int = 1234) -> None:
    """Set up Megatron-Core's parallel state and RNG on an already initialized process group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized (torchrun, or megatron_rl.launch) first")
    layout.validate(dist.get_world_size(), spec)
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
