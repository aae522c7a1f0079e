"""Helpers shared by every test tier (not part of the package); each tier imports them through tests/conftest.py's
folder, which pytest puts on sys.path."""

import pathlib

import torch

from megatron_rl.models import weight_map
from megatron_rl.models.spec import ModelSpec

ROOT = str(pathlib.Path(__file__).resolve().parents[1])  # the repository


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """All-gather the TP vocab shards of the last dim (a full-vocabulary reference for tests; training never
    gathers the vocabulary)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits.contiguous())


def random_hf_weights(spec: ModelSpec, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Deterministic random HF-named fp32 weights (norm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_map.hf_shapes(spec).items():
        t = torch.randn(shape, generator=g) * std
        out[name] = t + 1.0 if name.endswith("norm.weight") else t
    return out


def mismatched_generator_tensors(engine, spec: ModelSpec, hf: dict[str, torch.Tensor], tp: int, tp_rank: int,
                                 ep: int = 1) -> list[str]:
    """The runtime tensors of a generator rank that differ from the reference `hf` weights in its layout, bit for
    bit (an FP8 tensor is compared with the reference quantized the same way)."""
    from megatron_rl.models.fp8 import quantize_block_fp8

    mismatched = []
    for name, shard in weight_map.sglang_shards(spec, tp, tp_rank, ep).items():
        expected, got = weight_map.assemble(shard, weight_map.slicer(hf)), engine.decoder.params[name]
        if got.dtype == torch.float8_e4m3fn:
            q, s = quantize_block_fp8(expected)
            ok = torch.equal(got.view(torch.uint8), q.view(torch.uint8)) and \
                torch.equal(engine.decoder.params[name + "_scale_inv"], s)
        else:
            ok = torch.equal(got, expected)
        if not ok:
            mismatched.append(name)
    return mismatched
