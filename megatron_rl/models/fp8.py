"""Block-wise FP8 weights in SGLang's / DeepSeek's layout: `weight` as float8_e4m3fn and `weight_scale_inv`
(fp32, one per 128 x 128 block; the factor that turns the FP8 values back into the weight).

The format belongs with the layout: which runtime parameters are served in FP8 (`FP8_SUFFIXES`) and how their
scales are shaped (which is also what a block-FP8 piece of a DDMA transfer weighs).

Computing with them: on a GPU with FP8 tensor cores (Hopper and later) the built-in engine re-scales each received
block-FP8 weight per output row (`RowwiseFP8`) and runs `torch._scaled_mm` with per-row activation scales, the
scaling torch's FP8 GEMM supports there; elsewhere (a CPU, older GPUs) the weight is dequantized to the compute
dtype and multiplied in it: the numerics and the layout DDMA sends stay the same, only the speed differs.
"""

from __future__ import annotations

import dataclasses

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
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=weight.device)
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


def fp8_gemm_supported(device: torch.device | str) -> bool:
    """Whether `device` runs FP8 GEMMs with row-wise scales (CUDA compute capability 9.0 and later)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_gemm_shape_ok(shape: tuple[int, ...]) -> bool:
    """torch._scaled_mm needs both dimensions of the weight to be multiples of 16."""
    return len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 16 == 0


@dataclasses.dataclass
class RowwiseFP8:
    """A linear weight [N, K] in FP8 with one fp32 scale per output row, for `torch._scaled_mm`."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn, row-major
    scale: torch.Tensor  # [1, N] fp32: weight[n] = fp8[n] * scale[0, n]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> RowwiseFP8:
        amax = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        scale = amax / FP8_MAX
        q = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(q.contiguous(), scale.t().contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale.t()).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with x quantized per row on the fly; bf16 accumulation output, returned in x's dtype."""
        rows = x.reshape(-1, x.shape[-1])
        x_scale = rows.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        xq = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=torch.bfloat16)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.weight.shape[0])
