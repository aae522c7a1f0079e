"""The SGLang adapter for Qwen3, Mistral, Qwen3-MoE and Mixtral, without SGLang (the real-server checks are in
tests/sglang/test_sglang_models.py):

- weight updates stack the runtime layout's per-expert tensors into SGLang's FusedMoE parameters
  (`experts.w13_weight` [E_local, 2 I_tp, H] = [gate; up] rows, `experts.w2_weight` [E_local, H, I_tp]), local expert j
  of expert-parallel rank k being global expert k E_local + j, each expert's rows split by the MoE-TP rank; the
  expected tensors are built here from the HF tensors the way SGLang 0.5.23's FusedMoE.weight_loader loads a
  checkpoint (ranks: `runtime_context` moe_ep_rank = tp_rank // (TP / EP), moe_tp_rank = tp_rank % (TP / EP));
- routed experts (rollout routing replay): requested from the server, decoded from base64 int32 as SGLang encodes them,
  sizes checked, a server that returns none named with its flag;
- server arguments: --ep-size and --enable-return-routed-experts given to launched servers and checked on attached
  ones, expert-moving arguments and sliding windows refused;
- the model directory a server starts from holds the HF config of each new architecture.
"""

import base64
import json

import numpy as np
import pytest
import torch
from helpers import random_hf_weights

from megatron_rl.config.arguments import parse_args
from megatron_rl.config.setup import build_run_setup
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.models import weight_map
from megatron_rl.models.spec import ModelSpec, get_model_spec
from megatron_rl.rollout.sglang.engine import (
    RolloutContractError,
    SGLangEngine,
    parse_generate_response,
    required_server_flags,
    stack_experts,
)
from megatron_rl.rollout.sglang.server import SGLangServer, SGLangServerError, launch_command, write_model_dir
from megatron_rl.rollout.types import SamplingParams

QWEN3_MOE = get_model_spec("tiny-qwen3-moe")  # 4 experts of size 32, top-2, experts under mlp.*
MIXTRAL = get_model_spec("tiny-mixtral")  # 4 experts of size 32, top-2, experts under block_sparse_moe.*


# ---- stacking experts for /update_weights_from_tensor ---------------------------------------------------------------

def _runtime(spec, tp, rank, ep, hf):
    shards = weight_map.sglang_shards(spec, tp, rank, ep)
    return {n: weight_map.assemble(s, weight_map.slicer(hf)) for n, s in shards.items()}


def _sglang_expert_params(spec, tp, rank, ep, hf, layer):
    """(w13, w2) of one layer on SGLang TP rank `rank`, loaded from the HF tensors as FusedMoE.weight_loader does."""
    module, _, gate, up, down = weight_map.ARCHITECTURES[spec.arch]["moe_names"]
    moe_tp = tp // ep
    ep_rank, moe_tp_rank = rank // moe_tp, rank % moe_tp
    local = spec.num_experts // ep
    i_tp = spec.moe_ffn_hidden_size // moe_tp
    rows = slice(moe_tp_rank * i_tp, (moe_tp_rank + 1) * i_tp)
    w13, w2 = [], []
    for j in range(local):
        e = ep_rank * local + j
        name = f"model.layers.{layer}.{module}.experts.{e}.%s.weight"
        w13.append(torch.cat([hf[name % gate][rows], hf[name % up][rows]]))  # w1 at offset 0, w3 at I_tp
        w2.append(hf[name % down][:, rows])
    return f"model.layers.{layer}.{module}.experts", torch.stack(w13), torch.stack(w2)


@pytest.mark.parametrize("spec,tp,ep", [(QWEN3_MOE, 1, 1), (QWEN3_MOE, 2, 1), (QWEN3_MOE, 2, 2), (QWEN3_MOE, 4, 2),
                                        (MIXTRAL, 2, 2), (MIXTRAL, 4, 4)])
