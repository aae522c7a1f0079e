"""Block-wise FP8 weights in SGLang's / DeepSeek's layout: `weight` as float8_e4m3fn and `weight_scale_inv`
(fp32, one per 128 x 128 block; the factor that turns the FP8 values back into the weight).

On a CPU the matmul dequantizes (there is no FP8 GEMM); the point here is the numerics and the layout that
DDMA sends, not speed.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


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
