"""V-trace targets and advantages (IMPALA), for training a critic on off-policy data.

    rho_t = min(rho_bar, pi/mu),  c_t = min(c_bar, pi/mu)
    delta_t = rho_t * (r_t + gamma * (1 - d_t) * V(h_{t+1}) - V(h_t))
    v_s = V(h_s) + sum_t gamma^(t-s) (prod_{i<t} c_i) delta_t
    A_s = rho_s * (r_s + gamma * (1 - d_s) * v_{s+1} - V(h_s))

Terminal vs truncation: `terminated[t]` True means h_{t+1} is a true end and no value is read past it;
a sequence that is cut (truncated) without termination bootstraps from the value given at its end,
`values[:, L]` for a sequence of L valid steps.

Padding: `valid` [B, T] marks each row's real steps (a prefix). Padded steps never enter the recursion:
there v_t is taken to be V(h_t), so the step before contributes no correction through them, and targets and
advantages at padded steps are 0. Values at padded positions may be anything (NaN included).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms import checks


@torch.no_grad()
def vtrace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    terminated: torch.Tensor,
    valid: torch.Tensor | None = None,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (targets [B, T], advantages [B, T]); neither carries a gradient."""
    for name, x in (("rewards", rewards), ("values", values), ("logprobs", logprobs),
                    ("behavior_logprobs", behavior_logprobs)):
        checks.float_tensor(name, x)
    checks.bool_mask("terminated", terminated)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got shape {tuple(rewards.shape)}")
    checks.same_shape("rewards", rewards, logprobs=logprobs, behavior_logprobs=behavior_logprobs,
                      terminated=terminated)
    B, T = rewards.shape
    if tuple(values.shape) != (B, T + 1):
        raise ValueError(f"values must have shape {(B, T + 1)} (one bootstrap value per row), "
                         f"got {tuple(values.shape)}")
    if valid is None:
        valid = torch.ones_like(terminated)
    checks.bool_mask("valid", valid)
    checks.same_shape("rewards", rewards, valid=valid)
    if (valid[:, 1:] & ~valid[:, :-1]).any():
        raise ValueError("valid must be a prefix mask per row (no valid step after a padded one)")

    zero = torch.zeros((), dtype=rewards.dtype)
    log_ratio = torch.where(valid, logprobs - behavior_logprobs, zero)
    ratio = log_ratio.clamp(max=50.0).exp()
    rho, c = ratio.clamp(max=rho_bar), ratio.clamp(max=c_bar)
    bootstrap = valid & ~terminated
    next_valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
    # Only real numbers are read: V(h_t) at valid steps, V(h_{t+1}) where a step bootstraps (which includes
    # the value given at the end of a truncated row). Padding (even NaN) is never touched by arithmetic.
    v_now = torch.where(valid, values[:, :-1], zero)
    v_next = torch.where(bootstrap, values[:, 1:], zero)
    delta = torch.where(valid, rho * (rewards + gamma * v_next - v_now), zero)
    # The correction gamma * c_t * (v_{t+1} - V(h_{t+1})) flows only into a next step that is real: not past
    # a terminal step, and not past the end of a row (there v_{t+1} = V(h_{t+1}), so it is 0).
    continues = bootstrap & next_valid

    targets = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])
    for t in range(T - 1, -1, -1):
        correction = torch.where(continues[:, t], c[:, t] * (carry - v_next[:, t]), zero)
        carry = torch.where(valid[:, t], v_now[:, t] + delta[:, t] + gamma * correction, zero)
        targets[:, t] = carry
    next_targets = torch.cat([targets[:, 1:], torch.zeros_like(targets[:, :1])], dim=1)
    next_targets = torch.where(continues, next_targets, v_next)
    advantages = torch.where(valid, rho * (rewards + gamma * next_targets - v_now), zero)
    return targets, advantages
