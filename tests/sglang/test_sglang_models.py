"""Qwen3 (q/k norms, head size 32 with hidden 64 / 4 heads), Qwen3-MoE and Mixtral on a real SGLang server: the server
starts on checkpoint A, the adapter's weight update (the path DDMA feeds: runtime shards by SGLang name, experts
stacked into FusedMoE's w13_weight / w2_weight, `load_format="direct"`) gives it checkpoint B, and it then generates
exactly what transformers does with B: the same greedy tokens, log-probs within 1e-4. A wrong expert order, gate/up
order or q/k-norm mapping changes every log-prob of a random model far more than that. Also at TP=2 for experts split
across ranks, and the server arguments the run requires (--ep-size, --enable-return-routed-experts) are SGLang's.

Routing replay's routes are not checked here: SGLang 0.5.23 cannot start with --enable-return-routed-experts on the
CPU (its RoutedExpertsCapturer pins its host buffer with cudaHostRegister: "Torch not compiled with CUDA enabled");
their decoding is unit-tested in tests/cpu/test_sglang_moe.py.
"""

import pytest
import torch

from megatron_rl.models import weight_map
from megatron_rl.models.hf import save_random_hf_model
from megatron_rl.models.safetensors_io import HFCheckpoint
from megatron_rl.models.spec import get_model_spec
from megatron_rl.rollout.sglang.engine import required_server_flags, start_replica_engine
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.runtime.spawn import run_on_ranks

PROMPTS = [[1, 5, 9, 13], [2, 40, 41, 42, 43, 44, 45], [3, 100]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
ATOL = 1e-4


def test_the_server_arguments_the_run_requires_are_sglangs():
    from megatron_rl.rollout.sglang.engine import IN_PLACE_SERVER_FLAGS
    from megatron_rl.rollout.sglang.flags import check_typed, sglang_cli_actions

    flags = required_server_flags(get_model_spec("tiny-qwen3-moe"), 2, in_place=True, routing_replay=True)
    assert flags == {**IN_PLACE_SERVER_FLAGS, "ep_size": 2, "enable_return_routed_experts": True}
    actions = sglang_cli_actions()
    assert check_typed({k: v for k, v in flags.items() if k != "ep_size"}, actions) == \
        {k: v for k, v in flags.items() if k != "ep_size"}
    assert actions["--ep-size"].dest == "ep_size" and actions["--ep-size"].type is int


def _hf_greedy(model, prompt, steps):
    """transformers' greedy continuation of `prompt` and each token's log-prob (full forward per step)."""
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            tokens.append(token)
    return tokens[len(prompt):], logprobs


def _serve_b_after_a(spec, tp, ep, model_a, model_b, log, buckets=1):
    """On every rank of one generator replica (TP `tp`, SGLang --ep-size `ep`): start on checkpoint A, update to B
    (each rank loads its own TP rank's runtime shards, in `buckets` parts: DDMA's `commit_bucket` after each but
    the last), generate greedily; the leader returns the outputs."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    group = dist.group.WORLD if tp > 1 else None
    engine = start_replica_engine(spec, tp, group, rank == 0, model_a, log, load_format="auto",
                                  required_flags=required_server_flags(spec, ep))
    try:
        reader = HFCheckpoint(model_b)
        engine.pause("retract")
        engine.begin_weight_update()
        shards = list(weight_map.sglang_shards(spec, tp, rank, ep).items())
        cut = [len(shards) * i // buckets for i in range(buckets + 1)]
        for i in range(buckets):
            engine.load_weights((n, weight_map.assemble(s, reader.get_slice)) for n, s in shards[cut[i]:cut[i + 1]])
            if i < buckets - 1:
                engine.commit_bucket()
        engine.end_weight_update(version=1)
        engine.continue_generation()
        return engine.generate(PROMPTS, GREEDY) if rank == 0 else None
    finally:
        engine.shutdown()


def _check_against_transformers(reference, outputs):
    for prompt, out in zip(PROMPTS, outputs):
        tokens, logprobs = _hf_greedy(reference, prompt, GREEDY.max_new_tokens)
        assert out.token_ids == tokens and out.versions == [1] * len(tokens)
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=ATOL, rtol=0)


def _checkpoints(spec, tmp_path):
    model_a, model_b = str(tmp_path / "a"), str(tmp_path / "b")
    save_random_hf_model(spec, model_a, seed=1)
    return model_a, model_b, save_random_hf_model(spec, model_b, seed=2)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral"])
def test_a_weight_update_serves_the_new_checkpoint_as_transformers_does(name, tmp_path):
    spec = get_model_spec(name).replace(name=f"{name}-sglang", max_position_embeddings=2048)
    model_a, model_b, reference = _checkpoints(spec, tmp_path)
    _check_against_transformers(reference, _serve_b_after_a(spec, 1, 1, model_a, model_b, str(tmp_path / "log")))


def test_an_update_in_buckets_serves_the_new_checkpoint_with_experts_split_across_buckets(tmp_path):
    """Three buckets of the runtime tensors in their order, so that one layer's experts arrive in two buckets: each
    bucket goes to SGLang as it is committed, a layer's experts once all arrived (SGLang takes them stacked)."""
    spec = get_model_spec("tiny-qwen3-moe").replace(name="tiny-qwen3-moe-sglang", max_position_embeddings=2048)
    names = list(weight_map.sglang_shards(spec, 1, 0, 1))
    third = names[len(names) // 3]
    assert ".experts." in third and ".experts." in names[len(names) // 3 - 1]  # the cut falls inside a layer's experts
    model_a, model_b, reference = _checkpoints(spec, tmp_path)
    _check_against_transformers(reference, _serve_b_after_a(spec, 1, 1, model_a, model_b, str(tmp_path / "log"),
                                                            buckets=3))


def test_expert_tensor_parallel_ranks_get_their_rows_of_every_expert(tmp_path):
    """TP=2 (--ep-size 1): each SGLang rank holds every expert, rows [r I / 2, (r + 1) I / 2) of its gate, up (w13) and
    down (w2), and the adapter sends it exactly those. (--ep-size 2 does not run on SGLang's CPU path: its native
    MoE forward, fused_moe_native.moe_forward_native, scatters the -1 ids of experts held by the other rank:
    "index -1 is out of bounds for dimension 1 with size 4".) Experts of size 64: on the CPU SGLang pads
    intermediate sizes to a multiple of TP x 32 (configs/update_config.py, adjust_config_with_unaligned_cpu_tp), which
    the size 32 of tiny-qwen3-moe is not at TP=2."""
    spec = get_model_spec("tiny-qwen3-moe").replace(name="tiny-qwen3-moe-sglang", max_position_embeddings=2048,
                                                    moe_ffn_hidden_size=64)
    model_a, model_b, reference = _checkpoints(spec, tmp_path)
    outputs = run_on_ranks(_serve_b_after_a, 2, spec, 2, 1, model_a, model_b, str(tmp_path / "log"),
                           timeout_s=900)[0]
    _check_against_transformers(reference, outputs)
