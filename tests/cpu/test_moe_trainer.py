"""The trainer with Qwen3, Mistral and mixture-of-experts models: Megatron logits equal `transformers` at TP=1, TP=2
and expert parallelism; HF -> Megatron -> HF round trips at TP/PP/EP layouts are bit-identical; an optimizer step
at EP=2 is the step at EP=1, and the routers' load-balancing loss enters it with Megatron-LM's scale; the policy
exports to HF and reshards through a distributed checkpoint at another EP.

Every Megatron computation runs in ONE launch of 2 gloo ranks (`launched`): a launch costs ~10 s of imports here.

fp32. Tolerances: logits 2e-5 absolute on logits of magnitude ~0.1-1 (seen: ~3e-7; Megatron and transformers order
reductions differently, TP and EP add partial sums; a wrong layout, window or router moves logits by > 1e-2).
Weights after one Adam step (lr 1e-3, adam_eps 1e-4, see tests/cpu/test_trainer.py) 2e-6: EP changes the order in which
the experts' gradients are summed (~1e-7 relative), a wrong scale or routing moves weights by >= 1e-4. The
load-balancing gradient (SGD, lr 1, so the update is the gradient) 1e-6 absolute on gradients of ~1e-2: it is compared
with autograd through the HF model's router logits.
"""

import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks

SPECS = {name: get_model_spec(name) for name in ("tiny-qwen3", "tiny-mistral", "tiny-qwen3-moe", "tiny-mixtral")}
SPECS["tiny-qwen3-moe-nonorm"] = SPECS["tiny-qwen3-moe"].replace(name="tiny-qwen3-moe-nonorm", moe_norm_topk_prob=False)
SEEDS = {name: i for i, name in enumerate(SPECS)}  # of each random HF model
MOE = [n for n, s in SPECS.items() if s.is_moe]
# (model, layout) of each logits check; every layout is on 2 ranks (DP = 2 / TP): each DP rank feeds its own row.
LOGIT_CASES = ([(name, {}) for name in SPECS] + [("tiny-qwen3", {"tensor_parallel_size": 2})]
               + [(name, {"expert_model_parallel_size": 2}) for name in MOE]
               + [("tiny-mixtral", {"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather"}),
                  ("tiny-qwen3-moe", {"expert_tensor_parallel_size": 2})])
IDS = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))  # 20 > Mistral's window of 8
TRAIN = "tiny-qwen3-moe"
AUX_COEFF = 0.1  # the Adam steps' --moe-aux-loss-coeff
SGD_AUX_COEFF = 0.5  # the load-balancing-only SGD step's
SECOND = [0.5, -1.0, 1.0, -0.25]  # the advantages of the step after a checkpoint


