"""AIPO, PPO, advantages, V-trace, gates and diagnostics against hand computations (fp64 where the check
is an exact identity: tolerance 1e-12; fp32 inputs elsewhere with 1e-6)."""

import math

import pytest
import torch

from megatron_rl.algorithms import (
    aggregate,
    aipo_clamp_loss,
    aipo_loss,
    compute_advantages,
    failure_gate,
    group_filter,
    kl_penalty,
    kl_reward_penalty,
    lag_histogram,
    offpolicy_diagnostics,
    ppo_clip_loss,
    token_ratio_mask,
    version_gate,
    vtrace,
)


def _batch(seed=0, B=4, T=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g, dtype=dtype) * 3).requires_grad_()
    blp = lp.detach() + torch.randn(B, T, generator=g, dtype=dtype) * 1.5
    adv = torch.randn(B, generator=g, dtype=dtype)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    return lp, blp, adv, mask


# ---- AIPO ------------------------------------------------------------------------------------------------------

def test_aipo_gradient_is_clipped_ratio_times_advantage():
    lp, blp, adv, mask = _batch()
    rho = 2.0
    loss, _ = aipo_loss(lp, blp, adv, mask, rho=rho)
    loss.backward()
    n = mask.sum()
    expected = -torch.clamp(torch.exp(lp.detach() - blp), max=rho) * adv[:, None] * mask / n
    torch.testing.assert_close(lp.grad, expected, atol=1e-12, rtol=0)
    above = mask & (torch.exp(lp.detach() - blp) > rho)
    assert above.any(), "the batch must contain ratios above rho"
    torch.testing.assert_close(lp.grad[above], (-rho * adv[:, None].expand_as(lp) / n)[above], atol=1e-12, rtol=0)


def test_aipo_on_policy_equals_reinforce_with_group_baseline():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)  # a tiny softmax policy
    states = torch.randint(0, 5, (6, 4), generator=g)
    actions = torch.randint(0, 7, (6, 4), generator=g)
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[0, 3] = False
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = compute_advantages(rewards, groups, "group-baseline")

    def logprobs():
        return torch.log_softmax(W[states], -1).gather(-1, actions[..., None]).squeeze(-1)

    lp = logprobs()
    aipo_loss(lp, lp.detach(), adv, mask, rho=4.0)[0].backward()
    grad_aipo = W.grad.clone()
    W.grad = None
    lp = logprobs()
    reinforce = -(torch.where(mask, lp, 0.0) * adv[:, None]).sum() / mask.sum()
    reinforce.backward()
    torch.testing.assert_close(grad_aipo, W.grad, atol=1e-12, rtol=0)


def test_clamp_variant_is_a_different_estimator_with_zero_gradient_above_rho():
    lp = torch.tensor([[math.log(0.9), math.log(0.1)]], dtype=torch.float64, requires_grad=True)
    blp = torch.tensor([[math.log(0.1), math.log(0.1)]], dtype=torch.float64)  # ratios 9 and 1
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    aipo_clamp_loss(lp, blp, adv, mask, rho=4.0)[0].backward()
    assert lp.grad[0, 0] == 0.0
    lp.grad = None
    aipo_loss(lp, blp, adv, mask, rho=4.0)[0].backward()
    assert lp.grad[0, 0] == pytest.approx(-4.0 / 2)


