"""The off-policy loss menu against hand computations, fp64, tolerance 1e-12.

Every loss is checked the same way: a [4, 4] batch with a known loss mask (masked tokens hold -inf log-probs),
advantages of both signs, ratios pi/mu (R) and pi/pi_prox (Q) chosen inside and outside every clip and mask
region; the gradient d loss / d logprobs from autograd is compared with the per-token coefficient written out in
plain Python from the loss's formula, and each statistic with the tokens the formula says it marks."""

import math

import pytest
import torch

from megatron_rl.algorithms import (
    LOSSES,
    AlgorithmConfig,
    LossInputs,
    aipo_clamp_loss,
    aipo_loss,
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    icepop_loss,
    ppo_clip_loss,
    reinforce_loss,
    tis_loss,
)

F64 = torch.float64
R = [[0.3, 0.9, 1.5, 6.0], [4.5, 1.1, 0.6, 2.5], [1.25, 0.7, 3.0, 1.0], [0.4, 0.85, 1.2, 0.2]]  # pi / mu
Q = [[1.1, 1.5, 1.0, 0.7], [3.5, 0.75, 0.9, 1.0], [1.0, 1.4, 0.95, 0.4], [2.0, 1.2, 0.6, 1.0]]  # pi / pi_prox
A = [1.0, -2.0, 0.5, -1.0]
MASK = [[1, 1, 0, 1], [1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1]]
LP = [[-1.2, -0.7, -2.0, -0.3], [-0.9, -1.5, -0.4, -2.2], [-0.5, -1.0, -1.7, -0.8], [-2.5, -0.6, -1.1, -0.9]]
N = sum(map(sum, MASK))  # valid tokens: the token-mean divisor


def _inputs():
    mask = torch.tensor(MASK, dtype=torch.bool)
    lp = torch.where(mask, torch.tensor(LP, dtype=F64), float("-inf")).requires_grad_()
    blp = torch.where(mask, lp.detach() - torch.tensor(R, dtype=F64).log(), 7.0)  # junk where masked
    prox = torch.where(mask, lp.detach() - torch.tensor(Q, dtype=F64).log(), -3.0)
    return lp, blp, prox, torch.tensor(A, dtype=F64), mask


def _seq_ratio(i):
    """GSPO's s_i: the geometric mean of pi/mu over row i's valid tokens."""
    logs = [math.log(R[i][t]) for t in range(4) if MASK[i][t]]
    return math.exp(sum(logs) / len(logs))


def _ppo(ratio, a, low, high, c=None):
    """d/d log pi of PPO's max(-a r, -a clip(r, low, high)) (and min(., -c a) for a < 0), and what it clipped."""
    flags = {"clip_high": a > 0 and ratio > high, "clip_low": a < 0 and ratio < low}
    if c is not None:
        flags["dual_clip"] = a < 0 and ratio > c
    return (0.0 if any(flags.values()) else -a * ratio), flags


def _with_weight(ppo, weight, extra):
    coef, flags = ppo
    return coef * weight, {**flags, **extra}


