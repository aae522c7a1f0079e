"""Training on real lengths: one AIPO step on a long-tail batch with every row padded to the batch's longest (the
trainer before packing), with rows padded to their micro-batch's longest (`--micro-batch-size`), and packed by a
token budget (`--use-dynamic-batch-size`); and the peak memory of the log-prob computation, chunked against a
plain fp32 `log_softmax`, at a long sequence over a large vocabulary. Gloo processes on this machine.

The batch: response lengths log-normal (sigma 0.68, as reasoning rollouts are), short fixed prompts. The ideal
ratio is the padded path's tokens over the real ones: what packing would save if time were linear in tokens."""

from __future__ import annotations

import dataclasses
import resource
import time

import torch

TEMPERATURE = 1.0


def _spec(quick: bool):
    from megatron_rl.models.spec import get_model_spec

    return get_model_spec("tiny-llama").replace(name="bench-packing", hidden_size=256, ffn_hidden_size=688,
                                                num_layers=2 if quick else 4, num_attention_heads=8,
                                                num_key_value_heads=4, vocab_size=512)


def long_tail_batch(vocab_size: int, n: int, prompt: int, median: int, max_response: int, seed: int = 0):
    """`n` rollouts: `prompt` prompt tokens each, response lengths log-normal around `median` (sigma 0.68), at most
    `max_response`."""
    from megatron_rl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    responses = (median * torch.exp(0.68 * torch.randn(n, generator=g))).round().clamp(1, max_response).long()
    return TrainBatch.from_sequences(
        torch.randint(0, vocab_size, (n, prompt), generator=g).tolist(),
        [torch.randint(0, vocab_size, (int(r),), generator=g).tolist() for r in responses],
        [(-torch.rand(int(r), generator=g) * 5).tolist() for r in responses], torch.randn(n, generator=g).tolist())


def time_three_ways(spec, layout, batch, steps: int, micro_batch_size: int, **policy_kwargs) -> dict:
    """Seconds per AIPO step on `batch` (after a warm-up step) and the tokens the model ran on: every row padded to
    the batch's longest (the trainer before packing), rows padded per micro-batch of `micro_batch_size`, and packed
    with a budget of the longest rollout (the least a run may set). Needs Megatron-Core's parallel state."""
    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.trainer import packing
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer

    width = batch.tokens.shape[1]
    globally_padded = dataclasses.replace(batch, lengths=torch.full((len(batch),), width))
    ways = {"globally_padded": (globally_padded, packing.MicroBatching(micro_batch_size=micro_batch_size)),
            "padded": (batch, packing.MicroBatching(micro_batch_size=micro_batch_size)),
            "packed": (batch, packing.MicroBatching(max_tokens=width))}
    out = {}
    for name, (data, batching) in ways.items():
        policy = build_policy(spec, layout, lr=1e-4, **policy_kwargs)
        trainer = PolicyTrainer(policy, AlgorithmConfig(), batching=batching)
        trainer.train_step(data)  # warm-up
        _synchronize(policy.device)
        start = time.perf_counter()
        for _ in range(steps):
            metrics = trainer.train_step(data)
        _synchronize(policy.device)
        out[name] = {"step_s": (time.perf_counter() - start) / steps, "model_tokens": metrics["model_tokens"]}
        del trainer, policy
    out["real_tokens"] = int(batch.seq_lengths.sum())
    out["longest"] = width
    return out


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _step_rank(quick: bool, steps: int, sizes: dict):
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.trainer import parallel

    spec = _spec(quick)
    layout = TrainerLayout(1, 1, dtype_bytes=4)
    parallel.initialize(layout, spec)
    out = time_three_ways(spec, layout, long_tail_batch(spec.vocab_size, **sizes), steps, micro_batch_size=8)
    parallel.destroy()
    return out


def _logprob_memory_rank(positions: int, vocab: int, chunk_tokens: int | None) -> float:
    """GiB the next-token log-prob forward and backward add to the peak RSS over their [1, positions, vocab] fp32
    logits: the trainer's (`chunk_tokens` positions at a time, the gradient in the logits' storage); None: a plain
    fp32 log_softmax with its entropy, autograd saving what it needs."""
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.logprobs import next_token_logprobs_and_entropy

    parallel.initialize(TrainerLayout(1, 1, dtype_bytes=4))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, positions, 64, generator=g)
    head = torch.randn(64, vocab, generator=g).requires_grad_()
    logits = hidden @ head  # an output layer's, whose backward makes nothing logits-sized
    targets = torch.randint(0, vocab, (1, positions), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if chunk_tokens is None:
        logp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, -1)
        lp, entropy = logp.gather(-1, targets[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(-1)
    else:
        lp, entropy = next_token_logprobs_and_entropy(logits, targets, vocab, TEMPERATURE, chunk_tokens)
    (lp.sum() + 0.01 * entropy.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    parallel.destroy()
    return (peak - before) / 2**20


def run(quick: bool = False) -> dict:
    from megatron_rl.runtime.spawn import run_on_ranks
    from megatron_rl.trainer.logprobs import CHUNK_TOKENS

    sizes = dict(n=128, prompt=8, median=32, max_response=512) if quick else \
        dict(n=256, prompt=16, median=48, max_response=1024)
    r = run_on_ranks(_step_rank, 1, quick, 2, sizes, timeout_s=3600)[0]
    real, full = r["real_tokens"], r["globally_padded"]["model_tokens"]
    positions, vocab = (4096, 32768) if quick else (8192, 32768)
    chunked = run_on_ranks(_logprob_memory_rank, 1, positions, vocab, CHUNK_TOKENS)[0]
    plain = run_on_ranks(_logprob_memory_rank, 1, positions, vocab, None)[0]
    speedup = r["globally_padded"]["step_s"] / r["packed"]["step_s"]
    ideal = full / real
    return {
        "rollouts": sizes["n"], "real_tokens": real, "longest_rollout": r["longest"],
        "step_s_globally_padded": r["globally_padded"]["step_s"], "step_s_padded_per_microbatch":
            r["padded"]["step_s"], "step_s_packed": r["packed"]["step_s"],
        "packed_vs_globally_padded": speedup, "ideal_ratio": ideal, "fraction_of_ideal": speedup / ideal,
        "padding_fraction_globally_padded": 1 - real / full,
        "padding_fraction_padded_per_microbatch": 1 - real / r["padded"]["model_tokens"],
        "padding_fraction_packed": 1 - real / r["packed"]["model_tokens"],
        "logprob_positions": positions, "logprob_vocab": vocab, "logprob_peak_gib_chunked": chunked,
        "logprob_peak_gib_plain": plain, "logprob_peak_plain_vs_chunked": plain / chunked,
        "note": "1 process, 2 CPU cores, fp32; local spec: a packed row's attention is a dense block-diagonal "
                "mask over the whole micro-batch (THD on Transformer Engine skips the masked blocks); peak: "
                "the rise of the process's max RSS over the logits it was given",
    }
