"""A ~1B-parameter random Llama on one GPU: the trainer's AIPO step (tokens/s and model FLOPs utilization; on a
long-tail batch padded and packed, `bench.packing`'s three ways), the built-in engine's decode (tokens/s at
batch 1, 32 and 128), and a weight sync into a generator's GPU (`handover_rank`: DDMA from a trainer rank to a
generator rank on the same GPU, whose engine hands each bucket to an installing process through CUDA IPC, as into
an SGLang TP worker), in bytes/s against the GPU's own device-to-device copy. Needs CUDA; on a CPU it reports that it
did not run.

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


def random_weights(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights (std 0.02) drawn on the GPU: a ~1B model's take seconds on a CPU, milliseconds here. The
    same seed gives the same weights in every process on the same kind of GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {n: torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
            for n, shape in shapes.items()}


def _decode(spec) -> dict[str, float]:
    """The built-in engine's decode tokens/s at each batch size of DECODE_BATCHES, one engine for all."""
    from megatron_rl.rollout.local.decoder import TPDecoder
    from megatron_rl.rollout.local.engine import LocalEngine
    from megatron_rl.rollout.types import SamplingParams

    decoder = TPDecoder(spec, dtype=torch.bfloat16, max_slots=max(DECODE_BATCHES) + 1,
                        max_seq_len=DECODE_PROMPT + DECODE_TOKENS, device="cuda")
    staged = {}
    for name, tensor in random_weights({n: shape for n, (shape, _) in decoder.expected().items()}).items():
        decoder.load(name, tensor, staged, copy=False)
    decoder.install(staged)
    engine = LocalEngine(decoder)
    params = SamplingParams(temperature=1.0, max_new_tokens=DECODE_TOKENS, ignore_eos=True)
    engine.generate([[1] * DECODE_PROMPT], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    g = torch.Generator().manual_seed(0)
    out = {}
    for batch in DECODE_BATCHES:
        for p in torch.randint(0, spec.vocab_size, (batch, DECODE_PROMPT), generator=g).tolist():
            engine.add_request(p, params)
        engine.step()  # the prefill of the whole batch (and its first token)
        torch.cuda.synchronize()
        start, tokens = time.perf_counter(), 0
        while engine.has_work():
            tokens += engine.num_running
            engine.step()
        torch.cuda.synchronize()
        out[f"batch_{batch}"] = tokens / (time.perf_counter() - start)
    return out


def _installer(conn, shapes: dict, dtype: torch.dtype) -> None:
    """The SGLang TP worker's stand-in, in a process of its own on the same GPU: parameters of its own; each message
    is a pickled list of (name, CUDA tensor) made with torch's reductions (CUDA IPC handles, as SGLang's
    `MultiprocessingSerializer` sends them), copied into the parameters. At the end it sends an exact checksum of
    each parameter and the seconds it spent opening and copying."""
    from torch.multiprocessing.reductions import ForkingPickler

    torch.cuda.set_device(0)
    params = {n: torch.zeros(shape, dtype=dtype, device="cuda") for n, shape in shapes.items()}
    conn.send_bytes(b"ready")
    busy = 0.0
    while (message := conn.recv_bytes()) != b"done":
        start = time.perf_counter()
        for name, tensor in ForkingPickler.loads(message):
            params[name].copy_(tensor)
        torch.cuda.synchronize()
        busy += time.perf_counter() - start
        conn.send_bytes(b"ok")
    conn.send(({n: exact_checksum(p) for n, p in params.items()}, busy))


def exact_checksum(t: torch.Tensor) -> int:
    return int(t.contiguous().view(torch.uint8).to(torch.int64).sum())


class IpcInstaller:
    """An engine (the DDMA protocol of `LocalEngine` / `SGLangEngine`) that installs in buckets: each commit sends CUDA
    IPC handles of the received tensors to `_installer` and waits until it copied them, then drops them."""

    reusable_receive_buffers = False
    installs_in_buckets = True

    def __init__(self, shapes: dict, dtype: torch.dtype):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_installer, args=(child, shapes, dtype), daemon=True)
        self.process.start()
        assert self.conn.recv_bytes() == b"ready"
        self.staged, self.weight_version, self.commits, self.peak = None, -1, 0, 0

    def begin_weight_update(self) -> None:
        self.staged = {}

    def load_weights(self, named_tensors, copy: bool = True) -> None:
        self.staged.update(named_tensors)

    def commit_bucket(self) -> None:
        from torch.multiprocessing.reductions import ForkingPickler

        self.peak = max(self.peak, torch.cuda.memory_allocated())
        self.conn.send_bytes(bytes(ForkingPickler.dumps(list(self.staged.items()))))
        assert self.conn.recv_bytes() == b"ok"
        self.staged = {}
        self.commits += 1

    def end_weight_update(self, version: int) -> None:
        self.commit_bucket()
        self.weight_version = version

    def abort_weight_update(self) -> None:
        self.staged = None

    def finish(self) -> tuple[dict, float]:
        self.conn.send_bytes(b"done")
        checksums, busy = self.conn.recv()
        self.process.join(timeout=60)
        return checksums, busy


