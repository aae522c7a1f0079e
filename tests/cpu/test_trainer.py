"""The Megatron-Core policy trainer: vocab-parallel log-probs, an AIPO step that is the same under every
parallel layout, learning direction, and checkpoints that resume under another layout.

fp32 throughout. Tolerances: log-probs 1e-5 (TP changes the order of the softmax sums). Updated weights
2e-6 after Adam steps of lr 1e-3 with adam_eps 1e-4: Adam's update is lr * g / (sqrt(v) + eps), which for
the default eps 1e-8 is ~lr * sign(g) and turns float-reordering noise on near-zero gradients into
differences of up to 2% of lr; with eps 1e-4 it is smooth in g, so layout-induced gradient differences
(~1e-7 relative) move weights by < 1e-9, while a wrong normalization or sharding moves them by >= 1e-4."""

import math

import pytest
import torch

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks
from megatron_rl.trainer import parallel

SPEC = get_model_spec("tiny-llama").replace(name="tiny-llama-v200", vocab_size=200)  # vocab padding at TP=2
TEMPERATURE = 0.7


def _batch(positive_only=False):
    from megatron_rl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(7)
    lengths = [(3, 6), (5, 2), (2, 9), (4, 4)]  # (prompt, response): different total lengths
    prompts = [torch.randint(0, SPEC.vocab_size, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(0, SPEC.vocab_size, (r,), generator=g).tolist() for _, r in lengths]
    behavior = [(-5.3 + 0.8 * torch.randn(r, generator=g)).tolist() for _, r in lengths]
    adv = [1.0, 0.5, 2.0, 1.5] if positive_only else [1.0, -0.5, 0.25, -1.0]
    masks = [[True] * r for _, r in lengths]
    masks[2][3:5] = [False, False]  # observation tokens inside a response
    return TrainBatch.from_sequences(prompts, responses, behavior, adv, masks)


def _setup(tp, pp, lr=1e-3, seed_weights=0, overlap_grad_reduce=False):
    import torch.distributed as dist
    from helpers import random_hf_weights

    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    layout = TrainerLayout(tp, pp, dist.get_world_size() // (tp * pp), dtype_bytes=4)
    parallel.initialize(layout, SPEC)
    policy = build_policy(SPEC, layout, lr=lr, clip_grad=1.0, adam_eps=1e-4, overlap_grad_reduce=overlap_grad_reduce,
                          init_weights=lambda m: load_hf_weights(m, SPEC, layout,
                                                                 random_hf_weights(SPEC, seed=seed_weights)))
    algo = AlgorithmConfig(loss="aipo", loss_params={"rho": 2.0}, temperature=TEMPERATURE)
    return PolicyTrainer(policy, algo, batching=1)


def _params(trainer):
    from megatron.core import parallel_state as ps

    return {"tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "params": {n: p.detach().clone() for n, p in trainer.policy.module.named_parameters()}}


def _merge(results, tp, pp):
    from megatron_rl.trainer.weights import merge_to_hf

    return merge_to_hf(SPEC, TrainerLayout(tp, pp), {(r["tp_rank"], r["pp_rank"]): r["params"]
                                                       for r in results if r["dp_rank"] == 0})


# ---- log-probs ---------------------------------------------------------------------------------------------------

def _logprob_rank(tp):
    from helpers import gather_vocab_parallel
    from megatron.core import parallel_state as ps

    from megatron_rl.trainer.logprobs import next_token_logprobs_and_entropy, token_logprobs_and_entropy

    trainer = _setup(tp, 1)
    batch = _batch()
    model = trainer.policy.module
    logits = model(batch.tokens, torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens), None)
    local = logits.detach().requires_grad_()
    lp, ent = token_logprobs_and_entropy(local[:, :-1], batch.tokens[:, 1:], SPEC.vocab_size, TEMPERATURE)
    (lp.sum() + 0.3 * ent.sum()).backward()
    # read 3 positions at a time: chunks that end inside rows, a last one shorter than the others
    chunked = logits.detach().requires_grad_()
    lp3, ent3 = token_logprobs_and_entropy(chunked[:, :-1], batch.tokens[:, 1:], SPEC.vocab_size, TEMPERATURE,
                                           chunk_tokens=3)
    (lp3.sum() + 0.3 * ent3.sum()).backward()
    # the trainer's form: the whole logits, the gradient written into their own storage
    leaf = logits.detach().requires_grad_()
    inplace, grad_ptrs = leaf * 1.0, []  # a model output, as in training (a leaf's gradient is copied into .grad)
    inplace.register_hook(lambda g: grad_ptrs.append(g.data_ptr()))
    lpi, enti = next_token_logprobs_and_entropy(inplace, batch.tokens, SPEC.vocab_size, TEMPERATURE)
    (lpi.sum() + 0.3 * enti.sum()).backward()
    reused = grad_ptrs == [inplace.data_ptr()]
    # the entropy carries no gradient when nothing differentiates it
    alone = logits.detach().requires_grad_()
    lp_only, _ = token_logprobs_and_entropy(alone[:, :-1], batch.tokens[:, 1:], SPEC.vocab_size, TEMPERATURE)
    lp_only.sum().backward()
    # Reference in the same process: plain log_softmax over the gathered, unpadded vocabulary.
    full = gather_vocab_parallel(logits.detach())[..., : SPEC.vocab_size].requires_grad_()
    ref_all = torch.log_softmax(full[:, :-1] / TEMPERATURE, -1)
    ref_lp = ref_all.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    full_only = gather_vocab_parallel(logits.detach())[..., : SPEC.vocab_size].requires_grad_()
    torch.log_softmax(full_only[:, :-1] / TEMPERATURE, -1).gather(-1, batch.tokens[:, 1:, None]).sum().backward()
    grad = gather_vocab_parallel(local.grad)
    out = {"lp": lp.detach(), "ent": ent.detach(), "ref_lp": ref_lp.detach(), "ref_ent": ref_ent.detach(),
           "grad": grad[..., : SPEC.vocab_size], "ref_grad": full.grad, "pad_grad": grad[..., SPEC.vocab_size:],
           "lp3": lp3.detach(), "ent3": ent3.detach(),
           "grad3": gather_vocab_parallel(chunked.grad)[..., : SPEC.vocab_size],
           "grad_lp_only": gather_vocab_parallel(alone.grad)[..., : SPEC.vocab_size],
           "ref_grad_lp_only": full_only.grad,
           "lpi": lpi.detach(), "enti": enti.detach(), "reused": reused,
           "gradi": gather_vocab_parallel(leaf.grad)[..., : SPEC.vocab_size],
           "rank": ps.get_tensor_model_parallel_rank()}
    parallel.destroy()
    return out


def test_vocab_parallel_logprobs_equal_full_log_softmax():
    tp1 = run_on_ranks(_logprob_rank, 1, 1)[0]
    for r in run_on_ranks(_logprob_rank, 2, 2):
        for key in ("lp", "ent", "grad", "grad_lp_only"):
            torch.testing.assert_close(r[key], r["ref_" + key], atol=1e-5, rtol=0, msg=key)
        for key in ("lp", "ent", "grad"):  # chunking changes no summation within a position: equal to the last bit
            assert torch.equal(r[key + "3"], r[key]), key
            assert torch.equal(r[key + "i"], r[key]), key  # so does writing the gradient in place
        assert r["reused"]  # ... into the logits' own storage
        torch.testing.assert_close(r["lp"], tp1["ref_lp"], atol=1e-5, rtol=0)
        assert (r["pad_grad"] == 0).all()  # padded vocabulary entries get no gradient


# ---- one AIPO step under every layout ------------------------------------------------------------------------------

def _step_rank(tp, pp, overlap_grad_reduce=False):
    trainer = _setup(tp, pp, overlap_grad_reduce=overlap_grad_reduce)
    metrics = trainer.train_step(_batch())
    out = _params(trainer)
    out["metrics"] = metrics
    parallel.destroy()
    return out


@pytest.fixture(scope="module")
def tp1_step():
    results = run_on_ranks(_step_rank, 1, 1, 1)
    return _merge(results, 1, 1), results[0]["metrics"]


@pytest.mark.parametrize("tp,pp,dp,overlap", [(2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False), (2, 1, 2, False),
                                               (1, 1, 2, True)],
                         ids=["tp2", "pp2", "dp2", "tp2-dp2", "dp2-overlap-grad-reduce"])
def test_aipo_step_is_identical_across_layouts(tp1_step, tp, pp, dp, overlap):
    ref_weights, ref_metrics = tp1_step
    results = run_on_ranks(_step_rank, tp * pp * dp, tp, pp, overlap)
    weights = _merge(results, tp, pp)
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], atol=2e-6, rtol=0, msg=name)
    for r in results:  # every rank reports the same metrics
        for key in ("loss", "grad_norm", "kl_behavior_current", "clip_high_fraction", "tokens"):
            assert r["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key


def test_step_metrics_are_reported(tp1_step):
    _, m = tp1_step
    from helpers import random_hf_weights

    assert m["tokens"] == 19  # 6 + 2 + 9 + 4 response tokens, 2 of them masked observations
    assert m["trained_tokens"] == 19 and m["grad_norm"] > 0 and m["lr"] == pytest.approx(1e-3)
    assert 0 < m["clip_high_fraction"] < 1 and m["tokens_per_s"] > 0
    moved = max((tp1_step[0][n] - w).abs().max().item() for n, w in random_hf_weights(SPEC).items())
    assert moved > 1e-4


# ---- learning direction ------------------------------------------------------------------------------------------

def _learn_rank():
    trainer = _setup(2, 1, lr=3e-3)
    batch = _batch(positive_only=True)
    before = trainer.compute_logprobs(batch)
    for _ in range(5):
        trainer.train_step(batch)
    after = trainer.compute_logprobs(batch)
    parallel.destroy()
    return before, after, batch.loss_mask


def test_positive_advantages_raise_logprobs():
    before, after, mask = run_on_ranks(_learn_rank, 2)[0]
    gain = (after - before)[mask]
    assert gain.mean() > 0.5
    per_seq = [(after - before)[i][mask[i]].mean() for i in range(mask.shape[0])]
    assert all(g > 0 for g in per_seq)


def _nonfinite_rank():
    import dataclasses

    trainer = _setup(1, 1)  # 2 ranks: DP=2, the NaN sample lands on one of them
    good = _batch()
    bad = dataclasses.replace(good, advantages=good.advantages.clone())
    bad.advantages[3] = 3e38  # finite, but its gradient overflows to Inf (NaN after the DP all-reduce)
    before = _params(trainer)["params"]
    skipped = trainer.train_step(bad)
    after_skip = _params(trainer)["params"]
    applied = trainer.train_step(good)
    after_good = _params(trainer)["params"]
    parallel.destroy()
    unchanged = all(torch.equal(before[n], after_skip[n]) for n in before)
    moved = any(not torch.equal(before[n], after_good[n]) for n in before)
    return skipped["update_successful"], unchanged, applied["update_successful"], moved, trainer.step


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_everywhere():
    for skipped, unchanged, applied, moved, steps in run_on_ranks(_nonfinite_rank, 2):
        assert skipped is False and unchanged  # bit-identical weights after the skipped step
        assert applied is True and moved and steps == 1


# ---- checkpoints across layouts ------------------------------------------------------------------------------------

def _save_rank(tp, pp, directory):
    from megatron_rl.trainer.checkpoint import save_trainer_checkpoint
    from megatron_rl.trainer.train_step import build_scheduler

    trainer = _setup(tp, pp)
    scheduler = build_scheduler(trainer.policy, decay_steps=10, decay_style="cosine")
    trainer.scheduler = scheduler
    trainer.train_step(_batch())
    save_trainer_checkpoint(trainer.policy, directory, scheduler, extra={"step": trainer.step})
    metrics = trainer.train_step(_batch())
    out = _params(trainer)
    out["metrics"] = metrics
    parallel.destroy()
    return out


def _load_rank(tp, pp, directory):
    from megatron_rl.trainer.checkpoint import load_trainer_checkpoint
    from megatron_rl.trainer.train_step import build_scheduler

    trainer = _setup(tp, pp, seed_weights=99)  # different weights: the load must replace them
    scheduler = build_scheduler(trainer.policy, decay_steps=10, decay_style="cosine")
    trainer.scheduler = scheduler
    extra = load_trainer_checkpoint(trainer.policy, directory, scheduler)
    metrics = trainer.train_step(_batch())
    out = _params(trainer)
    out.update(metrics=metrics, extra=extra)
    parallel.destroy()
    return out


@pytest.mark.parametrize("save_layout,load_layout", [((2, 1), (1, 1)), ((1, 2), (1, 1))],
                         ids=["tp2-to-tp1", "pp2-to-pp1"])
def test_checkpoint_resumes_under_another_layout(tmp_path, save_layout, load_layout):
    directory = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save_rank, save_layout[0] * save_layout[1], *save_layout, directory)
    loaded = run_on_ranks(_load_rank, load_layout[0] * load_layout[1], *load_layout, directory)
    assert loaded[0]["extra"] == {"step": 1}
    # The step after the checkpoint is the same: weights, Adam moments and the LR schedule were restored.
    a, b = _merge(saved, *save_layout), _merge(loaded, *load_layout)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-6, rtol=0, msg=name)
    assert loaded[0]["metrics"]["lr"] == pytest.approx(saved[0]["metrics"]["lr"])
    assert loaded[0]["metrics"]["loss"] == pytest.approx(saved[0]["metrics"]["loss"], rel=1e-5)


