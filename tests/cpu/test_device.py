"""Device placement on a machine without a GPU: the device choice and its errors, the DDMA transport each mix of
devices gets, the built-in engine's weights and KV cache on the device it is given (the `meta` device stands in
for a GPU: a tensor left on the CPU would show), the trainer's batches on the policy's device, the FP8 GEMM path
against its fp32 reference, and DDMA's two receive sets across a failed update. tests/gpu/ checks the same on a
GPU."""

import pytest
import torch

from megatron_rl.models.fp8 import FP8_MAX, RowwiseFP8, quantize_block_fp8
from megatron_rl.models.spec import get_model_spec
from megatron_rl.rollout.local.decoder import TPDecoder
from megatron_rl.runtime.device import DeviceId, backend_for, select_device
from megatron_rl.runtime.roles import choose_transport

TINY = get_model_spec("tiny-llama")


def test_auto_is_the_cpu_without_cuda_and_a_gpu_request_is_refused_by_flag():
    assert select_device("auto") == torch.device("cpu")
    assert backend_for(select_device("cpu")) == "gloo" and backend_for(torch.device("cuda", 3)) == "nccl"
    with pytest.raises(ValueError, match="--device cuda:1: torch sees no CUDA device"):
        select_device("cuda:1")
    with pytest.raises(ValueError, match="--device 'tpu'"):
        select_device("tpu")


def _gpu(host, uuid):
    return DeviceId(host, "cuda", uuid)


@pytest.mark.parametrize("devices, kind, named", [
    ([DeviceId("a", "cpu", "")] * 3, "gloo", "CPUs"),
    ([_gpu("a", "GPU-0"), _gpu("a", "GPU-1"), _gpu("b", "GPU-0")], "nccl", "3 distinct GPUs"),
    ([_gpu("a", "GPU-0"), _gpu("a", "GPU-1"), _gpu("a", "GPU-0")], "staged", "ranks 0 and 2 share one GPU"),
    ([_gpu("a", "GPU-0"), DeviceId("a", "cpu", "")], "staged", "CPUs and others on GPUs"),
])
def test_ddma_transport_follows_where_the_ranks_compute(devices, kind, named):
    chosen, why = choose_transport(devices)
    assert chosen == kind and named in why


def _hf_weights(decoder: TPDecoder, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.05 for name, (shape, kind) in decoder.expected().items()
            if kind != "scale"}  # a dense tensor for an FP8 weight is quantized on receipt


@pytest.mark.parametrize("fp8", [False, True])
def test_engine_keeps_weights_and_kv_cache_on_its_device(fp8):
    decoder = TPDecoder(TINY, dtype=torch.bfloat16, fp8=fp8, max_slots=3, max_seq_len=16, device="meta")
    staged = {}
    for name, (shape, kind) in decoder.expected().items():
        if kind == "fp8":
            staged_q = torch.zeros(shape, dtype=torch.float8_e4m3fn)
            decoder.load(name, staged_q, staged)
        elif kind == "dense":
            decoder.load(name, torch.zeros(shape), staged)  # given on the CPU, as a checkpoint reader does
    for name, (shape, kind) in decoder.expected().items():
        if kind == "scale":
            decoder.load(name, torch.ones(shape), staged)
    decoder.install(staged)
    tensors = {"k_cache": decoder.k_cache, "v_cache": decoder.v_cache, "inv_freq": decoder.inv_freq,
               **decoder.params, **{f"compute:{n}": t for n, t in decoder._compute.items()}}
    off = {n: str(t.device) for n, t in tensors.items() if t.device.type != "meta"}
    assert not off, f"left off the engine's device: {off}"
    assert decoder.params["model.norm.weight"].dtype == torch.bfloat16


def test_trainer_batches_go_to_the_policys_device():
    from megatron_rl.trainer.batch import TrainBatch

    batch = TrainBatch.from_sequences([[1, 2], [3]], [[4, 5], [6, 7, 8]], [[-0.1, -0.2], [-0.3, -0.4, -0.5]],
                                      [1.0, -1.0])
    moved = batch.to("meta")
    assert {t.device.type for t in (moved.tokens, moved.loss_mask, moved.behavior_logprobs, moved.advantages)} \
        == {"meta"}
    assert moved.tokens.shape == batch.tokens.shape