# name -> (call, hand) where hand(r, q, a, s) = (coefficient of the token's gradient x N, {statistic: marked}).
CASES = {
    "aipo": (lambda lp, blp, prox, a, m: aipo_loss(lp, blp, a, m, rho=2.0),
             lambda r, q, a, s: (-min(r, 2.0) * a, {"clip_high": r > 2.0})),
    "aipo-clamp": (lambda lp, blp, prox, a, m: aipo_clamp_loss(lp, blp, a, m, rho=2.0),
                   lambda r, q, a, s: (-r * a if r < 2.0 else 0.0, {"clip_high": r > 2.0})),
    "reinforce": (lambda lp, blp, prox, a, m: reinforce_loss(lp, blp, a, m),
                  lambda r, q, a, s: (-a, {})),
    "ppo": (lambda lp, blp, prox, a, m: ppo_clip_loss(lp, blp, a, m, clip_eps=0.2, clip_eps_high=0.28),
            lambda r, q, a, s: _ppo(r, a, 0.8, 1.28)),
    "ppo-dual-clip": (lambda lp, blp, prox, a, m: ppo_clip_loss(lp, blp, a, m, 0.2, 0.28, dual_clip_c=3.0),
                      lambda r, q, a, s: _ppo(r, a, 0.8, 1.28, 3.0)),
    "tis": (lambda lp, blp, prox, a, m: tis_loss(lp, blp, a, m, prox, tis_clip=2.0, clip_eps=0.2,
                                                 clip_eps_high=0.28, dual_clip_c=3.0),
            lambda r, q, a, s: _with_weight(_ppo(q, a, 0.8, 1.28, 3.0), min(r / q, 2.0),
                                            {"tis_clip": r / q > 2.0})),
    "icepop": (lambda lp, blp, prox, a, m: icepop_loss(lp, blp, a, m, low=0.5, high=5.0),
               lambda r, q, a, s: (-a * r if 0.5 <= r <= 5.0 else 0.0, {"masked": not 0.5 <= r <= 5.0})),
    "gspo": (lambda lp, blp, prox, a, m: gspo_loss(lp, blp, a, m, clip_eps=0.1, clip_eps_high=0.2,
                                                   aggregation="token-mean"),
             lambda r, q, a, s: _ppo(s, a, 0.9, 1.2)),
    "cispo": (lambda lp, blp, prox, a, m: cispo_loss(lp, blp, a, m, eps_high=3.0),
              lambda r, q, a, s: (-a * min(r, 4.0), {"clip_high": r > 4.0})),
    "cispo-two-sided": (lambda lp, blp, prox, a, m: cispo_loss(lp, blp, a, m, eps_low=0.5, eps_high=1.0),
                        lambda r, q, a, s: (-a * min(max(r, 0.5), 2.0), {"clip_high": r > 2.0, "clip_low": r < 0.5})),
    "decoupled-ppo": (lambda lp, blp, prox, a, m: decoupled_ppo_loss(lp, blp, a, m, prox, behav_imp_weight_cap=3.0,
                                                                     clip_eps=0.2, clip_eps_high=0.28,
                                                                     dual_clip_c=3.0),
                      lambda r, q, a, s: _with_weight(_ppo(q, a, 0.8, 1.28, 3.0), r / q if r / q <= 3.0 else 0.0,
                                                      {"masked": r / q > 3.0})),
    "decoupled-ppo-uncapped": (lambda lp, blp, prox, a, m: decoupled_ppo_loss(lp, blp, a, m, prox, clip_eps=0.2,
                                                                              clip_eps_high=0.28),
                               lambda r, q, a, s: _with_weight(_ppo(q, a, 0.8, 1.28), r / q, {})),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_and_statistics_by_hand(name):
    call, hand = CASES[name]
    lp, blp, prox, adv, mask = _inputs()
    loss, indicators = call(lp, blp, prox, adv, mask)
    loss.backward()
    expected = torch.zeros(4, 4, dtype=F64)
    marked = {}
    for i in range(4):
        for t in range(4):
            coef, flags = hand(R[i][t], Q[i][t], A[i], _seq_ratio(i))
            expected[i, t] = coef / N if MASK[i][t] else 0.0
            for key, flag in flags.items():
                marked.setdefault(key, torch.zeros(4, 4, dtype=torch.bool))[i, t] = flag and bool(MASK[i][t])
    torch.testing.assert_close(lp.grad, expected, atol=1e-12, rtol=0)
    assert sorted(indicators) == sorted(marked)
    for key, flags in marked.items():
        assert torch.equal(indicators[key], flags), key
        assert 0 < int(flags.sum()) < N, f"{key}: the batch must hold tokens on both sides of the bound"


def _random_batch(seed, B=6, T=7, spread=1.5):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g, dtype=F64) * 3).requires_grad_()
    blp = lp.detach() + torch.randn(B, T, generator=g, dtype=F64) * spread
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    return lp, blp, adv, mask


def _grad(loss_fn, lp, *args, **kwargs):
    lp.grad = None
    loss, indicators = loss_fn(lp, *args, **kwargs)
    loss.backward()
    return lp.grad.clone(), indicators


def test_gspo_under_seq_mean_token_mean_is_the_sequence_objective():
    lp, blp, adv, mask = _random_batch(4, spread=0.4)
    eps, eps_high = 0.05, 0.08
    grad, indicators = _grad(gspo_loss, lp, blp, adv, mask, eps, eps_high, aggregation="seq-mean-token-mean")
    # GSPO as the paper writes it: s_i = (pi(y_i) / mu(y_i))^(1 / |y_i|), differentiated through pi, and
    # J = mean_i min(s_i A_i, clip(s_i, 1 - eps, 1 + eps_high) A_i).
    lp.grad = None
    log_ratio = torch.where(mask, lp - blp, torch.zeros((), dtype=F64))
    s = torch.exp(log_ratio.sum(-1) / mask.sum(-1))
    objective = torch.minimum(s * adv, s.clamp(1 - eps, 1 + eps_high) * adv).mean()
    (-objective).backward()
    torch.testing.assert_close(grad, lp.grad, atol=1e-12, rtol=0)
    clipped = (indicators["clip_high"] | indicators["clip_low"]).any(-1)
    assert 0 < int(clipped.sum()) < clipped.numel(), "some sequences clipped, some not"
    assert indicators["clip_high"].any() and indicators["clip_low"].any()
    assert all(bool(row[m].all()) or not bool(row[m].any()) for row, m in zip(indicators["clip_high"], mask))


