"""HF <-> Megatron conversion: real sizes, bit-identical round trips, logits equal to `transformers`, and
clean errors for checkpoints that do not match their config.

Logit tolerance: 2e-5 absolute in fp32 (Megatron and transformers order the attention and MLP reductions
differently, ~1e-7 per op; a layout error moves logits by > 1e-2)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.launch import run_on_ranks
from megatron_rl.models.hf import hf_config, save_random_hf_model
from megatron_rl.models.layout import TrainerLayout
from megatron_rl.models.spec import MODELS, ModelSpec, get_model_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Vocab 200: padded to 256 at TP=1 and 512 at TP=2, so padding is exercised on export and import.
LLAMA = get_model_spec("tiny-llama").replace(name="tiny-llama-v200", vocab_size=200)
QWEN_TIED = get_model_spec("tiny-qwen2").replace(name="tiny-qwen2-tied", vocab_size=200, tie_word_embeddings=True)


def _tool(name, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args, "--no-progress"],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name,published", [
    ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800),
    ("qwen2.5-0.5b", 494_032_768), ("qwen2.5-7b", 7_615_616_512),
])
def test_real_sizes_match_public_configs(name, published):
    import transformers

    spec = MODELS[name]
    assert spec.num_parameters() == published
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(spec))
    assert sum(p.numel() for p in model.parameters()) == published
    assert ModelSpec.from_hf_config(spec.to_hf_config(), name=name) == spec


@pytest.mark.parametrize("spec", [LLAMA, QWEN_TIED], ids=["llama", "qwen2-tied"])
def test_round_trip_tp2_pp2_is_bit_identical(tmp_path, spec):
    hf_dir, meg, back = tmp_path / "hf", tmp_path / "meg", tmp_path / "back"
    save_random_hf_model(spec, hf_dir, seed=1)
    r = _tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--save", str(meg),
              "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(p for p in os.listdir(meg) if p.startswith("mp_rank")) == [
        "mp_rank_00_000.safetensors", "mp_rank_00_001.safetensors",
        "mp_rank_01_000.safetensors", "mp_rank_01_001.safetensors"]
    r = _tool("convert_megatron_to_hf.py", "--load", str(meg), "--save", str(back))
    assert r.returncode == 0, r.stderr
    original, restored = load_file(hf_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name
    assert os.path.exists(back / "generation_config.json")

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == hf_config(spec).architectures[0]


def test_torch_dist_format_round_trip(tmp_path):
    hf_dir, meg, back = tmp_path / "hf", tmp_path / "meg", tmp_path / "back"
    save_random_hf_model(LLAMA, hf_dir, seed=2)
    r = _tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--save", str(meg),
              "--target-tensor-parallel-size", "2", "--megatron-format", "torch_dist")
    assert r.returncode == 0, r.stderr
    assert os.path.isdir(meg / "torch_dist")
    r = _tool("convert_megatron_to_hf.py", "--load", str(meg), "--save", str(back))
    assert r.returncode == 0, r.stderr
    original, restored = load_file(hf_dir / "model.safetensors"), load_file(back / "model.safetensors")
    assert all(torch.equal(original[n], restored[n]) for n in original) and original.keys() == restored.keys()


def _megatron_logits(source: str, from_megatron: bool, spec: ModelSpec, tp: int, ids: torch.Tensor):
    from helpers import gather_vocab_parallel
    from megatron.core import parallel_state as ps

    from megatron_rl.conversion import MegatronCheckpoint
    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.model import build_gpt_model
    from megatron_rl.trainer.weights import load_hf_weights

    layout = TrainerLayout(tp, 1, dtype_bytes=4)
    parallel.initialize(layout, spec)
    model = build_gpt_model(spec, layout).eval()
    reader = MegatronCheckpoint(source) if from_megatron else HFCheckpoint(source)
    load_hf_weights(model, spec, layout, reader.get_slice)
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        logits = gather_vocab_parallel(logits)[..., : spec.vocab_size]
    rank = ps.get_tensor_model_parallel_rank()
    parallel.destroy()
    return logits if rank == 0 else None


@pytest.mark.parametrize("spec", [LLAMA, QWEN_TIED], ids=["llama", "qwen2-tied"])
def test_megatron_from_converted_checkpoint_matches_transformers(tmp_path, spec):
    hf_dir, meg = tmp_path / "hf", tmp_path / "meg"
    hf_model = save_random_hf_model(spec, hf_dir, seed=3)
    assert _tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--save", str(meg),
                 "--target-tensor-parallel-size", "2").returncode == 0
    ids = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(ids).logits
    # The TP=2 checkpoint loaded at TP=1 and at TP=2, and the HF directory loaded straight (--load-hf).
    for tp, source, from_megatron in ((1, meg, True), (2, meg, True), (2, hf_dir, False)):
        logits = run_on_ranks(_megatron_logits, tp, str(source), from_megatron, spec, tp, ids)[0]
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0, msg=f"tp={tp} source={source}")


# ---- bad checkpoints -------------------------------------------------------------------------------------------

def _broken(tmp_path, mutate):
    hf_dir = tmp_path / "hf"
    save_random_hf_model(LLAMA, hf_dir, seed=4)
    tensors = load_file(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    mutate(tensors, config)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(config))
    return hf_dir


@pytest.mark.parametrize("mutate,message", [
    (lambda t, c: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t, c: t.__setitem__("model.norm.weight", torch.ones(63)), "'model.norm.weight' has shape (63,)"),
    (lambda t, c: c.update(model_type="gpt2"), "field 'model_type': unsupported architecture 'gpt2'"),
    (lambda t, c: c.update(num_hidden_layers=3), "missing tensor 'model.layers.2."),
    (lambda t, c: t.__setitem__("model.layers.0.extra.weight", torch.ones(2)), "tensor 'model.layers.0.extra.weight'"),
])
def test_mismatched_checkpoint_fails_naming_the_tensor_or_field(tmp_path, mutate, message):
    hf_dir = _broken(tmp_path, mutate)
    out = tmp_path / "meg"
    r = _tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--save", str(out),
              "--target-tensor-parallel-size", "2")
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith("meg")]


def test_bad_layout_and_existing_output_are_refused(tmp_path):
    hf_dir = tmp_path / "hf"
    save_random_hf_model(LLAMA, hf_dir)
    r = _tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--save", str(tmp_path / "m"),
              "--target-tensor-parallel-size", "4")
    assert r.returncode == 2 and "trainer TP=4 (--target-tensor-parallel-size) does not divide model" in r.stderr
    (tmp_path / "m").mkdir()
    r = _tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--save", str(tmp_path / "m"))
    assert r.returncode == 2 and "already exists" in r.stderr


def test_interrupted_export_leaves_nothing_that_looks_valid(tmp_path):
    from megatron_rl import conversion as convert

    hf_dir, meg = tmp_path / "hf", tmp_path / "meg"
    save_random_hf_model(LLAMA, hf_dir)
    convert.hf_to_megatron(str(hf_dir), str(meg), TrainerLayout(2, 1), progress=False)
    os.remove(meg / "mp_rank_01_000.safetensors")
    with pytest.raises(FileNotFoundError, match="mp_rank_01_000.safetensors"):
        convert.megatron_to_hf(str(meg), str(tmp_path / "out"), progress=False)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]
