"""A ~1B-parameter random Llama on one GPU: the trainer's AIPO step (tokens/s and model FLOPs utilization; on a
long-tail batch padded and packed, `bench.packing`'s three ways) and the built-in engine's decode (tokens/s at
batch 1, 32 and 128). Needs CUDA; on a CPU it reports that it did not run.

MFU counts the model's FLOPs per trained token as Megatron does (6 x parameters for the matmuls, plus attention's
12 x layers x hidden x sequence length), over the GPU's dense bf16 peak (`PEAK_BF16_TFLOPS`, by device name).
"""

from __future__ import annotations

import time

import torch

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}  # dense, SXM parts
SEQUENCES, PROMPT, RESPONSE, MICRO_BATCH = 16, 256, 768, 4
DECODE_BATCHES, DECODE_PROMPT, DECODE_TOKENS = (1, 32, 128), 32, 64


def _spec():
    from megatron_rl.models.spec import get_model_spec

    return get_model_spec("tiny-llama").replace(
        name="bench-1b", hidden_size=2048, ffn_hidden_size=5632, num_layers=16, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048)


def _trainer_rank(steps: int) -> dict:
    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.batch import TrainBatch
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer

    spec = _spec()
    layout = TrainerLayout(1, 1, 1)
    device = parallel.initialize(layout, spec, device="cuda")
    trainer = PolicyTrainer(build_policy(spec, layout, lr=1e-5, bf16=True, device=device), AlgorithmConfig(),
                            batching=MICRO_BATCH)
    g = torch.Generator().manual_seed(0)
    batch = TrainBatch.from_sequences(
        torch.randint(0, spec.vocab_size, (SEQUENCES, PROMPT), generator=g).tolist(),
        torch.randint(0, spec.vocab_size, (SEQUENCES, RESPONSE), generator=g).tolist(),
        (-torch.rand(SEQUENCES, RESPONSE, generator=g) * 5).tolist(), torch.randn(SEQUENCES, generator=g).tolist())
    trainer.train_step(batch)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batch)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = SEQUENCES * (PROMPT + RESPONSE) * steps / elapsed
    seq = PROMPT + RESPONSE
    flops_per_token = 6 * spec.num_parameters() + 12 * spec.num_layers * spec.hidden_size * seq
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    parallel.destroy()
    return {"parameters": spec.num_parameters(), "tokens_per_step": SEQUENCES * seq, "tokens_per_s": tokens_per_s,
            "model_tflops": tokens_per_s * flops_per_token / 1e12,
            "mfu": tokens_per_s * flops_per_token / (peak * 1e12) if peak else None,
            "peak_bf16_tflops": peak, "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def _packing_rank(steps: int) -> dict:
    """The ~1B model's AIPO step on a long-tail batch (64 rollouts, 64-token prompts, responses log-normal around
    512 tokens, at most 1,536), padded to the longest, padded per micro-batch of 4, and packed (bf16; Transformer
    Engine's spec, THD, when it is installed, else the local spec with its dense block-diagonal mask)."""
    import importlib.util

    from megatron_rl.bench.packing import long_tail_batch, time_three_ways
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.trainer import parallel

    spec = _spec()
    impl = "transformer_engine" if importlib.util.find_spec("transformer_engine") else "local"
    layout = TrainerLayout(1, 1, 1, transformer_impl=impl)
    device = parallel.initialize(layout, spec, device="cuda")
    batch = long_tail_batch(spec.vocab_size, n=64, prompt=64, median=512, max_response=1536)
    out = time_three_ways(spec, layout, batch, steps, micro_batch_size=4, bf16=True, device=device)
    parallel.destroy()
    real = out["real_tokens"]
    return {**out, "layer_spec": impl,
            **{f"real_tokens_per_s_{way}": real / out[way]["step_s"]
               for way in ("globally_padded", "padded", "packed")},
            "packed_vs_globally_padded": out["globally_padded"]["step_s"] / out["packed"]["step_s"],
            "ideal_ratio": out["globally_padded"]["model_tokens"] / real}


def _decode(batch: int, spec) -> float:
    from megatron_rl.rollout.local.decoder import TPDecoder
    from megatron_rl.rollout.local.engine import LocalEngine
    from megatron_rl.rollout.types import SamplingParams

    decoder = TPDecoder(spec, dtype=torch.bfloat16, max_slots=batch + 1, max_seq_len=DECODE_PROMPT + DECODE_TOKENS,
                        device="cuda")
    g = torch.Generator().manual_seed(0)
    staged = {}
    for name, (shape, _) in decoder.expected().items():
        decoder.load(name, torch.randn(shape, generator=g) * 0.02, staged)
    decoder.install(staged)
    engine = LocalEngine(decoder)
    prompts = torch.randint(0, spec.vocab_size, (batch, DECODE_PROMPT), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=DECODE_TOKENS, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))  # warm-up
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # the prefill of the whole batch (and its first token)
    torch.cuda.synchronize()
    start, tokens = time.perf_counter(), 0
    while engine.has_work():
        tokens += engine.num_running
        engine.step()
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def run(quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    from megatron_rl.runtime.spawn import run_on_ranks

    spec = _spec()
    out = {"device": torch.cuda.get_device_name(), "model": f"random Llama, {spec.num_parameters() / 1e9:.2f}B "
           f"parameters ({spec.num_layers} layers, hidden {spec.hidden_size})",
           "trainer": run_on_ranks(_trainer_rank, 1, 3 if quick else 6, backend="nccl", timeout_s=600)[0],
           "trainer_batch": f"{SEQUENCES} sequences x {PROMPT + RESPONSE} tokens, micro-batch {MICRO_BATCH}, bf16, "
                            "local layer spec"}
    out["trainer_packing"] = run_on_ranks(_packing_rank, 1, 2 if quick else 4, backend="nccl", timeout_s=900)[0]
    out["engine_decode_tokens_per_s"] = {f"batch_{b}": _decode(b, spec) for b in DECODE_BATCHES}
    out["engine_decode"] = f"{DECODE_PROMPT}-token prompts, {DECODE_TOKENS} new tokens each, bf16, sampling at T=1"
    return out