def test_experts_are_stacked_as_sglangs_fused_moe_holds_them(spec, tp, ep):
    hf = random_hf_weights(spec, seed=3)
    for rank in range(tp):
        runtime = _runtime(spec, tp, rank, ep, hf)
        stacked = stack_experts(runtime)
        assert not [n for n in stacked if ".experts." in n and not n.split(".experts.")[1].startswith("w")]
        for layer in range(spec.num_layers):
            prefix, w13, w2 = _sglang_expert_params(spec, tp, rank, ep, hf, layer)
            local, i_tp = spec.num_experts // ep, spec.moe_ffn_hidden_size * ep // tp
            assert stacked[f"{prefix}.w13_weight"].shape == (local, 2 * i_tp, spec.hidden_size)
            assert stacked[f"{prefix}.w2_weight"].shape == (local, spec.hidden_size, i_tp)
            assert torch.equal(stacked[f"{prefix}.w13_weight"], w13)
            assert torch.equal(stacked[f"{prefix}.w2_weight"], w2)
        others = {n: t for n, t in runtime.items() if ".experts." not in n}
        assert all(stacked[n] is t for n, t in others.items())  # the router, attention, norms: passed through
        assert len(stacked) == len(others) + 2 * spec.num_layers


def test_a_dense_model_passes_through_and_fp8_scales_stack_beside_their_weights():
    spec = get_model_spec("tiny-qwen3")
    runtime = _runtime(spec, 2, 1, 1, random_hf_weights(spec))
    assert stack_experts(runtime) == runtime
    m = "model.layers.0.mlp.experts"
    scales = {f"{m}.{e}.gate_up_proj.weight_scale_inv": torch.full((1, 1), float(e)) for e in (2, 3)}
    stacked = stack_experts(scales)
    assert list(stacked) == [f"{m}.w13_weight_scale_inv"] and stacked[f"{m}.w13_weight_scale_inv"].flatten().tolist() \
        == [2.0, 3.0]


def test_experts_that_are_not_one_run_of_ids_are_refused():
    m = "model.layers.0.mlp.experts"
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.w2_weight: this rank's experts \[0, 2\] are "
                                         r"not consecutive"):
        stack_experts({f"{m}.{e}.down_proj.weight": torch.zeros(2, 2) for e in (0, 2)})


# ---- routed experts -------------------------------------------------------------------------------------------------

def _routes(positions, layers, topk, seed=0):
    return torch.randint(0, 4, (positions, layers, topk), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int32)


def _sglang_b64(routes: torch.Tensor) -> str:
    """As SGLang's tokenizer manager encodes the captured int32 tensor: base64 of its bytes."""
    return base64.b64encode(np.ascontiguousarray(routes.numpy()).tobytes()).decode("utf-8")


def _response(prompt, output, routes=None, reason="length"):
    meta = {"output_token_logprobs": [[-1.0, t, None] for t in output],
            "weight_versions": [{"version": 1, "start": 0, "end": len(output)}], "finish_reason": {"type": reason}}
    if routes is not None:
        meta["routed_experts"] = routes
    return {"output_ids": list(output), "meta_info": meta}


def test_routed_experts_are_decoded_per_position_of_prompt_and_response():
    prompt, output = [1, 2, 3], [4, 5]
    routes = _routes(len(prompt) + len(output) - 1, 2, 2)
    out = parse_generate_response("r1", prompt, _response(prompt, output, _sglang_b64(routes)), routes=(2, 2))
    assert out.routed_experts.tolist() == routes.tolist() and out.routed_experts.dtype == torch.int16
    assert parse_generate_response("r1", prompt, _response(prompt, output, _sglang_b64(routes))).routed_experts is None


def test_routes_of_the_wrong_size_name_the_request_and_the_shape():
    prompt, output = [1, 2, 3], [4, 5]
    for wrong in (_routes(5, 2, 2), _routes(4, 2, 1)):  # every position, or topk 1
        with pytest.raises(RolloutContractError, match=r"request r7: routed_experts holds \d+ int32 values, expected "
                                                       r"\(len\(prompt\) \+ len\(output\) - 1\) x num_layers x topk = "
                                                       r"4 x 2 x 2 = 16"):
            parse_generate_response("r7", prompt, _response(prompt, output, _sglang_b64(wrong)), routes=(2, 2))