def _layout(**kwargs) -> TrainerLayout:
    return TrainerLayout(data_parallel_size=2 // kwargs.get("tensor_parallel_size", 1), dtype_bytes=4, **kwargs)


def _batch(advantages):
    from megatron_rl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(7)
    lengths = [(3, 6), (5, 2), (2, 9), (4, 4)]  # different lengths: micro-batches carry padding
    prompts = [torch.randint(0, 128, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(0, 128, (r,), generator=g).tolist() for _, r in lengths]
    behavior = [(-5.3 + 0.8 * torch.randn(r, generator=g)).tolist() for _, r in lengths]
    return TrainBatch.from_sequences(prompts, responses, behavior, advantages)


# ---- the launch ----------------------------------------------------------------------------------------------------

def _logits(spec, layout, hf_dir):
    from helpers import gather_vocab_parallel
    from megatron.core import parallel_state as ps

    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.model import build_gpt_model
    from megatron_rl.trainer.weights import load_hf_weights

    parallel.initialize(layout, spec)
    try:
        model = build_gpt_model(spec, layout).eval()
        load_hf_weights(model, spec, layout, HFCheckpoint(hf_dir).get_slice)
        row = ps.get_data_parallel_rank()
        ids = IDS[row:row + 1]
        with torch.no_grad():
            logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        return row, gather_vocab_parallel(logits)[..., :spec.vocab_size]
    finally:
        parallel.destroy()


def _params(module):
    from megatron.core import parallel_state as ps

    key = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())
    return key, {n: p.detach().clone() for n, p in module.named_parameters()}


def _train(hf_dir, ep, advantages, coeff, optimizer="adam", lr=1e-3, export=None, dist_dir=None, resume=None):
    """One step of the policy trainer on `_batch(advantages)` at TP=1, DP=2, EP=`ep`; optionally the trained policy
    exported to HF (`save_hf`) and saved as a distributed checkpoint, and the trainer checkpointed in `resume`
    before a second step (on `_batch(SECOND)`). With `resume` and no `hf_dir`: the trainer restored from it takes
    that second step."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
    from megatron_rl.trainer.export import ModelDescription, save_hf
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    spec, layout = SPECS[TRAIN], _layout(expert_model_parallel_size=ep)
    parallel.initialize(layout, spec)
    try:
        init = None if hf_dir is None else lambda m: load_hf_weights(m, spec, layout, HFCheckpoint(hf_dir).get_slice)
        policy = build_policy(spec, layout, lr=lr, optimizer=optimizer, clip_grad=0.0, adam_eps=1e-4,
                              moe_aux_loss_coeff=coeff, init_weights=init)
        algo = AlgorithmConfig(loss="aipo", loss_params={"rho": 2.0}, temperature=0.7)
        trainer = PolicyTrainer(policy, algo, batching=1)
        if hf_dir is None:
            load_trainer_checkpoint(policy, resume)
            metrics = trainer.train_step(_batch(SECOND))
            return {"metrics": metrics, **dict(zip(("key", "params"), _params(policy.module)))}
        metrics = trainer.train_step(_batch(advantages))
        key, params = _params(policy.module)
        if export:
            save_hf(policy.module, ModelDescription(spec, layout, torch.float32, build_char_tokenizer()), export)
        if dist_dir:
            if dist.get_rank() == 0:
                os.makedirs(dist_dir)
            dist.barrier()
            dist_checkpointing.save(policy.module.sharded_state_dict(), dist_dir)
        out = {"key": key, "params": params, "metrics": metrics}
        if resume:
            save_trainer_checkpoint(policy, resume)
            out["second"] = {"metrics": trainer.train_step(_batch(SECOND)), "params": _params(policy.module)[1]}
        return out
    finally:
        parallel.destroy()


def _load_dist(dist_dir, ep):
    """The distributed checkpoint read into a fresh model at EP=`ep` (Megatron-Core reshards the experts)."""
    from megatron_rl.checkpoint.megatron_format import load_dist_model
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.model import build_gpt_model

    spec, layout = SPECS[TRAIN], _layout(expert_model_parallel_size=ep)
    parallel.initialize(layout, spec)
    try:
        model = build_gpt_model(spec, layout)
        load_dist_model(model, dist_dir)
        key, params = _params(model)
        return {"key": key, "params": params}
    finally:
        parallel.destroy()


def _rank(dirs, out_dir):
    out = {"logits": [_logits(SPECS[name], _layout(**kwargs), dirs[name]) for name, kwargs in LOGIT_CASES]}
    hf_dir, advantages = dirs[TRAIN], [1.0, -0.5, 0.25, -1.0]
    out["ep1"] = _train(hf_dir, 1, advantages, AUX_COEFF)
    out["ep2"] = _train(hf_dir, 2, advantages, AUX_COEFF, export=os.path.join(out_dir, "export"),
                        dist_dir=os.path.join(out_dir, "dist"), resume=os.path.join(out_dir, "trainer"))
    out["resumed"] = _train(None, 2, None, AUX_COEFF, resume=os.path.join(out_dir, "trainer"))
    out["no_aux"] = _train(hf_dir, 2, advantages, 0.0)
    out["dist_ep1"] = _load_dist(os.path.join(out_dir, "dist"), 1)
    # Zero advantages: the policy loss has no gradient, the routers' load-balancing loss is all there is.
    out["aux_only"] = _train(hf_dir, 2, [0.0] * 4, SGD_AUX_COEFF, optimizer="sgd", lr=1.0)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_rl.models.hf import save_random_hf_model

    base = tmp_path_factory.mktemp("moe_models")
    return {name: (str(base / name), save_random_hf_model(spec, base / name, seed=SEEDS[name]))
            for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def launched(models, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("moe_out")
    results = run_on_ranks(_rank, 2, {name: d for name, (d, _) in models.items()}, str(out_dir), timeout_s=600)
    return {"ranks": results, "out": out_dir}


def _merge(results, ep):
    from megatron_rl.trainer.weights import merge_to_hf

    return merge_to_hf(SPECS[TRAIN], _layout(expert_model_parallel_size=ep), {r["key"]: r["params"] for r in results})


# ---- logits ----------------------------------------------------------------------------------------------------------

def test_megatron_logits_equal_transformers(models, launched):
    with torch.no_grad():
        expected = {name: model(IDS).logits for name, (_, model) in models.items()}
    for i, (name, kwargs) in enumerate(LOGIT_CASES):
        rows = set()
        for rank in launched["ranks"]:
            row, logits = rank["logits"][i]
            rows.add(row)
            torch.testing.assert_close(logits, expected[name][row:row + 1], atol=2e-5, rtol=0,
                                       msg=f"{name} {kwargs} row {row}")
        assert rows == ({0} if kwargs.get("tensor_parallel_size") else {0, 1})  # EP ranks saw different tokens


def test_the_window_and_the_router_variants_are_what_is_checked(models):
    """The logits test would notice a lost sliding window or a router that ignores norm_topk_prob."""
    from megatron_rl.models.hf import random_hf_model

    with torch.no_grad():
        windowed = models["tiny-mistral"][1](IDS).logits
        unwindowed = random_hf_model(SPECS["tiny-mistral"].replace(sliding_window=None), seed=SEEDS["tiny-mistral"])
        full = unwindowed(IDS).logits
        torch.testing.assert_close(windowed[:, :8], full[:, :8], atol=1e-6, rtol=0)  # the same weights
        assert (windowed - full).abs().max() > 1e-2
        normed = random_hf_model(SPECS["tiny-qwen3-moe-nonorm"].replace(moe_norm_topk_prob=True),
                                 seed=SEEDS["tiny-qwen3-moe-nonorm"])(IDS).logits
        assert (models["tiny-qwen3-moe-nonorm"][1](IDS).logits - normed).abs().max() > 1e-2


# ---- training --------------------------------------------------------------------------------------------------------

def test_a_step_at_ep2_equals_the_step_at_ep1(launched):
    ranks = launched["ranks"]
    ep1, ep2 = _merge([r["ep1"] for r in ranks], 1), _merge([r["ep2"] for r in ranks], 2)
    for name in ep1:
        torch.testing.assert_close(ep2[name], ep1[name], atol=2e-6, rtol=0, msg=name)
    for r in ranks:  # every rank reports the step's metrics, the same under both layouts
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert r["ep2"]["metrics"][key] == pytest.approx(ranks[0]["ep1"]["metrics"][key], rel=1e-5), key
    # The load-balancing loss is part of the step: without it the routers move differently.
    no_aux = _merge([r["no_aux"] for r in ranks], 2)
    assert "moe_aux_loss" not in ranks[0]["no_aux"]["metrics"]
    router = "model.layers.0.mlp.gate.weight"
    assert (no_aux[router] - ep2[router]).abs().max() > 1e-5


def _hf_load_balancing(model, batch):
    """Megatron-Core's "aux_loss" of each micro-batch (one row of `batch`), from the HF model's router logits over
    the row's real tokens (padding is left out): E * sum_i f_i P_i per layer, f_i the fraction of the row's
    token-choices routed to expert i, P_i the mean router probability of expert i. Returns [rows, layers]
    (differentiable)."""
    spec = SPECS[TRAIN]
    out = []
    for row, length in zip(batch.tokens, batch.seq_lengths.tolist()):
        per_layer = []
        for logits in model(row[None, :length], output_router_logits=True).router_logits:
            scores = torch.softmax(logits.float(), dim=-1)  # [T, E]
            chosen = torch.zeros_like(scores).scatter(1, scores.topk(spec.moe_router_topk, dim=1).indices, 1.0)
            tokens_per_expert, n = chosen.sum(0), scores.shape[0]
            per_layer.append(spec.num_experts * (tokens_per_expert / (n * spec.moe_router_topk)
                                                 * scores.sum(0) / n).sum())
        out.append(torch.stack(per_layer))
    return torch.stack(out)


def test_the_load_balancing_loss_has_megatron_lms_scale(models, launched):
    """Its value (train/moe_aux_loss: the mean over micro-batches and layers) and its gradient (coeff x that mean,
    summed over layers) are those of the formula on the HF model's routers: whatever the micro-batches and DP ranks."""
    model = models[TRAIN][1]
    ranks = launched["ranks"]
    model.zero_grad()
    aux = _hf_load_balancing(model, _batch([0.0] * 4))
    assert ranks[0]["ep2"]["metrics"]["moe_aux_loss"] == pytest.approx(aux.mean().item(), rel=1e-5)
    (SGD_AUX_COEFF * aux.sum(1).mean()).backward()
    before = load_file(os.path.join(models[TRAIN][0], "model.safetensors"))
    after = _merge([r["aux_only"] for r in ranks], 2)
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad  # the final norm and lm_head: no gradient
             for n, p in model.named_parameters() if n in after}  # non-expert tensors: HF's own names
    assert "model.layers.0.mlp.gate.weight" in grads and len(grads) > 10
    for name, grad in grads.items():
        torch.testing.assert_close(before[name] - after[name], grad, atol=1e-6, rtol=0, msg=name)
    assert max(g.abs().max().item() for g in grads.values()) > 1e-3


