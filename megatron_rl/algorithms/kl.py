"""The KL divergence to a reference policy, estimated on the sampled tokens (Schulman's k1 / k2 / k3).

Two uses, chosen by --use-kl-in-reward:
- as a loss term (the default; GRPO's form): `kl_coef * aggregate(kl_penalty(logprobs, ref_logprobs))` is added
  to the policy loss and differentiated through the current policy's log-probs;
- in the reward (verl's `apply_kl_penalty` followed by an outcome advantage estimator): each rollout's reward is
  reduced by `kl_coef` times its per-token KL summed over the response, before the group advantages; no gradient
  flows through it. The log-probs are those of the policy that sampled the rollout (verl's `old_log_probs`).

Per token, with d = log pi - log ref (pi the policy, ref the reference):
- k1 = d: unbiased, can be negative; d/d(log pi) = 1;
- k2 = d^2 / 2: biased, non-negative; d/d(log pi) = d;
- k3 = exp(-d) + d - 1: unbiased, non-negative, low variance; d/d(log pi) = 1 - exp(-d).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms import checks

KL_ESTIMATORS = ("k1", "k2", "k3")  # --kl-loss-type


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor,
               estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate [B, T] on sampled tokens; masked tokens give 0. The log-ratio is
    clamped to [-20, 20] so that k3's exponential stays finite on a token the reference finds impossible."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"--kl-loss-type {estimator!r} is unknown; choose one of {list(KL_ESTIMATORS)}")
    checks.bool_mask("loss_mask", loss_mask)
    checks.same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs, loss_mask=loss_mask)
    zero = torch.zeros((), dtype=logprobs.dtype)
    log_ratio = torch.where(loss_mask, logprobs - ref_logprobs, zero).clamp(-20.0, 20.0)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    return torch.exp(-log_ratio) + log_ratio - 1


def kl_reward_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                      kl_coef: float, estimator: str = "k1") -> torch.Tensor:
    """What --use-kl-in-reward subtracts from each rollout's reward: kl_coef x its per-token KL summed over the
    response's trained tokens, [B]."""
    return kl_coef * kl_penalty(logprobs, ref_logprobs, loss_mask, estimator).sum(-1)
