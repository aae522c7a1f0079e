"""Rollout routing replay (R3) in the trainer: Megatron-Core's forward uses exactly the routes it is given.

The independent reference is `transformers`' Qwen3-MoE with its routers forced to the same experts (its router's
top-k replaced by the given indices, the weights its own softmax of those experts' scores, renormalized as the
config says). fp32; log-probs agree to 2e-5 (Megatron and HF sum the experts' outputs in different orders).
"""

import dataclasses
import tempfile

import pytest
import torch

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks
from megatron_rl.trainer.batch import TrainBatch

SPEC = get_model_spec("tiny-qwen3-moe")
TEMPERATURE = 1.0


def _batch(spec):
    g = torch.Generator().manual_seed(3)
    lengths = [(3, 6), (5, 2), (2, 9), (4, 4)]
    prompts = [torch.randint(0, spec.vocab_size, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(0, spec.vocab_size, (r,), generator=g).tolist() for _, r in lengths]
    return TrainBatch.from_sequences(prompts, responses, [[0.0] * r for _, r in lengths], [1.0, -1.0, 0.5, -0.5])


def _random_routes(spec, batch, seed):
    """Distinct random top-k experts for every token and layer: [N, L, layers, topk]."""
    g = torch.Generator().manual_seed(seed)
    n, length = batch.tokens.shape
    scores = torch.rand(n, length, spec.num_layers, spec.num_experts, generator=g)
    return scores.argsort(-1)[..., :spec.moe_router_topk].to(torch.int16)


def _hf_logprobs(model, batch, routes):
    """transformers' log-probs of tokens[:, 1:], every router forced to `routes` (None: its own top-k)."""
    import torch.nn.functional as F

    originals = []
    if routes is not None:
        for i, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate
            forced = routes[:, :, i].reshape(-1, routes.shape[-1]).long()  # HF flattens [b, s]

            def forward(hidden, gate=gate, forced=forced):
                logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, forced)
                if gate.norm_topk_prob:
                    weights = weights / weights.sum(-1, keepdim=True)
                return logits, weights.to(logits.dtype), forced

            originals.append((gate, gate.forward))
            gate.forward = forward
    try:
        with torch.no_grad():
            logits = model(batch.tokens).logits.float() / TEMPERATURE
    finally:
        for gate, fn in originals:
            gate.forward = fn
    lp = torch.log_softmax(logits[:, :-1], -1)
    return lp.gather(-1, batch.tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def _replay_rank(spec, hf_dir, routes_other, pp):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.trainer import parallel, routing_replay
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    layout = TrainerLayout(1, pp, 1, dtype_bytes=4)
    parallel.initialize(layout, spec)
    policy = build_policy(spec, layout, routing_replay=True,
                          init_weights=lambda m: load_hf_weights(m, spec, layout, HFCheckpoint(hf_dir).get_slice))
    trainer = PolicyTrainer(policy, AlgorithmConfig(loss="aipo", temperature=TEMPERATURE), batching=2)
    batch = _batch(spec)
    own = trainer.compute_logprobs(batch)
    replayed_other = trainer.compute_logprobs(dataclasses.replace(batch, routed_experts=routes_other))
    after = trainer.compute_logprobs(batch)  # replay is off again once the pass is over
    out = {"own": own, "replayed_other": replayed_other, "after": after}
    if pp > 1:  # each stage replays its own layers' routes (their global layer numbers)
        parallel.destroy()
        return out

    # The model's own routes, recorded by Megatron: replaying them must change nothing, bit for bit.
    model = policy.module
    for _, router in routing_replay.routers(model):
        router.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(batch.tokens, torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens), None)
    recorded = [router.get_recorded_indices() for _, router in routing_replay.routers(model)]
    routing_replay.stop_replay(model)
    n, length = batch.tokens.shape
    own_routes = torch.stack([r.view(length, n, -1).transpose(0, 1) for r in recorded], 2).to(torch.int16)
    replayed_own = trainer.compute_logprobs(dataclasses.replace(batch, routed_experts=own_routes))
    parallel.destroy()
    return {**out, "own_routes": own_routes, "replayed_own": replayed_own}


