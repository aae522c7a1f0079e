"""Reward throughput: math verdicts per second on typical short answers, with a worker pool."""

from __future__ import annotations

import random
import time


def typical_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    forms = [
        lambda a, b: (f"The sum is \\boxed{{{a + b}}}", str(a + b)),
        lambda a, b: (f"#### {a * b}", str(a * b)),
        lambda a, b: (f"so the answer is \\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a / b:.6f}".rstrip("0")),
        lambda a, b: (f"\\boxed{{{a}x+{b}}}", f"{b}+{a}x"),
        lambda a, b: (f"we get {a - b}", str(a - b + (a % 2))),
    ]
    return [forms[i % len(forms)](rng.randint(1, 99), rng.randint(1, 99)) for i in range(n)]


def run(quick: bool = False, num_workers: int = 2) -> dict:
    from megatron_rl.rewards import MathScorer, RewardSample

    samples = [RewardSample("", response, reference) for response, reference in typical_pairs(200 if quick else 1000)]
    scorer = MathScorer(num_workers=num_workers, timeout_s=5)
    try:
        warm = [RewardSample("", "\\boxed{\\frac{1}{2}}", "0.5")]  # needs a worker (integers are decided without)
        scorer(warm * num_workers * 2)  # workers up and warm
        start = time.perf_counter()
        results = scorer(samples)
        elapsed = time.perf_counter() - start
        single = MathScorer(num_workers=1, timeout_s=5)
        try:
            single(warm * 2)
            start = time.perf_counter()
            single(samples)
            single_elapsed = time.perf_counter() - start
        finally:
            single.close()
    finally:
        scorer.close()
    return {
        "verdicts": len(samples), "workers": num_workers, "verdicts_per_s": len(samples) / elapsed,
        "verdicts_per_s_1_worker": len(samples) / single_elapsed, "scaling_vs_1_worker": single_elapsed / elapsed,
        "statuses": {s: sum(r.status == s for r in results) for s in {r.status for r in results}},
    }