def _refuse_rank(directory):
    from megatron_rl.trainer.checkpoint import save_trainer_checkpoint
    from megatron_rl.trainer.policy import build_policy

    layout = TrainerLayout(1, 1, dtype_bytes=4)
    parallel.initialize(layout, SPEC)
    policy = build_policy(SPEC, layout, use_distributed_optimizer=True)
    try:
        save_trainer_checkpoint(policy, directory)
    except ValueError as e:
        return str(e)
    finally:
        parallel.destroy()


def test_distributed_optimizer_checkpoint_is_refused_without_te_or_apex(tmp_path):
    message = run_on_ranks(_refuse_rank, 1, str(tmp_path / "ckpt"))[0]
    assert message and "--use-distributed-optimizer checkpoints need Transformer Engine or Apex" in message
    assert not (tmp_path / "ckpt").exists()


# ---- the loss menu: one step each, with its statistics -------------------------------------------------------------

MENU = {"aipo": {"rho": 2.0}, "aipo-clamp": {"rho": 2.0}, "reinforce": {}, "ppo": {"dual_clip_c": 1.5},
        "tis": {"tis_clip": 1.5}, "icepop": {"is_mask_low": 0.5, "is_mask_high": 2.0},
        "gspo": {"clip_eps": 0.05, "clip_eps_high": 0.1},
        "cispo": {"cispo_eps_low": 0.5, "cispo_eps_high": 1.0}, "decoupled-ppo": {"behav_imp_weight_cap": 2.0}}


