#!/usr/bin/env bash
# The real-SGLang test tier: build (or reuse) the SGLang CPU environment, then run tests/sglang/ in it.
# Exits non-zero on any failure. About 4 minutes to build the environment the first time (3 GB), then
# about 15 minutes of tests on 2 CPU cores (the soak on SGLang 3.5 of them). Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${SGLANG_VENV:-$repo/.venv-sglang}"
SGLANG_VENV="$venv" bash "$repo/tools/sglang_cpu/setup_env.sh"
cd "$repo"
export HF_HUB_OFFLINE=1 WANDB_MODE=offline PATH="$venv/bin:$PATH"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/sglang "$@"
