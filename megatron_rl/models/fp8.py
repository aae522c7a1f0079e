"""Block-wise FP8 weights in SGLang's / DeepSeek's layout: `weight` as float8_e4m3fn and `weight_scale_inv`
(fp32, one per 128 x 128 block; the factor that turns the FP8 values back into the weight).

The format belongs with the layout: which runtime parameters are served in FP8 (`FP8_SUFFIXES`) and how their
scales are shaped (which is also what a block-FP8 piece of a DDMA transfer weighs). On a CPU the matmul dequantizes
(there is no FP8 GEMM); the point there is the numerics and the layout that DDMA sends, not speed.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
# SGLang runtime weights served in block FP8 (the linear layers; embeddings, norms and lm_head stay dense).
FP8_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")
SCALE_SUFFIX = "_scale_inv"


def is_fp8_weight(runtime_name: str) -> bool:
    return runtime_name.endswith(FP8_SUFFIXES)


def scale_shape(shape: tuple[int, int], block: int = BLOCK) -> tuple[int, int]:
    """Shape of the fp32 scale_inv of a block-FP8 weight of this shape."""
    return -(-shape[0] // block), -(-shape[1] // block)


def quantize_block_fp8(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 [N, K], scale_inv [ceil(N/block), ceil(K/block)])."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale_inv.contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = q.shape
    expanded = scale_inv.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (q.to(torch.float32) * expanded).to(dtype)
