"""Rollout routing replay (R3): how far the trainer's log-probs are from the generator's on a mixture of experts,
with and without replaying the generator's routes.

A tiny Qwen3-MoE-style model (seeded random weights as `transformers` initializes them; 16 experts, top-4, 4
layers) is served by the built-in engine in a lower precision than the trainer's (bf16, and block-FP8 weights);
it samples rollouts and records every token's experts. The Megatron-Core trainer (fp32, the same weights)
then computes the log-probs of those tokens twice: routing by itself, and replaying the generator's routes.
Reported for each generator precision:

- `routes_differ_fraction`: of all (token, layer) pairs, the fraction whose top-k expert set differs between the
  generator and the trainer routing by itself (and `tokens_any_layer_differs`: tokens with such a layer);
- `abs_logprob_gap_mean` / `_p99` and `kl_k3`: |log pi_trainer - log mu_generator| over response tokens and the k3
  estimate of KL(mu || pi) (what the importance ratio of an off-policy loss sees at lag 0), without and with replay.

All numbers come from one process tree on one machine; the random model's routers are nearly uniform (many
near-ties), so its flip rates are an upper end of what a trained model shows.
"""

from __future__ import annotations

import tempfile

import torch

from megatron_rl.models.spec import ModelSpec

SPEC = ModelSpec("r3-moe", "qwen3_moe", hidden_size=128, num_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 ffn_hidden_size=256, vocab_size=256, norm_eps=1e-6, kv_channels=32, qk_layernorm=True,
                 max_position_embeddings=512, num_experts=16, moe_ffn_hidden_size=64, moe_router_topk=4)


def _rollouts(hf_dir: str, dtype: torch.dtype, fp8: bool, num_prompts: int, response_len: int):
    from megatron_rl.rollout.local.engine import LocalEngine
    from megatron_rl.rollout.types import SamplingParams

    engine = LocalEngine.from_hf(hf_dir, dtype=dtype, fp8=fp8, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SPEC.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 16, (num_prompts,), generator=g)]
    params = SamplingParams(temperature=1.0, max_new_tokens=response_len, ignore_eos=True)
    return engine.generate(prompts, params)


def _trainer_rank(hf_dir: str, batch, generator_routes):
    """Trainer log-probs without and with replay, and the trainer's own routes, on one fp32 Megatron rank."""
    import dataclasses

    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.trainer import parallel, routing_replay
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    layout = TrainerLayout(1, 1, 1, dtype_bytes=4)
    parallel.initialize(layout, SPEC)
    policy = build_policy(SPEC, layout, routing_replay=True,
                          init_weights=lambda m: load_hf_weights(m, SPEC, layout, HFCheckpoint(hf_dir).get_slice))
    trainer = PolicyTrainer(policy, AlgorithmConfig(loss="aipo", temperature=1.0), batching=len(batch))
    plain = trainer.compute_logprobs(dataclasses.replace(batch, routed_experts=None))
    replayed = trainer.compute_logprobs(dataclasses.replace(batch, routed_experts=generator_routes))
    model = policy.module
    for _, router in routing_replay.routers(model):
        router.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(batch.tokens, torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens), None)
    n, length = batch.tokens.shape
    own = torch.stack([r.get_recorded_indices().view(length, n, -1).transpose(0, 1)
                       for _, r in routing_replay.routers(model)], 2)
    routing_replay.stop_replay(model)
    parallel.destroy()
    return plain, replayed, own


def _gap(logprobs: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor) -> dict:
    log_ratio = (logprobs - behavior)[mask].double()
    gap = log_ratio.abs()
    return {"abs_logprob_gap_mean": float(gap.mean()), "abs_logprob_gap_p99": float(gap.quantile(0.99)),
            "kl_k3": float((log_ratio.exp() - 1 - log_ratio).mean())}


def measure(dtype: torch.dtype, fp8: bool, num_prompts: int, response_len: int, hf_dir: str) -> dict:
    from megatron_rl.runtime.spawn import run_on_ranks
    from megatron_rl.trainer.batch import TrainBatch

    outputs = _rollouts(hf_dir, dtype, fp8, num_prompts, response_len)
    batch = TrainBatch.from_sequences([o.prompt_token_ids for o in outputs], [o.token_ids for o in outputs],
                                      [o.logprobs for o in outputs], [0.0] * len(outputs))
    batch = batch.with_routes([o.routed_experts for o in outputs],
                              [len(o.prompt_token_ids) + len(o.token_ids) for o in outputs])
    plain, replayed, own = run_on_ranks(_trainer_rank, 1, hf_dir, batch, batch.routed_experts)[0]
    # Positions the generator ran (prompt and response but the last token), where both routes exist.
    ran = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    for i, o in enumerate(outputs):
        ran[i, :len(o.routed_experts)] = True
    generator_sets = batch.routed_experts.long().sort(-1).values[ran]
    trainer_sets = own.long().sort(-1).values[ran]
    differs = (generator_sets != trainer_sets).any(-1)  # [positions, layers]
    return {
        "generator": f"{'block-FP8 weights, ' if fp8 else ''}{str(dtype).removeprefix('torch.')} compute",
        "positions": int(ran.sum()), "response_tokens": int(batch.loss_mask.sum()),
        "routes_differ_fraction": float(differs.double().mean()),
        "tokens_any_layer_differs": float(differs.any(-1).double().mean()),
        "without_replay": _gap(plain, batch.behavior_logprobs, batch.loss_mask),
        "with_replay": _gap(replayed, batch.behavior_logprobs, batch.loss_mask),
    }


def run(quick: bool = False) -> dict:
    from megatron_rl.models.hf import save_random_hf_model

    num_prompts, response_len = (16, 24) if quick else (64, 48)
    out = {"model": f"{SPEC.name}: {SPEC.num_layers} layers, {SPEC.num_experts} experts, top-{SPEC.moe_router_topk}, "
                    "random weights; trainer fp32 Megatron-Core"}
    with tempfile.TemporaryDirectory() as hf_dir:
        save_random_hf_model(SPEC, hf_dir, seed=0)
        for name, dtype, fp8 in (("bf16", torch.bfloat16, False), ("fp8", torch.bfloat16, True),
                                 ("fp32", torch.float32, False)):
            out[name] = measure(dtype, fp8, num_prompts, response_len, hf_dir)
    return out
