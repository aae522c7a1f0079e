#!/usr/bin/env bash
# The benchmarks that need a GPU, in one short sitting on one NVIDIA GPU (about 2 minutes), nothing
# downloaded: it uses the machine's CUDA build of torch and puts this checkout on PYTHONPATH (the FP8
# benchmark needs only torch). Prints one JSON line per benchmark and appends them to $OUT or ./ as
# bench_gpu.jsonl.
#
#   bash tools/bench_gpu.sh [--quick]
#
# What it runs: `python -m megatron_rl.bench fp8` (FP8 tensor-core GEMMs vs bf16 at Llama-3.1 70B's TP=4
# shapes, and the built-in engine's dequantize-then-bf16 block-FP8 path). What it does not: the trainer,
# DDMA and async benchmarks run several processes with a process group each, which on one GPU NCCL cannot
# form (one rank per device); the built-in engine runs on CPU only. docs/performance.md says which numbers
# came from where.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
results="${OUT:-.}/bench_gpu.jsonl"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
python3 - <<'PY'
import torch
if not torch.cuda.is_available():
    raise SystemExit("tools/bench_gpu.sh: no CUDA device visible to torch")
print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
PY
python3 -m megatron_rl.bench fp8 "$@" --results-file "$results"