def handover_rank(spec, rank: int, bucket_bytes: int, seed: int = 0) -> dict:
    """Rank 0 (trainer, TP 1, bf16) publishes random weights to rank 1 (a generator rank at TP 1 on the same GPU,
    so over the staged transport), whose `IpcInstaller` installs them in buckets. Rank 1 reports the runtime tensors
    that differ from the trainer's weights in SGLang's layout, its peak GPU memory during the update beyond what it
    held before, and the seconds and bytes."""
    import torch.distributed as dist

    from megatron_rl.ddma.plan import make_plan
    from megatron_rl.ddma.sync import publish, schedule
    from megatron_rl.ddma.transport import StagedTransport
    from megatron_rl.models import weight_map
    from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout

    torch.cuda.set_device(0)
    trainer, generator = TrainerLayout(1, 1, 1, dtype_bytes=2), GeneratorLayout(1, 1, first_rank=1)
    plan = make_plan(spec, trainer, generator)
    hf = random_weights(weight_map.hf_shapes(spec), seed)
    transport = StagedTransport()
    if rank == 0:
        tensors = {n: weight_map.assemble(s, weight_map.slicer(hf))
                   for n, s in weight_map.megatron_shards(spec, trainer, 0, 0).items()}
        dist.barrier()  # the installer is up
        stats = publish(plan, 0, 1, trainer_tensors=tensors, transport=transport, bucket_bytes=bucket_bytes)
        return {"sent": stats.bytes_sent, "seconds": stats.seconds}
    layouts = plan.runtime[1]
    installer = IpcInstaller({n: s.shape for n, s in layouts.items()}, torch.bfloat16)
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    stats = publish(plan, 1, 1, engine=installer, transport=transport, dtype=torch.bfloat16, device="cuda",
                    bucket_bytes=bucket_bytes)
    peak = max(torch.cuda.max_memory_allocated(), installer.peak) - before
    checksums, install_s = installer.finish()
    want = {n: exact_checksum(weight_map.assemble(s, weight_map.slicer(hf))) for n, s in layouts.items()}
    return {"mismatched": sorted(n for n in want if checksums.get(n) != want[n]), "version": installer.weight_version,
            "commits": installer.commits, "peak_receive_bytes": peak, "shard_bytes": plan.shard_bytes(1),
            "receive_peak_bound": schedule(plan, bucket_bytes).receive_peak(1, bucketed=True),
            "largest_tensor_bytes": max(plan.tensor_bytes(1, n) for n in layouts), "received": stats.bytes_received,
            "planned": plan.bytes_received(1), "seconds": stats.seconds, "install_seconds": install_s}


def _copy_gbps(nbytes: int = 2**30) -> float:
    """The GPU's device-to-device copy speed (GB/s of data copied) on one buffer of `nbytes`."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8,
                                                                                  device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 10 * nbytes / (time.perf_counter() - start) / 1e9


def _weight_sync(spec) -> dict:
    from megatron_rl.runtime.spawn import run_on_ranks

    trainer, generator = run_on_ranks(handover_rank, 2, spec, 256 * 2**20, timeout_s=120)
    nbytes = generator["received"]
    return {"bytes": nbytes, "bucket_mb": 256, "commits": generator["commits"],
            "publish_gbps": nbytes / generator["seconds"] / 1e9,
            "install_gbps": nbytes / generator["install_seconds"] / 1e9, "device_copy_gbps": _copy_gbps(),
            "peak_receive_gib": generator["peak_receive_bytes"] / 2**30,
            "mismatched_tensors": len(generator["mismatched"]),
            "path": "trainer GPU -> host -> gloo -> generator GPU (the staged transport: one GPU), then CUDA IPC "
                    "into the installing process"}


def run(quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "needs CUDA"}
    from megatron_rl.runtime.spawn import run_on_ranks

    spec = _spec()
    out = {"device": torch.cuda.get_device_name(), "model": f"random Llama, {spec.num_parameters() / 1e9:.2f}B "
           f"parameters ({spec.num_layers} layers, hidden {spec.hidden_size})",
           "trainer": run_on_ranks(_trainer_rank, 1, 3 if quick else 6, backend="nccl", timeout_s=120)[0],
           "trainer_batch": f"{SEQUENCES} sequences x {PROMPT + RESPONSE} tokens, micro-batch {MICRO_BATCH}, bf16, "
                            "local layer spec"}
    out["trainer_packing"] = run_on_ranks(_packing_rank, 1, 2 if quick else 4, backend="nccl", timeout_s=120)[0]
    out["engine_decode_tokens_per_s"] = _decode(spec)
    out["engine_decode"] = f"{DECODE_PROMPT}-token prompts, {DECODE_TOKENS} new tokens each, bf16, sampling at T=1"
    out["weight_sync"] = _weight_sync(spec)
    return out
