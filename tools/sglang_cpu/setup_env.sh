#!/usr/bin/env bash
# Build (or reuse) the real-SGLang CPU environment described in docs/sglang.md.
#
# SGLang's PyPI package pulls a CUDA torch and CUDA kernels; its own CPU backend needs a C++ kernel build
# that is not on PyPI. This environment instead runs SGLang's torch-native code paths on the CPU torch
# wheel: sglang itself and its pure-Python dependencies, triton without dependencies (imported
# unconditionally), and the two tiny shims in ./shims (see the README there). Nothing else is patched.
#
# Usage: SGLANG_VENV=path bash tools/sglang_cpu/setup_env.sh      (default: <repo>/.venv-sglang)
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${SGLANG_VENV:-$repo/.venv-sglang}"
stamp="$venv/.megatron-rl-ready"
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0

if [[ -f "$stamp" ]] && [[ "$(cat "$stamp")" == "sglang==$SGLANG_VERSION torch==$TORCH_VERSION" ]]; then
    "$venv/bin/pip" install -q -e "$repo"   # the project's own code may have moved, or gained a dependency
    echo "SGLang CPU environment ready (reused): $venv"
    exit 0
fi

start=$(date +%s)
echo "[sglang-cpu] creating $venv (about 3 GB; a few minutes)"
python3 -m venv "$venv"
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" triton
# SGLang's pure-Python run-time dependencies (its declared list minus the CUDA-only packages).
"${pip[@]}" numpy aiohttp fastapi uvicorn orjson pyzmq psutil pydantic requests setproctitle uvloop msgspec \
    pybase64 xxhash einops interegular partial_json_parser python-multipart prometheus-client pillow tqdm \
    sentencepiece tiktoken packaging transformers==5.19.0 tokenizers==0.23.2 scipy blobfile regex distro python-dateutil \
    zstandard watchfiles openai easydict gguf IPython dill xgrammar==0.2.7 llguidance compressed-tensors \
    openai-harmony anthropic numba soundfile==0.13.1 jsonschema pytest pytest-timeout
# The project itself (with its dependencies: megatron-core for DDMA's layouts, sympy for rewards, ...).
"${pip[@]}" -e "$repo"
# The shims go on the path through a .pth file, so both the test process and SGLang's spawned
# scheduler processes see them.
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$repo/tools/sglang_cpu/shims" > "$site/megatron_rl_sglang_cpu_shims.pth"
"$venv/bin/python" -c "import sglang, sgl_kernel; print('[sglang-cpu] sglang', sglang.__version__)"
echo "sglang==$SGLANG_VERSION torch==$TORCH_VERSION" > "$stamp"
echo "[sglang-cpu] ready in $(( $(date +%s) - start )) s: $venv"
