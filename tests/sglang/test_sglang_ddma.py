"""DDMA into a real SGLang TP=2 engine: Megatron TP=2 trainer shards go point to point to the two generator
ranks, each hands only its own SGLang TP rank's shards to the server, and the server then generates exactly
what the built-in engine does from the same HF checkpoint. Before the first sync the engine refuses to
report rollouts from its start-up (dummy) weights. A server killed after the sync is restarted with both ranks'
shards (the other rank's from the leader's view of its shared memory) and generates the same again. A second
update, installed in buckets (as on GPUs) of 64 KiB, brings checkpoint A: the server then generates what the built-in
engine does from A."""

import os
import signal

import torch
from conftest import SPEC

from megatron_rl.rollout.local.engine import LocalEngine
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.runtime.spawn import run_on_ranks

PROMPTS = [[1, 5, 9, 13], [2, 40, 41, 42, 43, 44, 45]]
GREEDY = dict(temperature=0.0, max_new_tokens=10, ignore_eos=True)


BUCKET = 64 * 2**10


def _trainer_tp2_to_sglang_tp2(model_dir, log_dir, second_model_dir):
    import torch.distributed as dist

    from megatron_rl.ddma.plan import make_plan
    from megatron_rl.ddma.sync import publish, schedule
    from megatron_rl.ddma.transport import TorchDistTransport
    from megatron_rl.models import weight_map
    from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.rollout.sglang.engine import RolloutContractError, start_replica_engine

    rank = dist.get_rank()
    trainer, generator = TrainerLayout(2, 1, 1, dtype_bytes=4), GeneratorLayout(2, 1, first_rank=2)
    plan = make_plan(SPEC, trainer, generator)
    replica = dist.new_group([2, 3])
    result = {}
    if rank < 2:
        reader = HFCheckpoint(model_dir)
        tensors = {n: weight_map.assemble(s, reader.get_slice)
                   for n, s in weight_map.megatron_shards(SPEC, trainer, rank, 0).items()}
        dist.barrier()  # the generators' server is up
        stats = publish(plan, rank, version=1, trainer_tensors=tensors, transport=TorchDistTransport())
        second = HFCheckpoint(second_model_dir)
        tensors = {n: weight_map.assemble(s, second.get_slice)
                   for n, s in weight_map.megatron_shards(SPEC, trainer, rank, 0).items()}
        publish(plan, rank, version=2, trainer_tensors=tensors, transport=TorchDistTransport(), bucket_bytes=BUCKET)
    else:
        engine = start_replica_engine(SPEC, 2, replica, rank == 2, model_dir, f"{log_dir}/server.log")
        if rank == 2:
            try:
                engine.generate([PROMPTS[0]], SamplingParams(**GREEDY))
            except RolloutContractError as e:
                result["before_sync"] = str(e)
        dist.barrier()
        stats = publish(plan, rank, version=1, engine=engine, transport=TorchDistTransport())
        if rank == 2:
            result["greedy"] = engine.generate(PROMPTS, SamplingParams(**GREEDY))
            os.killpg(engine.server.process.pid, signal.SIGKILL)
            engine.server.process.wait()
            result["after_restart"] = engine.generate(PROMPTS, SamplingParams(**GREEDY))
            result["restarts"] = engine.restarts
        engine.pause("retract")
        engine.installs_in_buckets = True
        publish(plan, rank, version=2, engine=engine, transport=TorchDistTransport(), bucket_bytes=BUCKET)
        engine.continue_generation()
        result["commits"] = len(schedule(plan, BUCKET).commits(rank))
        if rank == 2:
            result["second"] = engine.generate(PROMPTS, SamplingParams(**GREEDY))
            result["kept_for_a_restart"] = engine._serving is not None
        engine.shutdown()
    result.update(received=stats.bytes_received, sent=stats.bytes_sent, planned=plan.bytes_received(rank),
                  total=sum(plan.bytes_received(r) for r in (2, 3)))
    dist.barrier()
    return result


def test_ddma_from_megatron_tp2_into_sglang_tp2(model_a, model_b, tmp_path):
    reports = run_on_ranks(_trainer_tp2_to_sglang_tp2, 4, model_b, str(tmp_path), model_a, timeout_s=900)
    leader, other = reports[2], reports[3]
    assert "weight version -1" in leader["before_sync"]
    want = LocalEngine.from_hf(model_b).generate(PROMPTS, SamplingParams(**GREEDY))
    for got, ref in zip(leader["greedy"] + leader["after_restart"], want + want):
        assert got.token_ids == ref.token_ids and got.versions == [1] * len(got.token_ids)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
    assert leader["restarts"] == 1
    # each generator rank received its own shards only: about half of the model each, as planned
    for report in (leader, other):
        assert report["received"] == report["planned"] < 0.75 * report["total"]
    # the second update went to the server in several buckets, and is not kept for a restart
    assert leader["commits"] == other["commits"] >= 2 and not leader["kept_for_a_restart"]
    want = LocalEngine.from_hf(model_a).generate(PROMPTS, SamplingParams(**GREEDY))
    for got, ref in zip(leader["second"], want):
        assert got.token_ids == ref.token_ids and got.versions == [2] * len(got.token_ids)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
