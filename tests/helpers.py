"""Helpers shared by the tests (not part of the package)."""

import torch

from megatron_rl.models import layout as L
from megatron_rl.models.spec import ModelSpec


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """All-gather the TP vocab shards of the last dim (a full-vocabulary reference for tests; training never
    gathers the vocabulary)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits.contiguous())


def random_hf_weights(spec: ModelSpec, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Deterministic random HF-named fp32 weights (norm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in L.hf_shapes(spec).items():
        t = torch.randn(shape, generator=g) * std
        out[name] = t + 1.0 if name.endswith("norm.weight") else t
    return out
