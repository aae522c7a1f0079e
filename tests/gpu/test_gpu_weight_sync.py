"""Weights into a generator's GPU and the engine's KV budget, on one GPU.

The hand-over: a trainer rank publishes a model through DDMA to a generator rank on the same GPU (the staged
transport: NCCL needs a GPU per rank), whose engine installs each bucket as it completes by handing CUDA IPC handles
(torch's own reductions, what SGLang's `MultiprocessingSerializer` sends) to a second process that owns the
parameters, as an SGLang TP worker does; SGLang itself is too large for the GPU machine (`bench.gpu.IpcInstaller`
stands in for its worker). The installed parameters must equal the trainer's weights in SGLang's layout bit for bit,
and the receiving rank must hold about a bucket of them at a time, not the whole shard."""

import types

import pytest
import torch

from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks

SPEC = get_model_spec("tiny-llama").replace(name="gpu-sync", hidden_size=512, ffn_hidden_size=1408, num_layers=4,
                                            num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)
BUCKET = 2**20


def _publish_rank():
    import torch.distributed as dist

    from megatron_rl.bench.gpu import handover_rank

    return handover_rank(SPEC, dist.get_rank(), BUCKET, seed=0)


def test_weights_reach_an_installing_process_through_cuda_ipc_in_buckets():
    trainer, generator = run_on_ranks(_publish_rank, 2, timeout_s=120)
    assert generator["mismatched"] == [] and generator["version"] == 1
    assert generator["commits"] >= 4  # the model went over in buckets, not at once
    # the receiving rank's own GPU memory during the update: a few buckets, far from the shard's size
    assert generator["peak_receive_bytes"] <= 4 * BUCKET + generator["largest_tensor_bytes"]
    assert generator["peak_receive_bytes"] < generator["shard_bytes"] / 2
    # what SGLang's --mem-fraction-static leaves room for (rollout.sglang.memory) bounds what the rank allocated
    assert generator["peak_receive_bytes"] <= generator["receive_peak_bound"]
    assert trainer["sent"] == generator["received"] == generator["planned"]


def test_kv_cache_fits_a_budget_where_slots_times_length_would_not():
    """Qwen3-8B at 16k tokens with 64 requests: slots x max length would be 65 x 16,384 tokens x 144 KiB = 146 GiB of
    KV, more than the GPU has; the token budget from --rollout-mem-fraction-static fits, and is allocated."""
    from megatron_rl.rollout.local import kv_cache_tokens
    from megatron_rl.rollout.local.decoder import TPDecoder

    spec = get_model_spec("qwen3-8b")
    args = types.SimpleNamespace(rollout_kv_cache_tokens=None, rollout_mem_fraction_static=0.8, seq_length=16384)
    per_token = TPDecoder.kv_bytes_per_token(spec, 1, torch.bfloat16)
    full = 65 * 16384
    _, total = torch.cuda.mem_get_info()
    assert full * per_token > total
    tokens, why = kv_cache_tokens(args, spec, 1, torch.bfloat16, torch.device("cuda"), True, 65)
    assert 16384 <= tokens < full and "--rollout-mem-fraction-static" in why
    decoder = TPDecoder(spec, dtype=torch.bfloat16, max_slots=65, max_seq_len=16384, device="cuda",
                        kv_cache_tokens=tokens)
    assert decoder.k_cache.numel() * 2 * 2 == tokens * per_token
    free, _ = torch.cuda.mem_get_info()
    assert free > total * 0.2 - 2**30  # what the fraction leaves (weights not loaded here), give or take a GiB


def _train_while_publishing():
    """Ranks 0 and 1: a TP=2 trainer that posts a background publish, then runs TP all-reduces on its training stream
    and only then lets the generator (rank 2) receive. Were the publish's NCCL waits on the training stream, the
    all-reduces would queue behind sends that the generator does not take until they are done: a deadlock."""
    import torch.distributed as dist
    from helpers import random_hf_weights

    from megatron_rl.ddma.plan import make_plan
    from megatron_rl.ddma.sync import SideStream, publish
    from megatron_rl.models import weight_map
    from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
    from megatron_rl.rollout.local.decoder import TPDecoder
    from megatron_rl.rollout.local.engine import LocalEngine

    rank, device = dist.get_rank(), torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(device)
    plan = make_plan(SPEC, TrainerLayout(2, 1, 1, dtype_bytes=4), GeneratorLayout(1, 1, first_rank=2))
    tp_group = dist.new_group([0, 1])
    signals = dist.new_group(backend="gloo")
    hf = random_hf_weights(SPEC, seed=1)
    if rank < 2:
        tensors = {n: weight_map.assemble(s, weight_map.slicer(hf)).to(device)
                   for n, s in weight_map.megatron_shards(SPEC, plan.trainer, rank, 0).items()}
        pending = publish(plan, rank, 1, trainer_tensors=tensors, bucket_bytes=BUCKET, background=True,
                          stream=SideStream(device))
        x = torch.ones(2**20, device=device)
        for _ in range(20):  # a rank posts its next rounds meanwhile: the two ranks' rounds drift apart
            dist.all_reduce(x, group=tp_group)
        torch.cuda.current_stream(device).synchronize()
        dist.barrier(group=signals)  # the generator receives only now
        pending.wait()
        return float(x[0])
    engine = LocalEngine(TPDecoder(SPEC, 1, 0, None, device=device))
    dist.barrier(group=signals)
    publish(plan, rank, 1, engine=engine, bucket_bytes=BUCKET, device=device)
    return all(torch.equal(engine.decoder.params[n].cpu(), weight_map.assemble(s, weight_map.slicer(hf)))
               for n, s in weight_map.sglang_shards(SPEC, 1, 0).items())


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="NCCL needs a GPU per rank: 2 trainer ranks + 1 generator")
def test_training_collectives_never_wait_for_a_generator():
    first, second, installed = run_on_ranks(_train_while_publishing, 3, backend="nccl", timeout_s=120)
    assert first == second == 2.0**20 and installed
