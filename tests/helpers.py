"""Helpers shared by every test tier (not part of the package); each tier imports them through tests/conftest.py's
folder, which pytest puts on sys.path."""

import pathlib

import torch

from megatron_rl.models import weight_map
from megatron_rl.models.spec import ModelSpec

ROOT = str(pathlib.Path(__file__).resolve().parents[1])  # the repository


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """All-gather the TP vocab shards of the last dim (a full-vocabulary reference for tests; training never
    gathers the vocabulary)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits.contiguous())


def random_hf_weights(spec: ModelSpec, seed: int = 0, std: float = 0.05) -> dict[str, torch.Tensor]:
    """Deterministic random HF-named fp32 weights (norm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_map.hf_shapes(spec).items():
        t = torch.randn(shape, generator=g) * std
        out[name] = t + 1.0 if name.endswith("norm.weight") else t
    return out


def mismatched_generator_tensors(engine, spec: ModelSpec, hf: dict[str, torch.Tensor], tp: int, tp_rank: int,
                                 ep: int = 1) -> list[str]:
    """The runtime tensors of a generator rank that differ from the reference `hf` weights in its layout, bit for
    bit (an FP8 tensor is compared with the reference quantized the same way)."""
    from megatron_rl.models.fp8 import quantize_block_fp8

    mismatched = []
    for name, shard in weight_map.sglang_shards(spec, tp, tp_rank, ep).items():
        expected, got = weight_map.assemble(shard, weight_map.slicer(hf)), engine.decoder.params[name]
        if got.dtype == torch.float8_e4m3fn:
            q, s = quantize_block_fp8(expected)
            ok = torch.equal(got.view(torch.uint8), q.view(torch.uint8)) and \
                torch.equal(engine.decoder.params[name + "_scale_inv"], s)
        else:
            ok = torch.equal(got, expected)
        if not ok:
            mismatched.append(name)
    return mismatched


def policy_turns(turns: int, tokens: int, observation: list[int]):
    """A rollout program: `turns` policy calls of `tokens` tokens each, `observation` (not the policy's) between
    them."""
    from megatron_rl.rollout.agent import Trajectory

    async def program(sample, client):
        trajectory = Trajectory(list(sample.prompt_token_ids))
        for turn in range(turns):
            if turn:
                trajectory.add_observation(observation)
            await client.sample(trajectory, max_new_tokens=tokens, ignore_eos=True)
        return trajectory

    return program


def drive_agents(engine, runner, samples, params, update=None, when=None) -> list:
    """What the generator worker does with an `AgentRunner`: policy calls into the engine, outputs back, until
    every program finished; `update()` (a weight update with its pause), if given, once, as soon as `when(engine
    steps so far)` is true. The programs' outputs, in finishing order."""
    for sample in samples:
        runner.start(sample, params)
    finished, steps, updated = [], 0, update is None
    while len(finished) < len(samples):
        for rid, prompt, call_params in runner.take_calls():
            engine.add_request(prompt, call_params, rid)
        if engine.has_work():
            runner.resolve(engine.step())
            steps += 1
        else:
            runner.wait(1.0)
        if not updated and when(steps):
            update()
            updated = True
        finished += runner.take_finished()
    assert updated, "the programs finished before the update"
    return finished
