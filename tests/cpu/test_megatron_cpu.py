"""Megatron-Core on CPU (gloo) under every parallel layout: same logits and same optimizer step.

Reference: the TP=1 PP=1 run of the same fixed weights. fp32 throughout; tolerance 1e-5 absolute on
logits and updated weights (TP splits change the order of float additions in the row-parallel reductions,
which moves results by ~1e-7; anything wrong with sharding moves them by > 1e-2).
"""

import pytest
import torch

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks
from megatron_rl.trainer import parallel

SPEC = get_model_spec("tiny-llama")
BATCH, SEQ, MICROBATCHES = 4, 12, 2


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, SPEC.vocab_size, (BATCH, SEQ + 1), generator=g)


def _layout_run(tp: int, pp: int, dp: int, spec_name: str):
    from helpers import gather_vocab_parallel, random_hf_weights
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rl.trainer.logprobs import mask_padded_vocab
    from megatron_rl.trainer.policy import build_policy, optimizer_step, run_microbatches
    from megatron_rl.trainer.weights import load_hf_weights

    spec = get_model_spec(spec_name)
    layout = TrainerLayout(tp, pp, dp, dtype_bytes=4)
    parallel.initialize(layout, spec)
    policy = build_policy(spec, layout, lr=0.5, optimizer="sgd", clip_grad=0.0,
                          init_weights=lambda m: load_hf_weights(m, spec, layout, random_hf_weights(spec)))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens = _batch()
    rows = tokens.chunk(dp)[dp_rank]
    chunks = rows.chunk(MICROBATCHES // dp if dp <= MICROBATCHES else 1)
    microbatches = [{"tokens": c[:, :-1].contiguous(), "labels": c[:, 1:].contiguous()} for c in chunks]
    global_tokens = tokens[:, 1:].numel()

    def logits_fn(logits, mb):
        return logits.sum() * 0, {"logits": gather_vocab_parallel(logits).detach()}

    def ce_fn(logits, mb):
        logits = mask_padded_vocab(logits.float(), spec.vocab_size)
        loss = vocab_parallel_cross_entropy(logits, mb["labels"]).sum() / global_tokens
        return loss, {"loss_sum": loss.detach()}

    fwd = run_microbatches(policy, microbatches, logits_fn, forward_only=True)
    run_microbatches(policy, microbatches, ce_fn)
    step = optimizer_step(policy)
    out = {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
           "dp_rank": dp_rank, "grad_norm": step["grad_norm"],
           "params": {n: p.detach().clone() for n, p in policy.module.named_parameters()}}
    if ps.is_pipeline_last_stage():
        out["logits"] = torch.cat([m["logits"] for m in fwd])[..., : spec.vocab_size]
    parallel.destroy()
    return out


def _run(tp, pp, dp, spec_name="tiny-llama"):
    from megatron_rl.trainer.weights import merge_to_hf

    results = run_on_ranks(_layout_run, tp * pp * dp, tp, pp, dp, spec_name)
    layout = TrainerLayout(tp, pp, dp)
    spec = get_model_spec(spec_name)
    weights = merge_to_hf(spec, layout, {(r["tp_rank"], r["pp_rank"]): r["params"]
                                         for r in results if r["dp_rank"] == 0})
    # Logits of the full batch, DP shards in order, from TP rank 0 of the last stage.
    logits = torch.cat([r["logits"] for r in sorted(results, key=lambda r: r["dp_rank"])
                        if "logits" in r and r["tp_rank"] == 0])
    return logits, weights, results[0]["grad_norm"]


@pytest.fixture(scope="module")
def reference():
    return _run(1, 1, 1)


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), pytest.param(2, 1, 2, marks=pytest.mark.slow)],
                         ids=["tp2", "pp2", "tp2-dp2"])
def test_layout_matches_tp1(reference, tp, pp, dp):
    ref_logits, ref_weights, ref_grad_norm = reference
    logits, weights, grad_norm = _run(tp, pp, dp)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert grad_norm == pytest.approx(ref_grad_norm, rel=1e-5)
    assert weights.keys() == ref_weights.keys()
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], atol=1e-5, rtol=0, msg=name)


def test_reference_step_changes_weights(reference):
    """Guards the comparison above against a step that does nothing."""
    from helpers import random_hf_weights

    _, weights, grad_norm = reference
    initial = random_hf_weights(SPEC)
    assert grad_norm > 0
    moved = max((weights[n] - initial[n]).abs().max().item() for n in initial)
    assert moved > 1e-3
