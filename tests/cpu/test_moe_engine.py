"""The built-in engine on Qwen3 (head size and q/k norms), Mistral (sliding window), Qwen3-MoE and Mixtral
(experts, expert parallelism), against `transformers`; the experts it records for routing replay; DDMA of expert
weights between Megatron's EP x ETP layout and SGLang's --ep-size layout.

References: transformers' greedy tokens, its log-probs (fp32, atol 1e-5 as in tests/cpu/test_engine.py) and its
router logits (output_router_logits=True), top-k of their softmax. HF weights are read the way the engine reads
them (LocalEngine.from_hf on a saved checkpoint: the hub's per-expert names). Multi-rank parts run in two
launches: the engine at TP=2 (2 ranks) and every DDMA case (4 ranks)."""

import pytest
import torch
from helpers import mismatched_generator_tensors, random_hf_weights

from megatron_rl.ddma.plan import make_plan, summarize
from megatron_rl.models import weight_map
from megatron_rl.models.fp8 import is_fp8_weight
from megatron_rl.models.hf import save_random_hf_model
from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
from megatron_rl.models.safetensors_io import HFCheckpoint
from megatron_rl.models.spec import get_model_spec
from megatron_rl.rollout import LocalEngine, SamplingParams
from megatron_rl.rollout.local.decoder import TPDecoder
from megatron_rl.runtime.spawn import run_on_ranks

