"""Off-policy diagnostics per batch (the seed chapter's list): a version gap is not a distribution gap,
so report the distance between behavior and current policy on the tokens actually trained on. What each loss
did to the tokens (clipped, masked) is the loss's own statistics, reported beside these by the trainer."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import torch


def offpolicy_diagnostics(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
) -> dict[str, float]:
    """KL(mu || pi) on action tokens, percentiles of |log(pi/mu)| and of pi/mu, effective sample size."""
    valid = loss_mask
    n = int(valid.sum())
    if n == 0:
        return {"tokens": 0}
    log_ratio = (logprobs.detach() - behavior_logprobs)[valid].double()
    log_ratio = log_ratio.clamp(-50.0, 50.0)  # keeps exp finite for the KL estimate and ESS
    ratio = log_ratio.exp()
    abs_lr = log_ratio.abs()
    q = _quantiles(abs_lr, [0.5, 0.95, 0.99])
    ratio_q = _quantiles(ratio, [0.05, 0.5, 0.95])
    return {
        "tokens": n,
        # E_mu[log mu - log pi] with the k3 estimator (samples come from mu): ratio - 1 - log ratio >= 0.
        "kl_behavior_current": float((ratio - 1 - log_ratio).mean()),
        "log_ratio_abs_p50": float(q[0]),
        "log_ratio_abs_p95": float(q[1]),
        "log_ratio_abs_p99": float(q[2]),
        "log_ratio_abs_max": float(abs_lr.max()),
        "ratio_mean": float(ratio.mean()),
        "ratio_p5": float(ratio_q[0]),
        "ratio_p50": float(ratio_q[1]),
        "ratio_p95": float(ratio_q[2]),
        # Kish effective sample size of the importance weights, as a fraction of the token count.
        "ess_fraction": float(ratio.sum() ** 2 / (n * (ratio ** 2).sum())),
    }


def _quantiles(x: torch.Tensor, qs: list[float]) -> torch.Tensor:
    """torch.quantile's (linear interpolation) of a non-empty 1-D tensor."""
    return torch.quantile(x, torch.tensor(qs, dtype=x.dtype)) if x.numel() > 1 else x.repeat(len(qs))


def lag_histogram(trainer_version: int, behavior_versions: Iterable[int]) -> dict[int, int]:
    """How many samples have each lag (trainer version minus behavior version), in steps."""
    return dict(sorted(Counter(trainer_version - v for v in behavior_versions).items()))


def lag_summary(histogram: dict[int, int]) -> dict[str, float]:
    total = sum(histogram.values())
    if not total:
        return {"lag_mean": math.nan, "lag_max": math.nan}
    return {"lag_mean": sum(k * v for k, v in histogram.items()) / total, "lag_max": float(max(histogram))}
