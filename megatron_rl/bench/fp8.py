"""FP8 vs bf16 GEMM throughput on a GPU, at the linear-layer shapes of Llama-3.1 70B at generator TP=4.

Three ways to run `x @ W.T` for the generator's weights: bf16 (the baseline), FP8 with per-tensor scales
through `torch._scaled_mm` (Hopper's FP8 tensor cores), and the built-in engine's block-FP8 path, which
dequantizes the 128 x 128-block weights to bf16 before a bf16 GEMM (memory saving only). Reported:
TFLOP/s of each and the ratios to bf16, for a decode-sized batch and a prefill-sized one. Needs CUDA
(an FP8-capable GPU for `_scaled_mm`); on a CPU it reports that it did not run.
"""

from __future__ import annotations

import torch

MODEL, TP = "llama3-70b", 4
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _shapes() -> list[tuple[int, int]]:
    """(out_features, in_features) of one layer's linear weights on a generator TP rank (models.layout)."""
    from megatron_rl.models import layout as L
    from megatron_rl.models.spec import get_model_spec

    shards = L.sglang_shards(get_model_spec(MODEL), TP, 0)
    return [tuple(shards[f"{L.hf_layer(0)}.{name}.weight"].shape) for name in LINEARS]


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def run(quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    from megatron_rl.models.fp8 import FP8_MAX, dequantize_block_fp8, quantize_block_fp8

    repeats = 20 if quick else 100
    out = {"device": torch.cuda.get_device_name(), "shapes": f"{MODEL} linear layers at TP={TP}"}
    for tokens in (64, 4096):
        flops = bf16_s = fp8_s = block_s = 0.0
        for n, k in _shapes():
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            flops += 2 * tokens * n * k
            bf16_s += _time(lambda: x @ w.t(), repeats)  # noqa: B023 - timed now, within this iteration
            sx, sw = x.abs().amax().float() / FP8_MAX, w.abs().amax().float() / FP8_MAX
            x8, w8 = (x / sx).to(torch.float8_e4m3fn), (w / sw).to(torch.float8_e4m3fn)
            fp8_s += _time(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw,  # noqa: B023
                                                    out_dtype=torch.bfloat16), repeats)
            q, scale_inv = quantize_block_fp8(w.cpu())
            q, scale_inv = q.cuda(), scale_inv.cuda()
            block_s += _time(lambda: x @ dequantize_block_fp8(q, scale_inv, dtype=torch.bfloat16).t(),  # noqa: B023
                             repeats)
        out[f"tokens_{tokens}"] = {"bf16_tflops": flops / bf16_s / 1e12, "fp8_scaled_mm_tflops": flops / fp8_s / 1e12,
                                   "block_fp8_dequant_tflops": flops / block_s / 1e12,
                                   "fp8_speedup_vs_bf16": bf16_s / fp8_s,
                                   "block_fp8_dequant_vs_bf16": bf16_s / block_s}
    out["fp8_speedup_vs_bf16"] = out["tokens_4096"]["fp8_speedup_vs_bf16"]
    return out