QWEN3 = get_model_spec("tiny-qwen3")
MISTRAL = get_model_spec("tiny-mistral")  # sliding_window 8
QWEN3_MOE = get_model_spec("tiny-qwen3-moe")  # moe_norm_topk_prob True
QWEN3_MOE_RAW = QWEN3_MOE.replace(name="tiny-qwen3-moe-raw", moe_norm_topk_prob=False)
MIXTRAL = get_model_spec("tiny-mixtral")
SPECS = {s.name: s for s in (QWEN3, MISTRAL, QWEN3_MOE, QWEN3_MOE_RAW, MIXTRAL)}
MOE = [QWEN3_MOE.name, QWEN3_MOE_RAW.name, MIXTRAL.name]
# Lengths 4, 2, 10 (longer than Mistral's window on its own), 1, 6: with 12 new tokens every sequence outgrows it.
PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [42], [7, 7, 7, 7, 7, 8]]
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint directory, the transformers model saved there)."""
    out = {}
    for name, spec in SPECS.items():
        directory = tmp_path_factory.mktemp(name)
        out[name] = (directory, _no_eos(save_random_hf_model(spec, directory, seed=0)))
    return out


def _no_eos(model):
    """The engine runs with ignore_eos: EOS is a token like any other. transformers' min_new_tokens would forbid
    it instead (Mistral's EOS, 2, is the greedy choice somewhere here), so the reference forgets its EOS."""
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _hf_greedy(model, prompt, n=NEW):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def _hf_routes(router_logits, k):
    """transformers' router logits (one [tokens, experts] per layer) -> top-k experts [tokens, layers, k]."""
    probs = torch.stack([r.float() for r in router_logits], 1).softmax(-1)
    return probs.topk(k, dim=-1).indices.tolist()


def _hf_reference(model, spec, prompt, tokens):
    """transformers' log-probs of `tokens` after `prompt` and (MoE) the experts of every position the engine
    computes: all of prompt + tokens but the last token."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + tokens]), output_router_logits=spec.is_moe)
    logits = out.logits[0, len(prompt) - 1:-1]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    routes = _hf_routes(out.router_logits, spec.moe_router_topk)[:-1] if spec.is_moe else None
    return logprobs, routes


def _routes(out):
    """The output's recorded routes as nested lists (None for a dense model)."""
    return None if out.routed_experts is None else out.routed_experts.tolist()


def _check_outputs(model, spec, outs):
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == _hf_greedy(model, prompt), spec.name
        logprobs, routes = _hf_reference(model, spec, prompt, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, atol=1e-5, rtol=0)
        assert _routes(out) == routes, spec.name
        assert out.routed_experts is None or out.routed_experts.dtype == torch.int16
        if spec.is_moe:
            assert len(out.routed_experts) == len(prompt) + NEW - 1
            assert {len(layer) for pos in out.routed_experts for layer in pos} == {spec.moe_router_topk}


# ---- the engine against transformers ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_tokens_logprobs_and_routes_match_transformers_at_tp1(models, name):
    """3 slots (one reserved for scoring): requests of different lengths join and leave the decode batch."""
    directory, model = models[name]
    outs = LocalEngine.from_hf(str(directory), max_slots=3).generate(PROMPTS, GREEDY)
    _check_outputs(model, SPECS[name], outs)


def test_normalizing_the_top_k_weights_matters(models):
    """The two Qwen3-MoE variants share their weights (same seed): only moe_norm_topk_prob differs."""
    tokens = PROMPTS[2] + PROMPTS[0]
    logits = [LocalEngine.from_hf(str(models[n][0])).logits(tokens) for n in (QWEN3_MOE.name, QWEN3_MOE_RAW.name)]
    assert not torch.allclose(*logits, atol=1e-3)


def test_mistral_window_changes_the_tokens(models):
    """The same weights without the window generate otherwise: the window is exercised by these prompts."""
    directory, model = models[MISTRAL.name]
    windowed = LocalEngine.from_hf(str(directory))
    unwindowed = LocalEngine(TPDecoder(MISTRAL.replace(sliding_window=None)))
    unwindowed.decoder.install(dict(windowed.decoder.params))
    assert [o.token_ids for o in unwindowed.generate(PROMPTS, GREEDY)] != \
        [o.token_ids for o in windowed.generate(PROMPTS, GREEDY)]


def _generate_tp2(jobs):
    engines = [(name, ep, LocalEngine.from_hf(str(directory), tp_size=2, ep_size=ep, max_slots=3))
               for name, directory, ep in jobs]
    return [(name, ep, engine.generate(PROMPTS, GREEDY)) for name, ep, engine in engines]


@pytest.fixture(scope="module")
def tp2_outputs(models):
    jobs = [(name, models[name][0], ep) for name in SPECS for ep in ((1, 2) if SPECS[name].is_moe else (1,))]
    ranks = run_on_ranks(_generate_tp2, 2, jobs)
    for (_, _, outs0), (_, _, outs1) in zip(*ranks):  # SPMD: both ranks sample and route the same
        assert [(o.token_ids, _routes(o)) for o in outs0] == [(o.token_ids, _routes(o)) for o in outs1]
    return {(name, ep): outs for name, ep, outs in ranks[0]}


@pytest.mark.parametrize("name,ep", [(n, ep) for n in SPECS for ep in ((1, 2) if SPECS[n].is_moe else (1,))])
def test_greedy_tokens_logprobs_and_routes_match_transformers_at_tp2(models, tp2_outputs, name, ep):
    """TP=2: EP=1 splits every expert over both ranks, EP=2 gives each rank two whole experts."""
    _check_outputs(models[name][1], SPECS[name], tp2_outputs[(name, ep)])


def _expert(runtime_name):
    """The global expert number of an expert's runtime tensor (`...experts.E.gate_up_proj.weight`), else None."""
    return int(runtime_name.split(".experts.")[1].split(".")[0]) if ".experts." in runtime_name else None


def test_expert_parallel_ranks_hold_only_their_experts():
    def experts(ep, rank):
        return {_expert(n) for n in TPDecoder(QWEN3_MOE, 2, rank, ep_size=ep).expected()} - {None}

    assert experts(1, 0) == experts(1, 1) == {0, 1, 2, 3}
    assert experts(2, 0) == {0, 1} and experts(2, 1) == {2, 3}
    gate_up = "model.layers.0.mlp.experts.0.gate_up_proj.weight"
    assert TPDecoder(QWEN3_MOE, 2, 0, ep_size=1).expected()[gate_up][0] == (32, 64)  # half of 2 x 32 rows
    assert TPDecoder(QWEN3_MOE, 2, 0, ep_size=2).expected()[gate_up][0] == (64, 64)  # whole
    with pytest.raises(ValueError, match="--rollout-expert-parallel-size 2 must divide --rollout-tensor-parallel"):
        TPDecoder(QWEN3_MOE, 1, 0, ep_size=2)
    with pytest.raises(ValueError, match="--rollout-expert-parallel-size 2: model 'tiny-qwen3' has no experts"):
        TPDecoder(QWEN3, 2, 0, ep_size=2)


def test_dense_models_record_no_routes(models):
    out = LocalEngine.from_hf(str(models[QWEN3.name][0])).generate(PROMPTS[:1], GREEDY)[0]
    assert out.routed_experts is None


# ---- routes across weight updates -------------------------------------------------------------------------------

def _runtime_shards(directory, spec):
    ckpt = HFCheckpoint(str(directory))
    shards = weight_map.sglang_shards(spec, 1, 0)
    return [(name, weight_map.assemble(lay, ckpt.get_slice)) for name, lay in shards.items()]


def _hf_continue_on_old_cache(old, new, spec, prompt, tokens, n):
    """Greedy continuation by `new` on the KV cache `old` computed for prompt + tokens[:-1] (an in-place update),
    with the experts `new` routes each position it computes to (tokens[-1] and all but the last new token)."""
    with torch.no_grad():
        cache = old(torch.tensor([prompt + tokens[:-1]]), use_cache=True).cache
        nxt, out, routes = tokens[-1], [], []
        for _ in range(n):
            step = new(torch.tensor([[nxt]]), cache=cache, use_cache=True, output_router_logits=True)
            cache, nxt = step.cache, int(step.logits[0, -1].argmax())
            routes += _hf_routes(step.router_logits, spec.moe_router_topk)
            out.append(nxt)
    return out, routes


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_routes_follow_the_weights_that_computed_each_position(models, tmp_path, mode):
    """Five tokens under the old weights, then a weight update. retract: the request is prefilled again, so
    every position's route is the new weights' (prompt and kept tokens included). in_place: the positions the
    old weights computed keep their routes; the later ones are the new weights' on the old KV cache."""
    spec = QWEN3_MOE
    directory, old = models[spec.name]
    new = _no_eos(save_random_hf_model(spec, tmp_path, seed=7))
    engine = LocalEngine.from_hf(str(directory), max_slots=8)
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
    finished = []
    for _ in range(5):
        finished += engine.step()
    engine.pause(mode)
    engine.begin_weight_update()
    engine.load_weights(_runtime_shards(tmp_path, spec))
    engine.end_weight_update(version=1)
    engine.continue_generation()
    while engine.has_work():
        finished += engine.step()
    assert len(finished) == len(PROMPTS)
    for out in finished:
        prompt, before = out.prompt_token_ids, out.token_ids[:5]
        assert out.versions == [0] * 5 + [1] * (NEW - 5)
        assert len(out.routed_experts) == len(prompt) + NEW - 1
        if mode == "retract":
            assert out.token_ids[5:] == _hf_greedy(new, prompt + before, NEW - 5)
            assert _routes(out) == _hf_reference(new, spec, prompt, out.token_ids)[1]
            assert _routes(out) != _hf_reference(old, spec, prompt, out.token_ids)[1]  # the weights matter
        else:
            after, routes = _hf_continue_on_old_cache(old, new, spec, prompt, before, NEW - 5)
            assert out.token_ids[5:] == after
            old_routes = _hf_reference(old, spec, prompt, before)[1]  # positions 0 .. len(prompt) + 3
            assert _routes(out) == old_routes + routes


def test_fp8_experts_are_served_in_block_fp8(models):
    directory, _ = models[QWEN3_MOE.name]
    full, fp8 = LocalEngine.from_hf(str(directory)), LocalEngine.from_hf(str(directory), fp8=True)
    assert fp8.decoder.params["model.layers.1.mlp.experts.3.gate_up_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8.decoder.params["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].shape == (1, 1)
    assert fp8.decoder.params["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays dense
    tokens = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    p, q = torch.log_softmax(full.logits(tokens), -1), torch.log_softmax(fp8.logits(tokens), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert kl.max() < 1e-2, f"max KL {kl.max():.2e}"


# ---- DDMA of experts ---------------------------------------------------------------------------------------------

# (model, trainer (TP, DP, EP), generator (TP, EP), fp8)
DDMA_CASES = [
    (QWEN3_MOE, (1, 2, 2), (1, 1), False),
    (MIXTRAL, (2, 1, 1), (2, 1), False),
    (QWEN3_MOE, (1, 2, 2), (2, 2), False),
    (MIXTRAL, (1, 2, 2), (2, 2), True),
    (MIXTRAL, (2, 1, 1), (2, 2), False),
    (QWEN3_MOE, (1, 2, 2), (2, 1), False),
]


def _layouts(case):
    spec, (tp, dp, ep), (gtp, gep), fp8 = case
    trainer = TrainerLayout(tp, 1, dp, dtype_bytes=4, expert_model_parallel_size=ep)
    return spec, trainer, GeneratorLayout(gtp, 1, fp8=fp8, first_rank=trainer.world_size, expert_parallel_size=gep)


def _ddma_cases(cases):
    import torch.distributed as dist

    from megatron_rl.ddma.sync import publish
    from megatron_rl.ddma.transport import TorchDistTransport
    from megatron_rl.rollout.local.engine import LocalEngine

    rank = dist.get_rank()
    report = []
    for i, case in enumerate(cases):
        spec, trainer, generator = _layouts(case)
        plan = make_plan(spec, trainer, generator)
        hf = random_hf_weights(spec, seed=i)
        transport = TorchDistTransport()
        result = {}
        if rank < trainer.world_size:
            tp, dp = rank % trainer.tensor_parallel_size, rank // trainer.tensor_parallel_size
            shards = weight_map.megatron_shards(spec, trainer, tp, 0, dp)
            publish(plan, rank, version=i + 1, transport=transport, bucket_bytes=4096, debug_checksums=True,
                    trainer_tensors={n: weight_map.assemble(s, weight_map.slicer(hf)) for n, s in shards.items()})
        elif rank < trainer.world_size + generator.world_size:
            j, gtp, gep = rank - generator.first_rank, generator.tensor_parallel_size, generator.expert_parallel_size
            engine = LocalEngine(TPDecoder(spec, gtp, j, None, fp8=generator.fp8, ep_size=gep))
            publish(plan, rank, version=i + 1, engine=engine, transport=transport, bucket_bytes=4096,
                    debug_checksums=True)
            mismatched = mismatched_generator_tensors(engine, spec, hf, gtp, j, gep)
            fp8_tensors = sum(t.dtype == torch.float8_e4m3fn for t in engine.decoder.params.values())
            result.update(mismatched=mismatched, version=engine.weight_version, fp8_tensors=fp8_tensors)
        result.update(sent=transport.bytes_sent, received=transport.bytes_received, planned_sent=plan.bytes_sent(rank),
                      planned_received=plan.bytes_received(rank))
        report.append(result)
        dist.barrier()
    return report


@pytest.fixture(scope="module")
def ddma_reports():
    return run_on_ranks(_ddma_cases, 4, DDMA_CASES, timeout_s=300)


def _ddma_id(case):
    spec, (tp, dp, ep), (gtp, gep), fp8 = case
    return f"{spec.name}-trainer-tp{tp}dp{dp}ep{ep}-gen-tp{gtp}ep{gep}{'-fp8' if fp8 else ''}"


@pytest.mark.parametrize("case", range(len(DDMA_CASES)), ids=[_ddma_id(c) for c in DDMA_CASES])
def test_ddma_leaves_expert_weights_bit_equal(ddma_reports, case):
    spec, trainer, generator = _layouts(DDMA_CASES[case])
    rows = [r[case] for r in ddma_reports]
    generators = rows[generator.first_rank:generator.first_rank + generator.world_size]
    for j, r in enumerate(generators):
        assert r["mismatched"] == [] and r["version"] == case + 1
        if generator.fp8:
            names = weight_map.sglang_shards(spec, generator.tensor_parallel_size, j, generator.expert_parallel_size)
            assert r["fp8_tensors"] == sum(is_fp8_weight(n) for n in names) > 2 * spec.num_layers  # experts too
    for r in rows:  # exactly the planned bytes, plus one 8-byte checksum per bucket
        assert (r["sent"] - r["planned_sent"]) % 8 == 0 and r["sent"] >= r["planned_sent"]
        assert (r["received"] - r["planned_received"]) % 8 == 0 and r["received"] >= r["planned_received"]


# ---- plan byte counts ---------------------------------------------------------------------------------------------

def _expert_bytes(plan, rank):
    return sum(p.nbytes for p in plan.recvs(rank) if ".experts." in p.dst_tensor)


@pytest.mark.parametrize("case", range(len(DDMA_CASES)), ids=[_ddma_id(c) for c in DDMA_CASES])
def test_each_generator_rank_receives_exactly_its_own_shard(case):
    spec, trainer, generator = _layouts(DDMA_CASES[case])
    plan = make_plan(spec, trainer, generator)
    assert not plan.quantized_tensors  # FP8 too: these tiny shards are not 128-aligned, the receiver quantizes
    ranks = range(generator.first_rank, generator.first_rank + generator.world_size)
    for r in ranks:  # the tiny models' vocabulary (128) needs no padding: the shard is all sent
        assert plan.bytes_received(r) == plan.shard_bytes(r)
    assert summarize(plan)["max_recv_bytes"] == max(plan.shard_bytes(r) for r in ranks)


def test_generator_expert_parallelism_receives_only_its_experts():
    spec, trainer = QWEN3_MOE, TrainerLayout(1, 1, 2, dtype_bytes=4, expert_model_parallel_size=2)
    all_experts = 4 * sum(v[0] * v[1] for n, v in weight_map.hf_shapes(spec).items() if ".experts." in n)
    plans = {ep: make_plan(spec, trainer, GeneratorLayout(2, 1, first_rank=2, expert_parallel_size=ep))
             for ep in (1, 2)}
    for ep, plan in plans.items():
        for j, rank in enumerate((2, 3)):
            assert _expert_bytes(plan, rank) == all_experts // 2  # half the expert bytes either way ...
            got = {_expert(p.dst_tensor) for p in plan.recvs(rank)} - {None}
            # ... EP=1: a half of every expert; EP=2: rank j's two experts whole
            assert got == ({0, 1, 2, 3} if ep == 1 else {2 * j, 2 * j + 1})
        # each expert comes from the trainer EP rank that holds it (trainer rank = DP rank: experts 0-1 on 0, 2-3 on 1)
        assert all(p.src == _expert(p.dst_tensor) // 2 for p in plan.pieces if _expert(p.dst_tensor) is not None)
    one = make_plan(spec, trainer, GeneratorLayout(1, 1, first_rank=2))
    assert _expert_bytes(one, 2) == all_experts
    assert plans[1].bytes_received(2) == plans[2].bytes_received(2) < one.bytes_received(2)