def test_dual_clip_changes_only_negative_advantage_tokens_above_c():
    lp, blp, adv, mask = _random_batch(7, spread=2.0)
    plain, _ = _grad(ppo_clip_loss, lp, blp, adv, mask, 0.2)
    dual, indicators = _grad(ppo_clip_loss, lp, blp, adv, mask, 0.2, dual_clip_c=3.0)
    ratio = torch.exp(lp.detach() - blp)
    expected = mask & (adv[:, None] < 0) & (ratio > 3.0)
    assert expected.any() and (mask & (adv[:, None] > 0) & (ratio > 3.0)).any()
    assert torch.equal(dual != plain, expected)
    assert (dual[expected] == 0).all()
    assert torch.equal(indicators["dual_clip"], expected)


def test_tis_with_proximal_equal_to_current_is_aipo_with_rho_the_tis_clip():
    lp, blp, adv, mask = _random_batch(2)
    aipo, aipo_flags = _grad(aipo_loss, lp, blp, adv, mask, rho=2.0)
    for proximal in (None, lp.detach()):
        tis, tis_flags = _grad(tis_loss, lp, blp, adv, mask, proximal, tis_clip=2.0)
        torch.testing.assert_close(tis, aipo, atol=1e-12, rtol=0)
        assert torch.equal(tis_flags["tis_clip"], aipo_flags["clip_high"]) and aipo_flags["clip_high"].any()
        assert not (tis_flags["clip_high"] | tis_flags["clip_low"]).any()  # pi / pi_prox = 1: no trust region


def test_decoupled_ppo_with_proximal_equal_to_current_is_icepop_without_lower_bound():
    lp, blp, adv, mask = _random_batch(5)
    icepop, icepop_flags = _grad(icepop_loss, lp, blp, adv, mask, low=0.0, high=2.0)
    decoupled, flags = _grad(decoupled_ppo_loss, lp, blp, adv, mask, behav_imp_weight_cap=2.0)
    torch.testing.assert_close(decoupled, icepop, atol=1e-12, rtol=0)
    assert torch.equal(flags["masked"], icepop_flags["masked"]) and flags["masked"].any()


def test_cispo_without_lower_clip_is_aipo_with_rho_one_plus_eps_high():
    lp, blp, adv, mask = _random_batch(3)
    aipo, _ = _grad(aipo_loss, lp, blp, adv, mask, rho=2.5)
    cispo, _ = _grad(cispo_loss, lp, blp, adv, mask, eps_high=1.5)
    torch.testing.assert_close(cispo, aipo, atol=1e-12, rtol=0)


# ---- every registered loss ---------------------------------------------------------------------------------------

CONFIGS = {"aipo": {}, "aipo-clamp": {}, "reinforce": {}, "ppo": {"dual_clip_c": 3.0}, "tis": {},
           "icepop": {}, "gspo": {}, "cispo": {"cispo_eps_low": 0.5}, "decoupled-ppo": {"behav_imp_weight_cap": 3.0}}


def test_every_policy_loss_is_covered():
    assert sorted(CONFIGS) == sorted(name for name, loss in LOSSES.items() if loss.policy_gradient)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_registered_losses_add_up_across_microbatches_and_ignore_masked_tokens(name):
    config = AlgorithmConfig(loss=name, loss_params=CONFIGS[name]).params
    lp, blp, adv, mask = _random_batch(9, B=4)
    lp = torch.where(mask, lp.detach(), float("-inf")).requires_grad_()
    blp = torch.where(mask, blp, float("nan"))
    for mode, norm in (("token-mean", float(mask.sum())), ("seq-mean-token-mean", 4.0)):
        full, flags = LOSSES[name].compute(LossInputs(lp, blp, adv, mask, {"aggregation": mode}), config)
        parts = [LOSSES[name].compute(LossInputs(lp[i:i + 2], blp[i:i + 2], adv[i:i + 2], mask[i:i + 2],
                                                 {"aggregation": mode, "normalizer": norm}), config) for i in (0, 2)]
        torch.testing.assert_close(sum(p[0] for p in parts), full, atol=1e-12, rtol=0)
        lp.grad = None
        full.backward()
        assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()
        for key, flag in flags.items():
            assert flag.dtype == torch.bool and not flag[~mask].any(), key
            assert torch.equal(torch.cat([p[1][key] for p in parts]), flag), key