def test_a_server_that_returns_no_routes_is_named_with_its_flag():
    with pytest.raises(RolloutContractError, match="request r2: the SGLang server returned no routed_experts, which "
                                                   "--use-rollout-routing-replay needs; start it with "
                                                   "--enable-return-routed-experts"):
        parse_generate_response("r2", [1, 2], _response([1, 2], [3]), routes=(2, 2))
    # an aborted request may end before SGLang read its routes: no routes, no error
    assert parse_generate_response("r3", [1, 2], _response([1, 2], [3], reason="abort"), routes=(2, 2)) \
        .routed_experts is None


class _FakeServer:
    """Answers /generate like an SGLang server (with routes when `routes`), recording the request bodies."""

    url = "http://fake"
    process = None

    def __init__(self, routes: bool):
        self.routes, self.bodies = routes, []

    def post(self, path, body=None, timeout=None):
        assert path == "/generate"
        self.bodies.append(body)
        prompt, output = body["input_ids"], [7, 8, 9]
        encoded = _sglang_b64(_routes(len(prompt) + len(output) - 1, QWEN3_MOE.num_layers,
                                      QWEN3_MOE.moe_router_topk)) if self.routes else None
        return _response(prompt, output, encoded)

    def alive(self):
        return True


def test_the_engine_asks_every_request_for_its_routes_and_returns_them():
    server = _FakeServer(routes=True)
    engine = SGLangEngine(QWEN3_MOE, server, return_routed_experts=True)
    out, = engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=3), ["a"])
    assert server.bodies[0]["return_routed_experts"] is True
    assert np.asarray(out.routed_experts).shape == (6, QWEN3_MOE.num_layers, QWEN3_MOE.moe_router_topk)
    plain = _FakeServer(routes=True)
    assert SGLangEngine(QWEN3_MOE, plain).generate([[1, 2]], SamplingParams(max_new_tokens=3))[0].routed_experts is None
    assert "return_routed_experts" not in plain.bodies[0]


def test_an_attached_server_without_routes_fails_the_engine_naming_the_flag():
    engine = SGLangEngine(QWEN3_MOE, _FakeServer(routes=False), return_routed_experts=True)
    with pytest.raises(RolloutContractError, match="--enable-return-routed-experts"):
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=3), ["a"])


def test_routing_replay_needs_experts():
    with pytest.raises(ValueError, match="--use-rollout-routing-replay: model 'tiny-qwen3' has no experts"):
        SGLangEngine(get_model_spec("tiny-qwen3"), None, return_routed_experts=True)


# ---- server arguments ------------------------------------------------------------------------------------------------

def _server_info(model_dir, **changes):
    return {"tp_size": 2, "dp_size": 1, "skip_tokenizer_init": True, "model_path": model_dir, "ep_size": 1,
            "moe_dp_size": 1, "ep_num_redundant_experts": 0, "enable_eplb": False, "moe_runner_backend": "auto",
            "enable_return_routed_experts": False, **changes}


def _check(spec, info, required=None):
    server = SGLangServer("http://fake")
    server.get = lambda path, timeout=30.0: info
    return server.check(spec, 2, required)


def test_launched_servers_get_ep_size_and_routes_and_attached_ones_are_checked_for_them(tmp_path):
    required = required_server_flags(QWEN3_MOE, 2, routing_replay=True)
    assert required == {"ep_size": 2, "enable_return_routed_experts": True}
    assert required_server_flags(get_model_spec("tiny-qwen3")) == {}
    argv, _ = launch_command("/m", 2, 30000, environ={}, cuda_available=False, extra_flags=required)
    assert argv[-3:] == ["--ep-size", "2", "--enable-return-routed-experts"]
    model = write_model_dir(QWEN3_MOE, str(tmp_path))
    _check(QWEN3_MOE, _server_info(model, ep_size=2, enable_return_routed_experts=True), required)
    with pytest.raises(SGLangServerError, match=r"ep_size 1 \(this run needs --ep-size 2\); "
                                                r"enable_return_routed_experts False \(this run needs "
                                                r"--enable-return-routed-experts\)"):
        _check(QWEN3_MOE, _server_info(model), required)


