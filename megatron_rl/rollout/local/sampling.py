"""Token sampling with temperature / top-k / top-p, returning the behavior log-prob in LOGPROB_CONVENTION.

One call samples a whole decode step: rows that share their sampling parameters are processed together, and
each request draws its uniform number from its own generator (inverse-CDF sampling), so a request's tokens
depend on its seed only, never on which requests share its batch or on the TP rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from megatron_rl.rollout.types import SamplingParams


def truncate(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature-scaled logits [B, V] with every token outside the top-k / top-p set at -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = torch.cumsum(probs, -1) - probs >= top_p
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return scaled


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """Sample one token per row of full-vocabulary logits [B, V]; return (tokens, their behavior log-probs)."""
    logits = logits.float()
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    logprobs = torch.empty(len(params), dtype=torch.float32, device=logits.device)
    by_params: dict[tuple, list[int]] = defaultdict(list)
    for i, p in enumerate(params):
        by_params[(p.temperature, p.top_k, p.top_p)].append(i)
    for (temperature, top_k, top_p), rows in by_params.items():
        index = torch.tensor(rows, device=logits.device) if len(by_params) > 1 else slice(None)  # usually one group
        x = logits[index]
        if temperature == 0:
            chosen = torch.argmax(x, -1)
            reported = torch.log_softmax(x, -1)
        else:
            scaled = x / temperature
            reported = torch.log_softmax(scaled, -1)  # the behavior distribution: before truncation
            probs = torch.softmax(truncate(scaled, top_k, top_p), -1)
            cdf = torch.cumsum(probs, -1, dtype=torch.float64)
            u = torch.cat([torch.rand(1, generator=generators[i], dtype=torch.float64) for i in rows]).to(logits.device)
            # the first token whose cumulative mass exceeds u x total (a token of zero mass never is); the
            # minimum guards against u x total rounding up to the total
            chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
            last_kept = x.shape[-1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.uint8), -1)
            chosen = torch.minimum(chosen, last_kept)
        tokens[index] = chosen
        logprobs[index] = reported.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    return tokens.tolist(), logprobs.tolist()
