"""FP8 vs bf16 GEMM throughput on a GPU, at the linear-layer shapes of Llama-3.1 70B at generator TP=4.

Four ways to run `x @ W.T` for the generator's weights: bf16 (the baseline); FP8 with per-tensor scales through
`torch._scaled_mm` (the bare GEMM on Hopper's FP8 tensor cores); the built-in engine's FP8 path on such GPUs
(`models.fp8.RowwiseFP8`: the block-FP8 weight re-scaled per row, activations quantized per row on the fly, then
`_scaled_mm`); and its fallback elsewhere, which dequantizes the 128 x 128-block weights to bf16 before a bf16 GEMM
(memory saving only). Reported: TFLOP/s of each, the ratios to bf16, and the engine FP8 path's error relative to
the bf16 product, for a decode-sized batch and a prefill-sized one. Needs CUDA (compute capability 9.0 for the FP8
paths); on a CPU it reports that it did not run.
"""

from __future__ import annotations

import torch

MODEL, TP = "llama3-70b", 4
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _shapes() -> list[tuple[int, int]]:
    """(out_features, in_features) of one layer's linear weights on a generator TP rank (models.weight_map)."""
    from megatron_rl.models import weight_map
    from megatron_rl.models.spec import get_model_spec

    shards = weight_map.sglang_shards(get_model_spec(MODEL), TP, 0)
    return [tuple(shards[f"{weight_map.hf_layer(0)}.{name}.weight"].shape) for name in LINEARS]


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
    from megatron_rl.models.fp8 import FP8_MAX, RowwiseFP8, dequantize_block_fp8, quantize_block_fp8

    repeats = 20 if quick else 100
    out = {"device": torch.cuda.get_device_name(), "shapes": f"{MODEL} linear layers at TP={TP}"}
    for tokens in (64, 4096):
        flops = bf16_s = fp8_s = block_s = rowwise_s = 0.0
        errors = []
        for n, k in _shapes():
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            flops += 2 * tokens * n * k
            bf16_s += _time(lambda: x @ w.t(), repeats)  # noqa: B023 - timed now, within this iteration
            sx, sw = x.abs().amax().float() / FP8_MAX, w.abs().amax().float() / FP8_MAX
            x8, w8 = (x / sx).to(torch.float8_e4m3fn), (w / sw).to(torch.float8_e4m3fn)
            fp8_s += _time(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw,  # noqa: B023
                                                    out_dtype=torch.bfloat16), repeats)
            q, scale_inv = quantize_block_fp8(w)
            rowwise = RowwiseFP8.quantize(dequantize_block_fp8(q, scale_inv))
            rowwise_s += _time(lambda: rowwise.linear(x), repeats)  # noqa: B023
            reference = (x @ w.t()).float()
            errors.append(float((rowwise.linear(x).float() - reference).norm() / reference.norm()))
            block_s += _time(lambda: x @ dequantize_block_fp8(q, scale_inv, dtype=torch.bfloat16).t(),  # noqa: B023
                             repeats)
        out[f"tokens_{tokens}"] = {"bf16_tflops": flops / bf16_s / 1e12, "fp8_scaled_mm_tflops": flops / fp8_s / 1e12,
                                   "engine_rowwise_fp8_tflops": flops / rowwise_s / 1e12,
                                   "block_fp8_dequant_tflops": flops / block_s / 1e12,
                                   "fp8_speedup_vs_bf16": bf16_s / fp8_s,
                                   "engine_rowwise_fp8_vs_bf16": bf16_s / rowwise_s,
                                   "engine_rowwise_fp8_relative_error": max(errors),
                                   "block_fp8_dequant_vs_bf16": bf16_s / block_s}
    out["fp8_speedup_vs_bf16"] = out["tokens_4096"]["fp8_speedup_vs_bf16"]
    return out
