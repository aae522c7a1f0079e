"""One trainer step on the GPU against the same step in fp32 on the CPU: the same initial weights (CPU
initialization, seeded by `parallel.initialize` on every device), the same batch, SGD so that the update of the fp32
main weights is the gradient itself. Every parameter, grad buffer and optimizer state is on the GPU.

Tolerances, on the relative norm of the difference of the main weights' updates and on the loss (whose terms all
have one sign: positive advantages, negative log-probs, so that it has no cancellation to amplify errors):
- fp32: 1e-4. TF32 is off for matmuls by default, so only the order of summation differs: fp32 rounds at 2^-24
  (6e-8), and sums of up to ~10^3 terms in another order differ by at most ~10^3 x 6e-8 = 6e-5 relative.
- bf16 (Megatron's bf16: bf16 parameters and compute, fp32 main grads and main weights): 5e-2. bf16 keeps 8 bits:
  each rounding is a relative error of at most u = 2^-8 (3.9e-3), about u / sqrt(3) = 2.3e-3 on average. A gradient's
  path through this 2-layer model rounds about 40 intermediates (some 10 per layer, forward and backward);
  independent errors add in quadrature, sqrt(40) x 2.3e-3 = 1.4e-2, and 5e-2 leaves 3.5x for correlated ones (the
  same bf16 step on a CPU differs from fp32 by 6.5e-3 on the update, 6e-5 on the loss). The fp32 main weights'
  update avoids modelling the bf16 rounding of the parameters themselves.
With Transformer Engine: packed micro-batches (THD) give the padded rows' log-probs, within 1e-4 in fp32 and 5e-2 in
bf16 (absolute, log-probs near -5.5: a few bf16 roundings of values of that size, 5.5 x 3.9e-3 = 2e-2 each)."""

import pytest
import torch

from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks

SPEC = get_model_spec("tiny-llama").replace(name="gpu-step", hidden_size=128, ffn_hidden_size=256, num_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


def _step(device: str, bf16: bool):
    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.batch import TrainBatch
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer

    layout = TrainerLayout(1, 1, 1, dtype_bytes=2 if bf16 else 4)
    device = parallel.initialize(layout, SPEC, seed=7, device=device)
    policy = build_policy(SPEC, layout, lr=0.5, optimizer="sgd", clip_grad=0.0, bf16=bf16, device=device,
                          use_cpu_initialization=True)
    g = torch.Generator().manual_seed(0)
    batch = TrainBatch.from_sequences(torch.randint(0, 256, (8, 12), generator=g).tolist(),
                                      torch.randint(0, 256, (8, 20), generator=g).tolist(),
                                      (-torch.rand(8, 20, generator=g) * 3).tolist(),
                                      (torch.rand(8, generator=g) + 0.5).tolist())
    inner = policy.optimizer.optimizer  # the torch optimizer over the main (fp32) parameters
    mains = [p for group in inner.param_groups for p in group["params"]]
    before = [p.detach().cpu().clone() for p in mains]
    metrics = PolicyTrainer(policy, AlgorithmConfig(), batching=4).train_step(batch)
    update = torch.cat([(p.detach().cpu() - b).flatten() for p, b in zip(mains, before)])
    tensors = {f"param {n}": p for n, p in policy.module.named_parameters()}
    tensors.update({f"buffer {n}": b for n, b in policy.module.named_buffers()})
    tensors.update({f"grad buffer {i}": b.grad_data for i, b in enumerate(policy.model.buffers)})
    for i, main in enumerate(mains):
        tensors[f"main param {i}"] = main
        tensors.update({f"optimizer state {i}.{k}": v for k, v in inner.state.get(main, {}).items()
                        if torch.is_tensor(v) and v.dim()})
    off = sorted(n for n, t in tensors.items() if t.device != device)
    parallel.destroy()
    return {"loss": metrics["loss"], "update": update, "off_device": off, "device": str(device)}


@pytest.fixture(scope="module")
def cpu_step():
    return run_on_ranks(_step, 1, "cpu", False, env={"CUDA_VISIBLE_DEVICES": ""}, timeout_s=120)[0]


@pytest.mark.parametrize("bf16, tolerance", [(False, 1e-4), (True, 5e-2)], ids=["fp32", "bf16"])
def test_gpu_step_equals_cpu_step(cpu_step, bf16, tolerance):
    gpu = run_on_ranks(_step, 1, "cuda", bf16, backend="nccl", timeout_s=120)[0]
    assert gpu["device"] == "cuda:0" and cpu_step["device"] == "cpu"
    assert gpu["off_device"] == [], f"not on the GPU: {gpu['off_device'][:5]}"
    assert abs(gpu["loss"] - cpu_step["loss"]) <= tolerance * abs(cpu_step["loss"])
    error = (gpu["update"] - cpu_step["update"]).norm() / cpu_step["update"].norm()
    assert error <= tolerance, f"update differs by {error:.2e} relative"


def _packed_logprobs(bf16: bool):
    """Log-probs of a long-tail batch on the Transformer Engine spec: rows padded to their micro-batch's longest, and
    packed (THD, `cu_seqlens`)."""
    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.trainer import packing, parallel
    from megatron_rl.trainer.batch import TrainBatch
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer

    layout = TrainerLayout(1, 1, 1, dtype_bytes=2 if bf16 else 4, transformer_impl="transformer_engine")
    device = parallel.initialize(layout, SPEC, seed=7, device="cuda")
    policy = build_policy(SPEC, layout, bf16=bf16, device=device, use_cpu_initialization=True)
    g = torch.Generator().manual_seed(0)
    responses = [int(n) for n in (24 * torch.exp(0.68 * torch.randn(16, generator=g))).clamp(1, 200)]
    batch = TrainBatch.from_sequences(torch.randint(0, 256, (16, 8), generator=g).tolist(),
                                      [torch.randint(0, 256, (n,), generator=g).tolist() for n in responses],
                                      [[0.0] * n for n in responses], [0.0] * 16)
    trainer = PolicyTrainer(policy, AlgorithmConfig(), batching=4)
    padded = trainer.compute_logprobs(batch)
    trainer.batching = packing.MicroBatching(max_tokens=512)
    packed = trainer.compute_logprobs(batch)
    parallel.destroy()
    return padded, packed, batch.loss_mask


@pytest.mark.parametrize("bf16, tolerance", [(False, 1e-4), (True, 5e-2)], ids=["fp32", "bf16"])
def test_thd_packed_logprobs_equal_padded_on_transformer_engine(bf16, tolerance):
    pytest.importorskip("transformer_engine")
    padded, packed, mask = run_on_ranks(_packed_logprobs, 1, bf16, backend="nccl", timeout_s=120)[0]
    torch.testing.assert_close(packed[mask], padded[mask], atol=tolerance, rtol=0)
