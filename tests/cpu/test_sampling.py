"""The batched sampler against a distribution computed here by hand, and its per-request reproducibility."""

import math

import torch

from megatron_rl.rollout.local.sampling import sample
from megatron_rl.rollout.types import SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.3, -0.5, -2.0])


def _expected(logits, temperature, top_k, top_p):
    """Top-k first, then the smallest prefix of the renormalized top-k whose mass reaches top_p."""
    probs = sorted(enumerate(torch.softmax(logits / temperature, -1).tolist()), key=lambda kv: -kv[1])[:top_k]
    total = sum(p for _, p in probs)
    kept, mass = [], 0.0
    for token, p in probs:
        kept.append((token, p / total))
        mass += p / total
        if mass >= top_p:
            break
    norm = sum(p for _, p in kept)
    out = [0.0] * len(logits)
    for token, p in kept:
        out[token] = p / norm
    return out


def test_sampled_frequencies_match_the_truncated_distribution():
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    n = 20000
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens, logprobs = sample(LOGITS.expand(n, -1), [params] * n, generators)
    expected = _expected(LOGITS, 0.7, 4, 0.9)
    assert sum(p > 0 for p in expected) == 3  # this case exercises both truncations
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0:
            assert count == 0, f"token {token} is outside the top-k/top-p set but was sampled"
        else:  # 5 standard deviations of a binomial count: a false alarm about once in 3 million runs
            assert abs(count - n * p) < 5 * math.sqrt(n * p * (1 - p)), (token, count, n * p)
    reported = torch.log_softmax(LOGITS / 0.7, -1)  # before truncation (LOGPROB_CONVENTION)
    torch.testing.assert_close(torch.tensor(logprobs), reported[torch.tensor(tokens)], atol=1e-6, rtol=0)


def test_a_request_draws_the_same_token_alone_or_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.5,
              top_p=0.8), SamplingParams(temperature=1.0), SamplingParams(temperature=1.3, top_k=7)]
    seeds = [11, 12, 13, 14, 15]
    together, _ = sample(logits, params, [torch.Generator().manual_seed(s) for s in seeds])
    alone = [sample(logits[i:i + 1], [params[i]], [torch.Generator().manual_seed(seeds[i])])[0][0] for i in range(5)]
    assert together == alone
    assert together[1] == int(logits[1].argmax())  # greedy row