@pytest.mark.parametrize("ratio", [1e-30, 1e30])
def test_extreme_ratios_give_finite_loss_and_grad(ratio):
    lp = torch.tensor([[-1.0, -2.0, float("-inf")]], requires_grad=True)
    blp = torch.tensor([[-1.0 - math.log(ratio), -2.0, -0.5]])
    mask = torch.tensor([[True, True, False]])
    for fn in (aipo_loss, aipo_clamp_loss):
        lp.grad = None
        loss, indicators = fn(lp, blp, torch.tensor([0.5]), mask, rho=3.0)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert indicators["clip_high"].tolist() == [[ratio > 3.0, False, False]]
    loss, _ = ppo_clip_loss(lp, blp, torch.tensor([0.5]), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


def test_observation_token_logprobs_do_not_change_the_correction():
    lp, blp, adv, mask = _batch(seed=5)
    loss1, m1 = aipo_loss(lp, blp, adv, mask)
    lp2 = lp.detach().clone()
    lp2[~mask] = -1e4
    blp2 = blp.clone()
    blp2[~mask] = 7.0
    loss2, m2 = aipo_loss(lp2.requires_grad_(), blp2, adv, mask)
    assert loss1.item() == loss2.item()
    assert m1.keys() == m2.keys() and all(torch.equal(m1[k], m2[k]) for k in m1)


def test_aggregations_by_hand_and_exact_across_microbatches():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert aggregate(x, m, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(x, m, "seq-sum-constant", constant=10).item() == pytest.approx((1 + 2 + 4) / (10 * 2))
    with pytest.raises(ValueError, match="aggregation 'mean'"):
        aggregate(x, m, "mean")
    lp, blp, adv, mask = _batch(seed=2)
    for mode, norm in (("token-mean", mask.sum().item()), ("seq-mean-token-mean", 4), ("seq-sum-constant", 4)):
        full, _ = aipo_loss(lp, blp, adv, mask, aggregation=mode)
        parts = sum(aipo_loss(lp[i:i + 2], blp[i:i + 2], adv[i:i + 2], mask[i:i + 2], aggregation=mode,
                              normalizer=norm)[0] for i in (0, 2))
        torch.testing.assert_close(parts, full, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"logprobs": torch.zeros(2, 3)[:, :2]}, "behavior_logprobs has shape"),
        ({"loss_mask": torch.ones(2, 3)}, "loss_mask must be a torch.bool tensor"),
        ({"advantages": torch.tensor([1.0, float("nan")])}, "advantages has 3 non-finite"),
        ({"advantages": torch.zeros(3)}, "advantages has shape"),
        ({"behavior_logprobs": torch.full((2, 3), float("nan"))}, "behavior_logprobs has 6 non-finite"),
        ({"rho": 0.0}, "rho must be a positive"),
        ({"logprobs": torch.zeros(2, 3, dtype=torch.long)}, "logprobs must be a floating-point tensor"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, pattern):
    args = dict(logprobs=torch.zeros(2, 3), behavior_logprobs=torch.zeros(2, 3), advantages=torch.ones(2),
                loss_mask=torch.ones(2, 3, dtype=torch.bool))
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        aipo_loss(**args)


# ---- PPO, KL --------------------------------------------------------------------------------------------------

def test_ppo_clip_zero_gradient_outside_trust_region_and_sign_dependence():
    ratios = torch.tensor([[0.5, 1.0, 1.5]], dtype=torch.float64)
    lp = torch.log(ratios).clone().requires_grad_()
    old = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    ppo_clip_loss(lp, old, torch.tensor([1.0], dtype=torch.float64), mask, clip_eps=0.2)[0].backward()
    # A > 0: the ratio 1.5 > 1.2 is clipped (zero grad); 0.5 < 0.8 is not (pessimistic side): grad -A*r/3.
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5 / 3, -1.0 / 3, 0.0]], dtype=torch.float64))
    lp.grad = None
    ppo_clip_loss(lp, old, torch.tensor([-1.0], dtype=torch.float64), mask, clip_eps=0.2)[0].backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 1.0 / 3, 1.5 / 3]], dtype=torch.float64))


def test_kl_estimators_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    d = torch.tensor([[0.5, -1.0, 0.0]], dtype=torch.float64)  # log pi - log ref, 0 where masked
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k1"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k2"), torch.tensor([[0.125, 0.5, 0.0]],
                                                                             dtype=torch.float64))
    k3 = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k3"), k3)
    with pytest.raises(ValueError, match="--kl-loss-type 'k4' is unknown"):
        kl_penalty(lp, ref, mask, "k4")