# ---- weights out -----------------------------------------------------------------------------------------------------

def test_save_hf_at_ep2_gathers_every_expert(launched):
    trained = _merge([r["ep2"] for r in launched["ranks"]], 2)
    exported = load_file(launched["out"] / "export" / "model.safetensors")
    assert exported.keys() == trained.keys()
    for name in trained:
        assert torch.equal(exported[name], trained[name]), name


def test_a_trainer_checkpoint_at_ep2_resumes_at_ep2(launched):
    for r in launched["ranks"]:
        second, resumed = r["ep2"]["second"], r["resumed"]
        assert resumed["params"].keys() == second["params"].keys()
        for name in second["params"]:
            assert torch.equal(resumed["params"][name], second["params"][name]), name
        assert resumed["metrics"]["loss"] == second["metrics"]["loss"]
        assert resumed["metrics"]["moe_aux_loss"] == second["metrics"]["moe_aux_loss"]


def test_a_resume_at_another_ep_is_refused_at_start(tmp_path):
    """Megatron-Core keeps the experts' optimizer state apart when EP > 1: it does not load into another EP."""
    import json

    from megatron_rl.checkpoint import megatron_format, rl_checkpoint
    from megatron_rl.checkpoint.checksums import write_checksums

    spec = SPECS[TRAIN]
    step = tmp_path / "iter_0000001"
    step.mkdir()
    (tmp_path / rl_checkpoint.TRACKER_FILE).write_text("1")
    (step / "metadata.json").write_text("{}")
    (step / rl_checkpoint.RL_STATE_FILE).write_text(json.dumps({
        "format": rl_checkpoint.RL_STATE_FORMAT, "step": 1, "buffer": {}, "inflight": {},
        "model": spec.weight_fields(), "transformer_impl": "local"}))
    megatron_format.write_meta(str(step), megatron_format.RL_FORMAT, spec.to_hf_config(), torch.float32,
                          _layout(expert_model_parallel_size=2), [])
    write_checksums(str(step), "test")
    assert rl_checkpoint.check_checkpoint(str(tmp_path), spec, "local", expert_model_parallel_size=2) == 1
    with pytest.raises(ValueError, match=r"saved with --expert-model-parallel-size 2, this run uses 1"):
        rl_checkpoint.check_checkpoint(str(tmp_path), spec, "local", expert_model_parallel_size=1)


