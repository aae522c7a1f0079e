"""Benchmarks: each prints one JSON object of ratios measured in the same run (python -m megatron_rl.bench)."""
