"""Trainer throughput: AIPO train-step tokens/s of the Megatron-Core policy at TP=1 and TP=2, same model,
same batch (gloo processes on this machine)."""

from __future__ import annotations

import time

import torch


def _spec(quick: bool):
    from megatron_rl.models.spec import get_model_spec

    return get_model_spec("tiny-llama").replace(name="bench-trainer", hidden_size=256, ffn_hidden_size=688,
                                                num_layers=2 if quick else 4, num_attention_heads=8,
                                                num_key_value_heads=4, vocab_size=512)


def _rank(tp: int, quick: bool, steps: int):
    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.batch import TrainBatch
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer

    spec = _spec(quick)
    layout = TrainerLayout(tp, 1, dtype_bytes=4)
    parallel.initialize(layout, spec)
    trainer = PolicyTrainer(build_policy(spec, layout, lr=1e-4), AlgorithmConfig(), batching=8)
    g = torch.Generator().manual_seed(0)
    n, prompt, response = 32, 32, 96
    batch = TrainBatch.from_sequences(torch.randint(0, spec.vocab_size, (n, prompt), generator=g).tolist(),
                                      torch.randint(0, spec.vocab_size, (n, response), generator=g).tolist(),
                                      (-torch.rand(n, response, generator=g) * 5).tolist(),
                                      torch.randn(n, generator=g).tolist())
    trainer.train_step(batch)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batch)
    elapsed = time.perf_counter() - start
    parallel.destroy()
    return n * (prompt + response) * steps / elapsed


def run(quick: bool = False) -> dict:
    from megatron_rl.runtime.spawn import run_on_ranks

    steps = 3 if quick else 8
    tp1 = run_on_ranks(_rank, 1, 1, quick, steps)[0]
    tp2 = run_on_ranks(_rank, 2, 2, quick, steps)[0]
    return {"tokens_per_s_tp1": tp1, "tokens_per_s_tp2": tp2, "tp2_vs_tp1": tp2 / tp1,
            "note": "2 CPU cores: TP=2 runs 2 processes on 2 cores, with gloo all-reduces between them"}
