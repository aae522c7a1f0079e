"""Build HuggingFace models offline from a ModelSpec (no downloads): the independent numerical reference
for tests, and the starting point of the tiny CPU example."""

from __future__ import annotations

import torch

from megatron_rl.models.spec import ModelSpec


def hf_config(spec: ModelSpec):
    import transformers

    return transformers.AutoConfig.for_model(**spec.to_hf_config())


def random_hf_model(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A `transformers` causal LM of this architecture with seeded random weights, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(spec), dtype=dtype)
    with torch.no_grad():  # random norm weights, so that a wrong norm mapping cannot go unnoticed
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def save_random_hf_model(spec: ModelSpec, directory: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    model = random_hf_model(spec, seed, dtype)
    model.save_pretrained(directory)
    return model