def test_rowwise_fp8_gemm_equals_its_fp32_reference():
    """torch._scaled_mm with per-row scales (it runs on this CPU too): the product of the FP8 operands, scaled
    back, in fp32, rounded once to bf16. Tolerance: one bf16 rounding of the output (2^-8 relative) plus fp32
    summation-order differences."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 384, generator=g) * 0.02, torch.randn(2, 5, 384, generator=g)
    fp8 = RowwiseFP8.quantize(w)
    out = fp8.linear(x)
    rows = x.reshape(-1, 384)
    x_scale = rows.abs().amax(1, keepdim=True) / FP8_MAX
    xq = (rows / x_scale).to(torch.float8_e4m3fn).float() * x_scale
    reference = (xq @ fp8.dequantize().T).reshape(2, 5, 256)
    assert out.shape == (2, 5, 256) and out.dtype == x.dtype
    torch.testing.assert_close(out, reference, rtol=2**-7, atol=1e-4)
    assert (fp8.dequantize() - w).abs().max() <= w.abs().amax(1).max() / 16  # e4m3: 3 mantissa bits


def test_decoder_fp8_gemm_path_matches_the_dequantized_path():
    """Same block-FP8 weights, two compute paths: dequantize-then-matmul (CPU, older GPUs) and the FP8 GEMM
    (Hopper); they differ only by activation quantization (e4m3: ~2^-4 relative per element), so greedy logits
    stay close."""
    spec = TINY.replace(hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    paths = []
    for fp8_gemm in (False, True):
        decoder = TPDecoder(spec, fp8=True, max_slots=2, max_seq_len=16)
        decoder.fp8_gemm = fp8_gemm
        staged = {}
        for name, tensor in _hf_weights(decoder).items():
            decoder.load(name, tensor, staged)
        decoder.install(staged)
        decoder.reserve(0, 4)
        paths.append(decoder.forward([0], torch.tensor([[1, 5, 9, 2]]), [0]))
    assert isinstance(decoder._compute["model.layers.0.mlp.down_proj.weight"], RowwiseFP8)
    scale = paths[0].abs().max()
    assert (paths[0] - paths[1]).abs().max() < 0.1 * scale
    assert not torch.equal(paths[0], paths[1])


def _failed_update_keeps_serving():
    """Trainer rank 0 publishes versions 1, 2, 3 with different weights; generator rank 1's engine fails to
    install version 2. Version 1 must keep serving, untouched, and version 3 then arrives whole."""
    import torch.distributed as dist
    from helpers import random_hf_weights

    from megatron_rl.ddma.plan import make_plan
    from megatron_rl.ddma.sync import publish
    from megatron_rl.models import weight_map
    from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
    from megatron_rl.rollout.local.engine import LocalEngine

    class FailsVersion2(LocalEngine):
        def end_weight_update(self, version):
            if version == 2:
                raise RuntimeError("install failed")
            super().end_weight_update(version)

    plan = make_plan(TINY, TrainerLayout(1, 1, 1, dtype_bytes=4), GeneratorLayout(1, 1, first_rank=1))
    weights = {v: random_hf_weights(TINY, seed=v) for v in (1, 2, 3)}
    if dist.get_rank() == 0:
        for v in (1, 2, 3):
            shards = weight_map.megatron_shards(TINY, plan.trainer, 0, 0)
            tensors = {n: weight_map.assemble(s, weight_map.slicer(weights[v])) for n, s in shards.items()}
            publish(plan, 0, v, trainer_tensors=tensors)
        return None
    engine = FailsVersion2(TPDecoder(TINY))

    def serves(v):
        return all(torch.equal(engine.decoder.params[n], weight_map.assemble(s, weight_map.slicer(weights[v])))
                   for n, s in weight_map.sglang_shards(TINY, 1, 0).items())

    publish(plan, 1, 1, engine=engine)
    first = engine.decoder.params["model.norm.weight"]
    out = {"v1": serves(1)}
    try:
        publish(plan, 1, 2, engine=engine)
    except RuntimeError as e:
        out["error"] = str(e)
    out.update(version_after_failure=engine.weight_version, v1_after_failure=serves(1))
    publish(plan, 1, 3, engine=engine)
    out.update(v3=serves(3), version=engine.weight_version,
               other_set=engine.decoder.params["model.norm.weight"].data_ptr() != first.data_ptr())
    return out


def test_a_failed_update_keeps_the_serving_weights_and_the_next_one_lands_whole():
    from megatron_rl.runtime.spawn import run_on_ranks

    _, gen = run_on_ranks(_failed_update_keeps_serving, 2, timeout_s=120)
    assert gen == {"v1": True, "error": "install failed", "version_after_failure": 1, "v1_after_failure": True,
                   "v3": True, "version": 3, "other_set": True}


def test_block_fp8_quantization_stays_on_the_weights_device():
    q, scale = quantize_block_fp8(torch.zeros(130, 260, device="meta"))
    assert q.device.type == scale.device.type == "meta" and scale.shape == (2, 3)
