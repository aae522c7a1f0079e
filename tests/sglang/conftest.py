"""The real-SGLang test tier: run by `bash tests/sglang/run.sh`, in the environment that script builds
(SGLang 0.5.23 on the CPU torch wheel, tools/sglang_cpu/). Every test talks to a real SGLang server."""

import pytest
import torch

from megatron_rl.models.hf import save_random_hf_model
from megatron_rl.models.spec import get_model_spec

# fp32 everywhere: SGLang and the built-in engine then agree to ~1e-6 (different attention kernels and
# summation orders); the tests allow 1e-4.
SPEC = get_model_spec("tiny-llama").replace(name="tiny-llama-sglang", max_position_embeddings=2048)


@pytest.fixture(scope="session")
def model_a(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model_a"))
    save_random_hf_model(SPEC, path, seed=1, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def model_b(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model_b"))
    save_random_hf_model(SPEC, path, seed=2, dtype=torch.float32)
    return path
