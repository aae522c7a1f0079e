"""Token sampling with temperature / top-k / top-p, returning the behavior log-prob in LOGPROB_CONVENTION."""

from __future__ import annotations

import torch

from megatron_rl.rollout.types import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """Sample one token from full-vocabulary logits [V]; return (token, its behavior log-prob)."""
    logits = logits.float()
    if params.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    scaled = logits / params.temperature
    logprobs = torch.log_softmax(scaled, -1)  # the reported distribution: before truncation
    truncated = scaled
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        truncated = truncated.masked_fill(truncated < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(truncated, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = torch.cumsum(probs, -1) - probs >= params.top_p
        truncated = truncated.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    token = int(torch.multinomial(torch.softmax(truncated, -1), 1, generator=generator))
    return token, float(logprobs[token])
