"""Megatron-LM flags that change how the trainer computes, not what: activation recomputation gives the same
step as storing activations, and the WSD schedule follows Megatron's formula.

fp32; recomputation reruns the same kernels on the same inputs, so the updated weights are compared exactly."""

import math

import pytest
import torch

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks
from megatron_rl.trainer import parallel

SPEC = get_model_spec("tiny-llama")


def _step_under(recompute: dict) -> dict[str, torch.Tensor]:
    from helpers import random_hf_weights

    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.trainer.batch import TrainBatch
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    layout = TrainerLayout(1, 1, 1, dtype_bytes=4, **recompute)
    parallel.initialize(layout, SPEC)
    policy = build_policy(SPEC, layout, lr=1e-3, init_weights=lambda m: load_hf_weights(
        m, SPEC, layout, random_hf_weights(SPEC, seed=3)))
    trainer = PolicyTrainer(policy, AlgorithmConfig(loss="aipo"), batching=2)
    g = torch.Generator().manual_seed(0)
    batch = TrainBatch.from_sequences([torch.randint(0, SPEC.vocab_size, (4,), generator=g).tolist()] * 2,
                                      [torch.randint(0, SPEC.vocab_size, (6,), generator=g).tolist()] * 2,
                                      [[-4.0] * 6] * 2, [1.0, -1.0])
    trainer.train_step(batch)
    out = {n: p.detach().clone() for n, p in policy.module.named_parameters()}
    parallel.destroy()
    return out


def _one_rank():
    plain = _step_under({})
    full = _step_under(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    selective = _step_under(dict(recompute_granularity="selective"))
    return {"steps": (plain, full, selective), "wsd_lrs": _wsd_lrs()}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_one_rank, 1)[0]


def test_activation_recompute_gives_the_same_step(results):
    plain, full, selective = results["steps"]
    assert plain.keys() == full.keys() == selective.keys()
    for name in plain:
        assert torch.equal(plain[name], full[name]), name
        assert torch.equal(plain[name], selective[name]), name
    assert any(not torch.equal(plain[n], torch.zeros_like(plain[n])) for n in plain)


def _wsd_lrs():
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import build_scheduler

    layout = TrainerLayout(1, 1, 1, dtype_bytes=4)
    parallel.initialize(layout, SPEC)
    policy = build_policy(SPEC, layout, lr=1.0, min_lr=0.1)
    scheduler = build_scheduler(policy, warmup_steps=2, decay_steps=10, decay_style="WSD", wsd_decay_steps=4,
                                wsd_decay_style="exponential")
    lrs = []
    for _ in range(10):
        scheduler.step(increment=1)
        lrs.append(policy.optimizer.param_groups[0]["lr"])
    parallel.destroy()
    return lrs


def test_wsd_schedule_is_warmup_stable_then_decay(results):
    lrs = results["wsd_lrs"]
    expected = []
    for step in range(1, 11):
        if step <= 2:
            expected.append(step / 2)  # linear warm-up to lr
        elif step <= 6:
            expected.append(1.0)  # stable until the last 4 steps
        else:  # Megatron's exponential WSD decay: coeff = 2 * 0.5 ** ratio - 1, between min_lr and lr
            coeff = 2 * 0.5 ** ((step - 6) / 4) - 1
            expected.append(0.1 + coeff * (1.0 - 0.1))
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(lrs, expected)), (lrs, expected)


def test_kernel_fusions_are_megatron_lms_defaults_on_gpus_with_te_and_off_by_their_flags():
    from megatron_rl.config.arguments import parse_args
    from megatron_rl.config.setup import layouts
    from megatron_rl.models.megatron_config import fusion_fields
    from megatron_rl.models.parallelism import KERNEL_FUSIONS

    te = ["--transformer-impl", "transformer_engine"]
    trainer, _ = layouts(parse_args(te), 2)
    assert set(fusion_fields(trainer, fused=True)) == set(KERNEL_FUSIONS.values())
    assert all(fusion_fields(trainer, fused=True).values())  # Megatron-LM turns each on by default
    assert not any(fusion_fields(trainer, fused=False).values())  # a CPU has none of their kernels
    assert not any(fusion_fields(layouts(parse_args([]), 2)[0], fused=True).values())  # nor the local spec
    trainer, _ = layouts(parse_args([*te, "--no-rope-fusion", "--no-gradient-accumulation-fusion"]), 2)
    off = {name for name, on in fusion_fields(trainer, fused=True).items() if not on}
    assert off == {"apply_rope_fusion", "gradient_accumulation_fusion"}