def test_a_distributed_checkpoint_at_ep2_loads_at_ep1(launched):
    ranks = launched["ranks"]
    saved, loaded = _merge([r["ep2"] for r in ranks], 2), _merge([r["dist_ep1"] for r in ranks], 1)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[n], loaded[n]) for n in saved)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen3"])
def test_hf_megatron_hf_round_trips_are_bit_identical(models, tmp_path, name):
    from megatron_rl.checkpoint import hf_conversion, megatron_format

    hf_dir = models[name][0]
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    layouts = [dict(tensor_parallel_size=2, pipeline_parallel_size=2)]
    if SPECS[name].is_moe:  # EP=2 with TP=2 (expert-TP 2: every expert on two DP ranks); EP=4 x expert-TP 1
        layouts += [dict(tensor_parallel_size=2, pipeline_parallel_size=2, expert_model_parallel_size=2),
                    dict(tensor_parallel_size=2, pipeline_parallel_size=2, expert_model_parallel_size=4,
                         expert_tensor_parallel_size=1),
                    dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2)]
    for kwargs in layouts:
        layout = TrainerLayout(**kwargs)
        meg, back = tmp_path / "meg", tmp_path / "back"
        hf_conversion.hf_to_megatron(hf_dir, str(meg), layout, overwrite=True, progress=False)
        span = layout.expert_replica_span
        expected = sorted(megatron_format.rank_file(t, p, d if span > 1 else None)
                          for p in range(layout.pipeline_parallel_size) for t in range(layout.tensor_parallel_size)
                          for d in range(span))
        assert sorted(f for f in os.listdir(meg) if f.startswith("mp_rank")) == expected, kwargs
        assert megatron_format.MegatronCheckpoint(str(meg)).layout == megatron_format.weights_layout(layout)
        hf_conversion.megatron_to_hf(str(meg), str(back), overwrite=True, progress=False)
        restored = load_file(back / "model.safetensors")
        assert restored.keys() == original.keys(), kwargs
        for tensor in original:
            assert torch.equal(restored[tensor], original[tensor]), (kwargs, tensor)