@pytest.mark.parametrize("estimator,derivative", [
    ("k1", lambda d: torch.ones_like(d)),
    ("k2", lambda d: d),
    ("k3", lambda d: 1 - torch.exp(-d)),
])
def test_kl_estimator_gradients_by_hand(estimator, derivative):
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    ref = lp.detach() + torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3
    kl_penalty(lp, ref, mask, estimator).sum().backward()
    expected = torch.where(mask, derivative(lp.detach() - ref), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(lp.grad, expected, atol=1e-12, rtol=0)


def test_kl_in_the_reward_is_the_coefficient_times_the_summed_kl():
    behavior = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-0.25, -9.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    penalty = kl_reward_penalty(behavior, ref, mask, 0.1, "k1")
    torch.testing.assert_close(penalty, torch.tensor([0.1 * (0.5 - 1.0), 0.1 * -0.25], dtype=torch.float64))


# ---- advantages -----------------------------------------------------------------------------------------------

def test_advantage_estimators_by_hand_with_interleaved_groups():
    r = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0], dtype=torch.float64)
    g = torch.tensor([7, 9, 7, 9, 4])  # groups {0,2}, {1,3}, {4}
    torch.testing.assert_close(compute_advantages(r, g, "group-baseline"),
                               torch.tensor([-1.0, -1.0, 1.0, 1.0, 0.0], dtype=torch.float64))
    std = math.sqrt(2.0)  # unbiased std of {1, 3} and of {0, 2}
    torch.testing.assert_close(compute_advantages(r, g, "grpo"),
                               torch.tensor([-1 / std, -1 / std, 1 / std, 1 / std, 0.0], dtype=torch.float64),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(compute_advantages(r, g, "rloo"),
                               torch.tensor([-2.0, -2.0, 2.0, 2.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="--advantage-estimator 'ppo'"):
        compute_advantages(r, g, "ppo")
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        compute_advantages(r, g.double(), "rloo")


# ---- V-trace (the seed chapter's minimal validation) ------------------------------------------------------------

def _td_target(r, v, gamma, s, end, terminal):
    """Plain n-step TD target from s to the row end: sum of discounted rewards + discounted bootstrap."""
    total = sum(gamma ** (t - s) * r[t] for t in range(s, end))
    return total + (0.0 if terminal else gamma ** (end - s) * v[end])


def test_vtrace_on_policy_is_n_step_td_target():
    g = torch.Generator().manual_seed(0)
    B, T, gamma = 3, 5, 0.9
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T + 1, generator=g, dtype=torch.float64)
    lp = torch.randn(B, T, generator=g, dtype=torch.float64)
    term = torch.zeros(B, T, dtype=torch.bool)
    term[1, -1] = True
    targets, adv = vtrace(r, v, lp, lp, term, gamma=gamma)
    for b in range(B):
        for s in range(T):
            expected = _td_target(r[b].tolist(), v[b].tolist(), gamma, s, T, terminal=bool(term[b, -1]))
            assert targets[b, s].item() == pytest.approx(expected, abs=1e-12)
        next_v = torch.cat([targets[b, 1:], v[b, -1:] * (0.0 if term[b, -1] else 1.0)])
        torch.testing.assert_close(adv[b], r[b] + gamma * next_v - v[b, :-1], atol=1e-12, rtol=0)


def test_vtrace_seed_example_terminal_does_not_read_boundary_value():
    reward = torch.tensor([[1.0, 2.0]])
    value = torch.tensor([[0.0, 0.0, float("nan")]], requires_grad=True)
    terminated = torch.tensor([[False, True]])
    target, advantage = vtrace(reward, value, torch.zeros_like(reward), torch.zeros_like(reward), terminated)
    torch.testing.assert_close(target, torch.tensor([[3.0, 2.0]]))
    torch.testing.assert_close(advantage, torch.tensor([[3.0, 2.0]]))
    assert not target.requires_grad and not advantage.requires_grad


def test_vtrace_truncation_keeps_the_given_bootstrap_value():
    reward = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    value = torch.tensor([[0.0, 0.0, 10.0]], dtype=torch.float64)
    target, _ = vtrace(reward, value, torch.zeros_like(reward), torch.zeros_like(reward),
                       torch.zeros(1, 2, dtype=torch.bool), gamma=0.5)
    torch.testing.assert_close(target, torch.tensor([[1 + 0.5 * 2 + 0.25 * 10, 2 + 0.5 * 10]], dtype=torch.float64))


def test_vtrace_padding_never_leaks():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(1, 3, generator=g, dtype=torch.float64)
    v = torch.randn(1, 4, generator=g, dtype=torch.float64)
    lp, blp = torch.randn(1, 3, generator=g, dtype=torch.float64), torch.randn(1, 3, generator=g, dtype=torch.float64)
    ref_t, ref_a = vtrace(r, v, lp, blp, torch.zeros(1, 3, dtype=torch.bool), gamma=0.9, rho_bar=1.5, c_bar=0.8)
    nan = float("nan")
    pad = lambda x, fill: torch.cat([x, torch.full((1, 2), fill, dtype=x.dtype)], dim=1)  # noqa: E731
    r_p, lp_p, blp_p = pad(r, 99.0), pad(lp, 5.0), pad(blp, -5.0)
    v_p = torch.cat([v, torch.full((1, 2), nan, dtype=torch.float64)], dim=1)  # bootstrap v[:, 3] then NaN
    valid = torch.tensor([[True, True, True, False, False]])
    t, a = vtrace(r_p, v_p, lp_p, blp_p, torch.zeros(1, 5, dtype=torch.bool), valid=valid,
                  gamma=0.9, rho_bar=1.5, c_bar=0.8)
    torch.testing.assert_close(t[:, :3], ref_t, atol=1e-12, rtol=0)
    torch.testing.assert_close(a[:, :3], ref_a, atol=1e-12, rtol=0)
    assert (t[:, 3:] == 0).all() and (a[:, 3:] == 0).all()


def test_vtrace_extreme_ratios_are_clipped_toward_behavior():
    reward = torch.tensor([[1.0]], dtype=torch.float64)
    value = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    term = torch.tensor([[True]])
    big, _ = vtrace(reward, value, torch.tensor([[0.0]], dtype=torch.float64),
                    torch.tensor([[-100.0]], dtype=torch.float64), term, rho_bar=2.0)
    small, _ = vtrace(reward, value, torch.tensor([[-100.0]], dtype=torch.float64),
                      torch.tensor([[0.0]], dtype=torch.float64), term, rho_bar=2.0)
    assert big.item() == pytest.approx(2.0)  # ratio e^100 clipped at rho_bar: delta = 2 * 1
    assert 0 <= small.item() < 1e-40  # ratio e^-100 is not clipped from below: the target shrinks to V


def test_vtrace_rejects_bad_shapes():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"values must have shape \(2, 4\)"):
        vtrace(r, torch.zeros(2, 3), r, r, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="terminated must be a torch.bool"):
        vtrace(r, torch.zeros(2, 4), r, r, torch.zeros(2, 3))


# ---- gates and diagnostics --------------------------------------------------------------------------------------

def test_gates_report_what_they_dropped():
    lp = torch.log(torch.tensor([[1.0, 3.0, 0.1, 1.0]]))
    mask = torch.tensor([[True, True, True, False]])
    new_mask, counts = token_ratio_mask(lp, torch.zeros(1, 4), mask, low=0.5, high=2.0)
    assert new_mask.tolist() == [[True, False, False, False]]
    assert counts == {"ratio_below_low": 1, "ratio_above_high": 1}

    vg = version_gate(10, [10, 8, 6], max_lag=2)
    assert vg.keep.tolist() == [True, True, False]
    assert vg.counts == {"stale: lag 4 > max staleness 2": 1}

    fg = failure_gate(["scored", "scorer-failure", "wrong-format", "timeout"])
    assert fg.keep.tolist() == [True, False, True, False]
    assert (vg & failure_gate(["scored", "scored", "timeout"])).reasons[1:] == [None, "stale: lag 4 > max staleness 2"]

    gf = group_filter(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert gf.keep.tolist() == [False, False, True, True]
    assert gf.counts == {"group rewards all equal": 2}


def test_diagnostics_on_and_off_policy():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.125]], dtype=torch.float64))
    mask = torch.ones(1, 3, dtype=torch.bool)
    on = offpolicy_diagnostics(lp, lp, mask)
    assert on["kl_behavior_current"] == 0 and on["ess_fraction"] == pytest.approx(1.0)
    assert on["log_ratio_abs_max"] == 0 and on["ratio_p5"] == on["ratio_p50"] == on["ratio_p95"] == 1.0
    off = offpolicy_diagnostics(lp, lp - torch.log(torch.tensor([[1.0, 4.0, 0.5]], dtype=torch.float64)), mask)
    ratios = torch.tensor([1.0, 4.0, 0.5], dtype=torch.float64)
    # Linear interpolation between the sorted ratios 0.5, 1, 4: the p-th percentile sits at position 2p.
    assert off["ratio_p5"] == pytest.approx(0.5 + 0.1 * 0.5)
    assert off["ratio_p50"] == pytest.approx(1.0)
    assert off["ratio_p95"] == pytest.approx(1.0 + 0.9 * 3.0)
    assert off["ess_fraction"] == pytest.approx(float(ratios.sum() ** 2 / (3 * (ratios ** 2).sum())))
    assert off["kl_behavior_current"] == pytest.approx(float((ratios - 1 - ratios.log()).mean()))
    assert off["log_ratio_abs_max"] == pytest.approx(math.log(4.0))
    assert lag_histogram(5, [5, 4, 4, 2]) == {0: 1, 1: 2, 3: 1}