# ---- flags -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (["--loss", "ppo", "--ppo-dual-clip-c", "1.0"], "--ppo-dual-clip-c must be > 1"),
    (["--loss", "aipo", "--ppo-dual-clip-c", "3"], "--ppo-dual-clip-c applies to --loss decoupled-ppo, ppo, tis"),
    (["--loss", "icepop", "--is-mask-low", "1.2"], "0 <= --is-mask-low < 1 < --is-mask-high"),
    (["--loss", "icepop", "--is-mask-high", "0.9"], "0 <= --is-mask-low < 1 < --is-mask-high"),
    (["--loss", "tis", "--tis-clip", "0"], "--tis-clip must be > 0, got 0.0"),
    (["--loss", "gspo", "--ppo-clip-eps", "1.5"], "--ppo-clip-eps must be in (0, 1), got 1.5"),
    (["--loss", "ppo", "--ppo-clip-eps-high", "-0.1"], "--ppo-clip-eps-high must be > 0"),
    (["--loss", "cispo", "--cispo-eps-low", "2"], "--cispo-eps-low must be in [0, 1]"),
    (["--loss", "cispo", "--cispo-eps-high", "0"], "--cispo-eps-high must be > 0"),
    (["--loss", "decoupled-ppo", "--behav-imp-weight-cap", "0.5"], "--behav-imp-weight-cap must be > 1"),
    (["--loss", "tis", "--behav-imp-weight-cap", "5"], "--behav-imp-weight-cap applies to --loss decoupled-ppo"),
    (["--loss", "ppo", "--cispo-eps-low", "0.4"], "--cispo-eps-low applies to --loss cispo, not ppo"),
    (["--loss", "cispo", "--ppo-clip-eps-high", "0.3"],
     "--ppo-clip-eps-high applies to --loss decoupled-ppo, gspo, ppo, tis"),
    (["--aipo-rho", "0"], "--aipo-rho must be a positive finite number"),
])
def test_bad_loss_flags_are_refused_naming_the_flag(flags, message, capsys):
    from megatron_rl.config.arguments import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", "tiny-llama", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_loss_flags_reach_the_algorithm_config():
    """Each loss's hyperparameters come from their flags, and only the chosen loss's."""
    from megatron_rl.config.arguments import parse_args

    config = AlgorithmConfig.from_args(parse_args([
        "--model", "tiny-llama", "--loss", "decoupled-ppo", "--ppo-clip-eps", "0.1", "--ppo-clip-eps-high", "0.3",
        "--ppo-dual-clip-c", "4", "--behav-imp-weight-cap", "6", "--is-mask-low", "0.2"]))  # an icepop flag: unused
    assert config.loss == "decoupled-ppo"
    assert dict(config.loss_params) == {"clip_eps": 0.1, "clip_eps_high": 0.3, "dual_clip_c": 4.0,
                                        "behav_imp_weight_cap": 6.0}
    cispo = AlgorithmConfig.from_args(parse_args(["--model", "tiny-llama", "--loss", "cispo", "--cispo-eps-low",
                                                  "0.4", "--cispo-eps-high", "2"]))
    assert dict(cispo.loss_params) == {"cispo_eps_low": 0.4, "cispo_eps_high": 2.0}
    default = AlgorithmConfig.from_args(parse_args(["--model", "tiny-llama"]))
    assert (default.loss, dict(default.loss_params)) == ("aipo", {"rho": 4.0})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_hyperparameter_flag_reaches_its_loss(name):
    """Whatever the registry declares: each flag of a loss, given a valid value, arrives as that loss's parameter."""
    from megatron_rl.algorithms.losses import LOSSES
    from megatron_rl.config.arguments import parse_args

    for h in LOSSES[name].hyperparameters:
        value = 6.0 if h.name == "is_mask_high" else 0.5 if h.valid(0.5) else 1.5  # valid, unlike every default
        config = AlgorithmConfig.from_args(parse_args(["--model", "tiny-llama", "--loss", name, h.flag, str(value)]))
        assert config.loss_params[h.name] == value and getattr(config.params, h.name) == value, h.flag