def test_servers_that_move_experts_or_serve_other_routing_are_refused(tmp_path):
    model = write_model_dir(QWEN3_MOE, str(tmp_path))
    info = _server_info(model, ep_num_redundant_experts=2, enable_eplb=True, moe_runner_backend="flashinfer_cutlass")
    with pytest.raises(SGLangServerError, match=r"ep_num_redundant_experts 2 \(this run needs 0.*enable_eplb True"
                                                r".*moe_runner_backend flashinfer_cutlass"):
        _check(QWEN3_MOE, info)
    with pytest.raises(SGLangServerError, match=r"model moe_router_topk 2 \(the trainer's is 1\)"):
        _check(QWEN3_MOE.replace(moe_router_topk=1), _server_info(model))


def test_a_sliding_window_is_refused_at_setup_and_at_the_server(tmp_path):
    mistral = get_model_spec("tiny-mistral")
    with pytest.raises(SGLangServerError, match=r"model sliding_window 8 \(SGLang runs mistral with full attention"):
        _check(mistral, _server_info(write_model_dir(mistral, str(tmp_path))))
    args = parse_args(["--model", "tiny-mistral", "--rollout-backend", "sglang"])
    with pytest.raises(ValueError, match="--rollout-backend sglang cannot serve model 'tiny-mistral': model "
                                         "sliding_window 8"):
        build_run_setup(args, 2, tokenizer=build_char_tokenizer())


def test_build_sglang_engine_launches_with_the_runs_ep_size_and_asks_for_routes(tmp_path, monkeypatch):
    import importlib.util

    from megatron_rl.rollout.sglang import build_engine as build_sglang_engine
    from megatron_rl.rollout.sglang import engine as sglang_engine
    from megatron_rl.runtime.roles import Roles

    args = parse_args(["--model", "tiny-qwen3-moe", "--rollout-backend", "sglang", "--rollout-tensor-parallel-size",
                       "2", "--rollout-expert-parallel-size", "2", "--use-rollout-routing-replay", "--output-dir",
                       str(tmp_path)])
    setup = build_run_setup(args, 3, tokenizer=build_char_tokenizer())
    calls = []
    monkeypatch.setattr(sglang_engine, "start_replica_engine", lambda *a, **kw: calls.append((a, kw)))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else
                        find_spec(name, *a))
    build_sglang_engine(setup, Roles(rank=1, world_size=3, trainer_world_size=1, rollout_tp=2, rollout_replicas=1,
                                     sync_group=None))
    (_, kwargs), = calls
    assert kwargs["required_flags"] == {"ep_size": 2, "enable_return_routed_experts": True}
    assert kwargs["return_routed_experts"] is True


def test_ep_size_is_the_runs_to_set():
    args = parse_args(["--model", "tiny-qwen3-moe", "--rollout-backend", "sglang", "--sglang-ep-size", "2"])
    with pytest.raises(ValueError, match=r"--sglang-ep-size \(--rollout-expert-parallel-size sets it"):
        build_run_setup(args, 2, tokenizer=build_char_tokenizer())


# ---- the model directory ---------------------------------------------------------------------------------------------

# What SGLang 0.5.23's model classes read from the config (qwen3.py, llama.py for Mistral, qwen3_moe.py, mixtral.py).
SGLANG_READS = {
    "tiny-qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
    "tiny-mistral": {"architectures": ["MistralForCausalLM"], "head_dim": 16},
    "tiny-qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "head_dim": 32, "num_experts": 4,
                       "moe_intermediate_size": 32, "num_experts_per_tok": 2, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": []},
    "tiny-mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "intermediate_size": 32,
                     "num_experts_per_tok": 2},
}


@pytest.mark.parametrize("name", sorted(SGLANG_READS))
def test_the_model_directory_holds_the_hf_config_sglang_loads(name, tmp_path):
    import transformers

    spec = get_model_spec(name)
    write_model_dir(spec, str(tmp_path), eos_token_id=3)
    with open(tmp_path / "config.json") as f:
        written = json.load(f)
    assert written == {**spec.to_hf_config(), "eos_token_id": 3}
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))  # as SGLang reads it
    for key, value in SGLANG_READS[name].items():
        assert getattr(config, key) == value, key
    assert ModelSpec.from_hf_config(written, name=name) == spec