# ---- refusals --------------------------------------------------------------------------------------------------------

def _setup(world, *flags):
    from megatron_rl.config.arguments import parse_args
    from megatron_rl.config.setup import build_run_setup
    from megatron_rl.data.tokenizer import build_char_tokenizer

    return build_run_setup(parse_args(list(flags)), world, tokenizer=build_char_tokenizer())


@pytest.mark.parametrize("world,flags,pattern", [
    (3, ["--model", "tiny-qwen3-moe", "--tensor-model-parallel-size", "2"],
     r"a mixture of experts with --tensor-model-parallel-size 2 trains only with --sequence-parallel .* "
     r"--expert-model-parallel-size and --expert-tensor-parallel-size"),
    (2, ["--model", "tiny-qwen3", "--moe-aux-loss-coeff", "0.01"],
     r"--moe-aux-loss-coeff 0.01: model 'tiny-qwen3' has no experts"),
    (3, ["--model", "tiny-mixtral", "--expert-model-parallel-size", "3"],
     r"--expert-model-parallel-size 3 does not divide model 'tiny-mixtral' num_experts 4"),
])
def test_expert_layouts_that_cannot_train_are_refused_at_setup(world, flags, pattern):
    with pytest.raises(ValueError, match=pattern):
        _setup(world, *flags)


def test_expert_flags_reach_the_layout_and_the_config():
    from megatron_rl.models.megatron_config import transformer_config

    setup = _setup(3, "--model", "tiny-mixtral", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                   "allgather", "--moe-aux-loss-coeff", "0.01")
    assert setup.trainer.expert_model_parallel_size == 2 and setup.trainer.moe_token_dispatcher_type == "allgather"
    config = transformer_config(setup.spec, setup.trainer, moe_aux_loss_coeff=setup.args.moe_aux_loss_coeff)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 32)
    assert (config.expert_model_parallel_size, config.moe_token_dispatcher_type) == (2, "allgather")
    assert config.moe_aux_loss_coeff == 0.01 and not config.moe_router_pre_softmax
    qwen3 = transformer_config(SPECS["tiny-qwen3-moe-nonorm"], TrainerLayout())
    assert qwen3.moe_router_pre_softmax and qwen3.qk_layernorm and qwen3.kv_channels == 32
    assert transformer_config(SPECS["tiny-mistral"], TrainerLayout()).window_size == (7, 0)
