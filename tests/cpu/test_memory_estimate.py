"""The dry run's activation estimate (`config.memory`) against what autograd really keeps: the bytes of every tensor
saved for the backward during the forward pass of a real Megatron-Core policy (local spec, fp32) and its log-prob
loss, counted once per storage, parameters left out. One launch of 2 ranks: TP=1 (each rank on its own, DP=2) with
each recompute mode, then TP=2; a Llama and a Qwen3 (q/k norms) shape at two sequence lengths.

Tolerance 5%: what the estimate leaves out of the saved bytes is per token and small (token ids, the log-prob
function's per-position statistics, the rotary tables' rounding), and a missing term in it (the
attention probabilities, the MLP's activations, a recompute mode) moves it by >= 10%."""

import pytest
import torch

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks

SPECS = {"llama": get_model_spec("tiny-llama").replace(hidden_size=256, ffn_hidden_size=704, num_attention_heads=8,
                                                      num_key_value_heads=2, num_layers=4, vocab_size=512),
         "qwen3": get_model_spec("tiny-qwen3").replace(num_layers=3)}
FULL = {"recompute_granularity": "full"}
RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},
             "full-uniform": {**FULL, "recompute_method": "uniform", "recompute_num_layers": 1},
             "full-block": {**FULL, "recompute_method": "block", "recompute_num_layers": 2}}
CASES = [(name, 1, mode) for name in SPECS for mode in RECOMPUTE] + [(name, 2, "none") for name in SPECS]
LENGTHS = (128, 384)


def _saved_bytes(policy, spec, ids) -> int:
    """Bytes of the tensors autograd saves in the forward of `ids` and its log-probs (each storage once, no
    parameter)."""
    from megatron_rl.trainer.logprobs import next_token_logprobs_and_entropy

    skip = {p.untyped_storage().data_ptr() for p in policy.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = policy.module(ids, torch.arange(ids.shape[1])[None], None)
        next_token_logprobs_and_entropy(logits, ids, spec.vocab_size, 1.0)
    return sum(seen.values())


def _measure_rank():
    import torch.distributed as dist

    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.policy import build_policy

    out = {}
    for name, tp, mode in CASES:
        spec = SPECS[name]
        layout = TrainerLayout(tp, 1, dist.get_world_size() // tp, dtype_bytes=4, **RECOMPUTE[mode])
        parallel.initialize(layout, spec)
        policy = build_policy(spec, layout)
        for length in LENGTHS:
            ids = torch.randint(0, spec.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
            out[name, tp, mode, length] = _saved_bytes(policy, spec, ids)
        parallel.destroy()
    return out


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(_measure_rank, 2, timeout_s=600)[0]


@pytest.mark.parametrize("name,tp,mode", CASES)
def test_the_activation_estimate_is_within_5_percent_of_what_autograd_saves(measured, name, tp, mode):
    from megatron_rl.config.memory import MicroBatchShape, stage_activation_bytes

    spec = SPECS[name]
    layout = TrainerLayout(tp, 1, 2 // tp, dtype_bytes=4, **RECOMPUTE[mode])
    for length in LENGTHS:
        estimate = stage_activation_bytes(spec, layout, 0, MicroBatchShape(length, length, length), 4)
        got = measured[name, tp, mode, length]
        assert estimate["saved_per_micro_batch"] == pytest.approx(got, rel=0.05), (length, got, estimate)