def _menu_rank():
    from megatron_rl.algorithms import AlgorithmConfig

    trainer, batch, out = _setup(1, 1, lr=1e-5), _batch(), {}  # a small lr: every loss sees about the same ratios
    for name, params in MENU.items():
        trainer.algo = AlgorithmConfig(loss=name, loss_params=params, temperature=TEMPERATURE)
        before = trainer.compute_logprobs(batch)  # the policy the step starts from
        out[name] = (before, trainer.train_step(batch))
    parallel.destroy()
    return out


@pytest.fixture(scope="module")
def menu_steps():
    return run_on_ranks(_menu_rank, 1)[0]


def _expected_fractions(name, logprobs):
    """What each loss's statistics must be, from the log-probs the step started from: fractions of valid tokens."""
    batch = _batch()
    mask = batch.loss_mask
    ratio = torch.exp(logprobs - batch.behavior_logprobs)
    adv = batch.advantages[:, None].expand_as(ratio)
    seq = torch.exp(torch.where(mask, logprobs - batch.behavior_logprobs, 0.0).sum(-1) / mask.sum(-1))[:, None]
    none = torch.zeros_like(mask)
    marks = {
        "aipo": {"clip_high": ratio > 2.0}, "aipo-clamp": {"clip_high": ratio > 2.0}, "reinforce": {},
        "ppo": {"clip_high": (adv > 0) & (ratio > 1.2), "clip_low": (adv < 0) & (ratio < 0.8),
                "dual_clip": (adv < 0) & (ratio > 1.5)},
        "tis": {"clip_high": none, "clip_low": none, "tis_clip": ratio > 1.5},  # pi / pi_prox = 1
        "icepop": {"masked": (ratio < 0.5) | (ratio > 2.0)},
        "gspo": {"clip_high": (adv > 0) & (seq > 1.1), "clip_low": (adv < 0) & (seq < 0.95)},
        "cispo": {"clip_high": ratio > 2.0, "clip_low": ratio < 0.5},
        "decoupled-ppo": {"clip_high": none, "clip_low": none, "masked": ratio > 2.0},
    }[name]
    return {f"{key}_fraction": (flag & mask).sum().item() / mask.sum().item() for key, flag in marks.items()}


@pytest.mark.parametrize("name", list(MENU))
def test_each_loss_trains_one_step_and_reports_its_fractions(menu_steps, name):
    before, metrics = menu_steps[name]
    assert metrics["update_successful"] and metrics["grad_norm"] > 0 and math.isfinite(metrics["loss"])
    expected = _expected_fractions(name, before)
    assert {k for k in metrics if k.endswith("_fraction") and k != "ess_fraction"} == set(expected)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key
    assert metrics["ratio_p5"] <= metrics["ratio_p50"] <= metrics["ratio_p95"]


def test_the_menu_batch_exercises_the_statistics(menu_steps):
    reported = [v for _, m in menu_steps.values() for k, v in m.items() if k.endswith("_fraction")
                and k != "ess_fraction"]
    assert sum(0 < v < 1 for v in reported) >= 10, reported
