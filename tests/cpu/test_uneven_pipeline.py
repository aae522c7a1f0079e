"""A trainer with uneven pipeline stages trains and syncs: 5 layers over PP=2 as 1 + 4
(--decoder-first-pipeline-num-layers 1) at TP=2, one generator at TP=1, through the run's own pieces (run setup,
process groups of `init_roles`, the trainer executor's train and publish commands, the built-in engine).

After one optimizer step and one DDMA publish, every runtime tensor of the generator must equal, bit for bit, the
slice of the trainer's updated weights that the layout mapping assigns to it (fp32: nothing is rounded)."""

import pytest
import torch

from megatron_rl.models import weight_map
from megatron_rl.runtime.spawn import run_on_ranks

FLAGS = ["--num-layers", "5", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
         "--tensor-model-parallel-size", "2", "--rollout-tensor-parallel-size", "1", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-2", "--seq-length", "32", "--output-dir", "unused"]
WORLD = 5  # trainer TP 2 x PP 2, then the generator


def _rank():
    import torch.distributed as dist

    from megatron_rl.config.arguments import parse_args
    from megatron_rl.config.setup import build_run_setup
    from megatron_rl.ddma.sync import publish
    from megatron_rl.ddma.transport import make_transport
    from megatron_rl.rollout import ENGINE_BACKENDS
    from megatron_rl.runtime.roles import init_roles
    from megatron_rl.trainer.batch import TrainBatch

    setup = build_run_setup(parse_args(FLAGS), WORLD)
    roles = init_roles(setup.trainer.world_size, 1, 1)
    if not roles.is_trainer:
        engine = ENGINE_BACKENDS["local"].build(setup, roles)
        publish(setup.plan(), roles.rank, 1, engine=engine, transport=make_transport(roles))
        out = {"runtime": dict(engine.decoder.params), "version": engine.weight_version}
    else:
        from megatron.core import parallel_state as ps

        from megatron_rl.trainer.executor import TrainerExecutor

        trainer = TrainerExecutor(setup, roles)
        module = trainer.trainer.policy.module
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        if roles.is_controller:
            g = torch.Generator().manual_seed(0)
            vocab = setup.spec.vocab_size
            batch = TrainBatch.from_sequences([torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(4)],
                                              [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(4)],
                                              [[-2.0] * 6] * 4, [1.0, -1.0, 0.5, -0.5])
            step_lrs = []  # the learning rate each optimizer step runs with
            optimizer = trainer.trainer.policy.optimizer
            step = optimizer.step_with_ready_grads  # the update itself (trainer.policy.optimizer_step calls it)
            optimizer.step_with_ready_grads = lambda: (step_lrs.append(optimizer.param_groups[0]["lr"]), step())[1]
            trainer.command("sft", (batch, 0.05))  # a warm-up step at its own lr; RL must return to --lr
            metrics = trainer.command("train", batch)
            metrics["step_lrs"] = step_lrs
            trainer.command("publish", 1)
            trainer.stop()
        else:
            trainer.serve()
            metrics = None
        out = {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
               "params": {n: p.detach().clone() for n, p in module.named_parameters()}, "metrics": metrics,
               "moved": max((p.detach() - before[n]).abs().max().item() for n, p in module.named_parameters())}
    out.update(spec=setup.spec, layout=setup.trainer)
    dist.destroy_process_group()
    return out


@pytest.mark.slow  # 5 processes, about a minute: the default suite stays under its 15 minutes
def test_uneven_pipeline_stages_train_and_the_generator_gets_the_weights_bit_for_bit():
    from megatron_rl.trainer.weights import merge_to_hf

    *trainers, generator = run_on_ranks(_rank, WORLD, backend=None, timeout_s=600)
    spec, layout = generator["spec"], generator["layout"]
    assert layout.stage_sizes(spec) == [1, 4]
    assert {len({n.split(".")[2] for n in t["params"] if n.startswith("decoder.layers.")}) for t in trainers} == {1, 4}
    assert trainers[0]["metrics"]["update_successful"] and all(t["moved"] > 0 for t in trainers)
    assert trainers[0]["metrics"]["step_lrs"] == [0.05, 1e-2]  # the RL step at --lr, not the warm-up's
    hf = merge_to_hf(spec, layout, {(t["tp_rank"], t["pp_rank"]): t["params"] for t in trainers})
    assert generator["version"] == 1
    runtime = generator["runtime"]
    expected = weight_map.sglang_shards(spec, 1, 0)
    assert runtime.keys() == expected.keys()
    for name, shard in expected.items():
        assert torch.equal(runtime[name], weight_map.assemble(shard, weight_map.slicer(hf))), name