# ---- registries ------------------------------------------------------------------------------------------------

def _readme_loss(x, p):
    """The new-loss example of the losses registry's docstring, verbatim: AIPO written from scratch."""
    ratio = torch.exp(x.logprobs.detach() - x.behavior_logprobs)
    per_token = -ratio.clamp(max=p.rho) * x.advantages[:, None] * x.logprobs
    return aggregate(per_token, x.loss_mask, **x.aggregation), {"clip_high": ratio > p.rho}


def test_a_registered_loss_brings_its_flags_and_the_docstring_example_is_aipo(monkeypatch):
    """One registry line: --loss offers the new loss, the parser takes its flag, the range check runs."""
    from megatron_rl.algorithms import LOSSES, AlgorithmConfig, Hyperparameter, Loss, LossInputs
    from megatron_rl.config.arguments import parse_args

    rho = Hyperparameter("rho", "--my-rho", 4.0, "my clip", lambda v: v > 0, "must be > 0")
    monkeypatch.setitem(LOSSES, "my-loss", Loss(_readme_loss, (rho,), "AIPO written again"))
    mine = AlgorithmConfig.from_args(parse_args(["--model", "tiny-llama", "--loss", "my-loss", "--my-rho", "2"]))
    aipo = AlgorithmConfig(loss="aipo", loss_params={"rho": 2.0})
    grads, clipped = [], []
    for config in (mine, aipo):
        lp, blp, adv, mask = _batch()
        aggregation = {"aggregation": "token-mean", "normalizer": 7.0, "constant": None}
        loss, indicators = LOSSES[config.loss].compute(LossInputs(lp, blp, adv, mask, aggregation), config.params)
        loss.backward()
        grads.append(lp.grad)
        clipped.append(indicators["clip_high"] & mask)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-12, rtol=0)
    assert torch.equal(clipped[0], clipped[1]) and clipped[0].any()
    with pytest.raises(ValueError, match=r"--my-rho must be > 0, got -1"):
        AlgorithmConfig(loss="my-loss", loss_params={"rho": -1.0})
    with pytest.raises(ValueError, match=r"--loss my-loss has no hyperparameter clip_eps \(it has: rho\)"):
        AlgorithmConfig(loss="my-loss", loss_params={"clip_eps": 0.1})
    with pytest.raises(ValueError, match=r"--loss 'nope' is unknown; choose one of \[.*'my-loss'"):
        AlgorithmConfig(loss="nope")


def test_flag_choices_are_the_registries_names():
    from megatron_rl.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, policy_losses
    from megatron_rl.config.arguments import build_parser
    from megatron_rl.rollout import ENGINE_BACKENDS

    actions = {a.dest: a for a in build_parser()._actions}
    assert list(actions["loss"].choices) == policy_losses() and "sft" not in policy_losses()
    assert set(actions["advantage_estimator"].choices) == set(ADVANTAGE_ESTIMATORS)
    assert set(actions["loss_aggregation"].choices) == set(AGGREGATIONS)
    assert set(actions["rollout_backend"].choices) == set(ENGINE_BACKENDS) == {"local", "sglang"}