# The renormalized router at PP=1 (with the model's own routes recorded), the other at PP=2 (one layer per stage).
@pytest.mark.parametrize("norm_topk_prob, pp", [(True, 1), (False, 2)])
def test_replayed_routes_equal_transformers_forced_to_the_same_experts(norm_topk_prob, pp):
    from megatron_rl.models.hf import save_random_hf_model

    spec = SPEC.replace(moe_norm_topk_prob=norm_topk_prob)
    batch = _batch(spec)
    other = _random_routes(spec, batch, seed=11)
    with tempfile.TemporaryDirectory() as hf_dir:
        hf = save_random_hf_model(spec, hf_dir, seed=5)
        out = run_on_ranks(_replay_rank, pp, spec, hf_dir, other, pp)[-1]
        expected_own = _hf_logprobs(hf, batch, None)
        expected_other = _hf_logprobs(hf, batch, other)
    mask = batch.loss_mask
    torch.testing.assert_close(out["own"][mask], expected_own[mask], atol=2e-5, rtol=0)
    torch.testing.assert_close(out["replayed_other"][mask], expected_other[mask], atol=2e-5, rtol=0)
    assert (out["replayed_other"] - out["own"])[mask].abs().max() > 1e-3  # the replay really changed the routes
    assert torch.equal(out["after"], out["own"])
    if pp > 1:
        return
    assert torch.equal(out["replayed_own"], out["own"])  # the model's own routes: the same computation
    # Megatron's own routes are HF's own top-k: both models route each token to the same experts.
    with torch.no_grad():
        router_logits = hf(batch.tokens, output_router_logits=True).router_logits
    hf_routes = torch.stack([logits.topk(spec.moe_router_topk, -1).indices.view(*batch.tokens.shape, -1)
                             for logits in router_logits], 2)
    assert torch.equal(out["own_routes"].sort(-1).values.long(), hf_routes.sort(-1).values)


def test_with_routes_pads_positions_without_a_route():
    batch = _batch(SPEC)
    k, layers = SPEC.moe_router_topk, SPEC.num_layers
    routes = [[[[(t + layer + j) % SPEC.num_experts for j in range(k)] for layer in range(layers)]
               for t in range(p + r - 1)]  # the generator never ran the last sampled token
              for p, r in zip([3, 5, 2, 4], [6, 2, 9, 4])]
    lengths = [p + r for p, r in zip([3, 5, 2, 4], [6, 2, 9, 4])]
    out = batch.with_routes(routes, lengths).padded(8)
    assert out.routed_experts.shape == (4, 16, layers, k)
    assert out.routed_experts[0, 7].tolist() == routes[0][7]
    assert out.routed_experts[0, 8:].tolist() == [[list(range(k))] * layers] * 8  # last token and padding
    assert out.rows(slice(1, 2)).routed_experts[0, 5].tolist() == routes[1][5]
    with pytest.raises(ValueError, match="rollout 2 of the batch carries no routed experts"):
        batch.with_routes([routes[0], routes[1], None, routes[3]], lengths)
    with pytest.raises(ValueError, match="rollout 1 has routes for 3 positions, its prompt and response have 7"):
        batch.with_routes([routes[0], routes[1][:3], routes[2], routes[3]], lengths)
    no_route = batch.with_routes([routes[0], [], routes[2], routes[3]], [lengths[0], 0, lengths[2], lengths[3]])
    assert no_route.routed_experts[1].tolist() == [[list(range(k))] * layers] * 11


def _rollout(prompt, response, routes, finish_reason="stop", reward=1.0):
    from megatron_rl.controller.buffer import Rollout
    from megatron_rl.rewards.types import RewardResult
    from megatron_rl.rollout.types import RequestMeta, RolloutOutput

    output = RolloutOutput("r", prompt, response, [-1.0] * len(response), [0] * len(response), finish_reason,
                           routed_experts=routes)
    return Rollout(output, RequestMeta("p", 0, "1", False, 0.0), RewardResult(reward, "scored"))


def test_routes_survive_the_checkpoint_and_reach_the_batch():
    import json

    from megatron_rl.controller.buffer import Rollout

    layers, k = SPEC.num_layers, SPEC.moe_router_topk
    g = torch.Generator().manual_seed(0)
    routes = torch.randint(0, SPEC.num_experts, (3 + 4 - 1, layers, k), generator=g).to(torch.int16)
    done = _rollout([1, 2, 3], [4, 5, 6, 7], routes)
    restored = Rollout.from_dict(json.loads(json.dumps(done.to_dict())))  # the RL checkpoint's JSON
    assert restored.output.routed_experts.dtype == torch.int16 and torch.equal(restored.output.routed_experts, routes)
    # An aborted request whose routes stop short keeps its reward in the group but trains nothing.
    aborted = _rollout([1, 2], [3, 4, 5], routes[:2], finish_reason="abort", reward=0.0)
    batch = TrainBatch.from_groups([[restored, aborted]], "group-baseline", routing_replay=True)
    assert torch.equal(batch.routed_experts[0, :6], routes) and batch.loss_mask[0].any()
    assert not batch.loss_mask[1].any() and batch.advantages[0] > 0
    with pytest.raises(ValueError, match="rollout 1 has routes for 2 positions, its prompt and response have 5"):
        TrainBatch.from_groups([[restored, _rollout([1, 2], [3, 4, 5], routes[:2])]], "group-baseline",
                               routing_replay=True)
