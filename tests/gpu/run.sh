#!/usr/bin/env bash
# The GPU tier, in one sitting on one NVIDIA GPU (at most 8 minutes from a bare machine), nothing downloaded there.
#
#   bash tests/gpu/run.sh pack     # here, with PyPI reachable: the wheels the GPU machine lacks, into .whl/
#   bash tests/gpu/run.sh          # there: install .whl/ (if present), then tests/gpu/ and the GPU benchmarks
#
# The GPU machine is expected to have Python 3.12 with a CUDA build of torch, transformers, safetensors, numpy,
# sympy, pytest and matplotlib; `pack` fetches the rest for CPython 3.12 on manylinux x86-64 (megatron-core and
# math-verify with its parser), about 3 MB; .whl/ is git-ignored, so whatever copies the working tree to the GPU
# machine must take it along. What runs: tests/gpu/ (a trainer step on the GPU against the CPU step,
# the engine's greedy tokens against transformers on the GPU, its FP8 GEMM path, the tiny RL example on one GPU),
# then `python3 -m megatron_rl.bench fp8` and `gpu --quick` (a ~1B random Llama: trainer tokens/s and MFU, engine
# decode tokens/s at batch 1/32/128). Results: $OUT (or ./) gpu_tier.log and bench_gpu.jsonl. On a machine without a GPU
# it prints "no GPU: skipped" and exits 0.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
wheels="$repo/.whl"

if [[ "${1:-}" == "pack" ]]; then
    mkdir -p "$wheels"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$wheels" $(grep -v '^#' "$repo/tests/gpu/wheels.txt")
    du -sh "$wheels"
    exit 0
fi

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "no GPU: skipped"
    exit 0
fi
out="${OUT:-.}"
if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/megatron-rl-site \
        "$wheels"/*.whl
    export PYTHONPATH="/tmp/megatron-rl-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
cd "$repo"
python3 - <<'PY' 2>&1 | tee "$out/gpu_tier.log"
import torch
print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
PY
# Within 8 minutes from a bare machine: the wheels (~15 s), then each phase under a limit of its own (270 + 40 +
# 130 s), every test and benchmark process inside them bounded too (tests/gpu: 180 s a test at most).
export PYTHON=python3  # the one interpreter, also for the examples the tests launch
status=0
timeout 270 python3 -m pytest -q -p no:cacheprovider -rA --timeout 180 tests/gpu 2>&1 | tee -a "$out/gpu_tier.log" \
    || status=1
timeout 40 python3 -m megatron_rl.bench fp8 --results-file "$out/bench_gpu.jsonl" 2>&1 \
    | tee -a "$out/gpu_tier.log" || status=1
timeout 130 python3 -m megatron_rl.bench gpu --quick --results-file "$out/bench_gpu.jsonl" 2>&1 \
    | tee -a "$out/gpu_tier.log" || status=1
exit $status
