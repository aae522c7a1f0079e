"""The built-in engine on the GPU: greedy tokens equal `transformers` on the same GPU (fp32: tokens are argmaxes, so
any reduction-order difference would have to flip a near-tie; the prompts and the seed are fixed), weights and KV
cache on the GPU, and block-FP8 weights served through the FP8 GEMM on Hopper."""

import pytest
import torch

from megatron_rl.models.hf import save_random_hf_model
from megatron_rl.models.spec import get_model_spec
from megatron_rl.rollout import LocalEngine, SamplingParams

LLAMA = get_model_spec("tiny-llama").replace(name="tiny-llama-v200", vocab_size=200)
PROMPTS = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15], [42]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    model = save_random_hf_model(LLAMA, directory, seed=0)
    return directory, model.to("cuda").eval()


def test_greedy_tokens_equal_transformers_on_the_gpu(model_dir):
    directory, model = model_dir
    engine = LocalEngine.from_hf(str(directory), max_slots=8, device="cuda")
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        ids = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False)
        assert out.token_ids == ids[0, len(prompt):].tolist()
    decoder = engine.decoder
    tensors = {"k_cache": decoder.k_cache, "v_cache": decoder.v_cache, **decoder.params}
    assert all(t.device.type == "cuda" for t in tensors.values())


def test_fp8_engine_uses_the_fp8_gemm_and_stays_close_to_bf16(model_dir):
    from megatron_rl.models.fp8 import RowwiseFP8, fp8_gemm_supported

    if not fp8_gemm_supported("cuda"):
        pytest.skip(f"{torch.cuda.get_device_name()} has no row-wise FP8 GEMM (compute capability < 9.0)")
    directory, _ = model_dir
    bf16 = LocalEngine.from_hf(str(directory), dtype=torch.bfloat16, max_slots=4, device="cuda")
    fp8 = LocalEngine.from_hf(str(directory), dtype=torch.bfloat16, fp8=True, max_slots=4, device="cuda")
    assert isinstance(fp8.decoder._compute["model.layers.0.mlp.down_proj.weight"], RowwiseFP8)
    tokens = PROMPTS[2]
    a, b = bf16.logits(tokens).float(), fp8.logits(tokens).float()
    assert (a - b).abs().max() <= 0.1 * a.abs().max()  # e4m3 weights and activations: ~2^-4 per element
