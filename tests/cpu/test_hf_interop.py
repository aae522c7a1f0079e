"""HF <-> Megatron conversion: real sizes, bit-identical round trips, logits equal to `transformers`, and
clean errors for checkpoints that do not match their config; an RL-trained policy exported to HF (from its RL
checkpoint, and streamed during the run) and runs started from Megatron checkpoints (--load-megatron).

Logit tolerance: 2e-5 absolute in fp32, on logits of magnitude ~0.1-1 (Megatron and transformers order the attention
and MLP reductions differently, and TP=2 splits each row-parallel matmul into two partial sums added by an
all-reduce: ~1e-7 per op; a layout error moves logits by > 1e-2)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT
from safetensors.torch import load_file, save_file

from megatron_rl.models.hf import hf_config, save_random_hf_model
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import MODELS, ModelSpec, get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks

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

    from megatron_rl.checkpoint.megatron_format import MegatronCheckpoint
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


@pytest.mark.parametrize("spec", [LLAMA, pytest.param(QWEN_TIED, marks=pytest.mark.slow)], ids=["llama", "qwen2-tied"])
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
    from megatron_rl.checkpoint import hf_conversion

    hf_dir, meg = tmp_path / "hf", tmp_path / "meg"
    save_random_hf_model(LLAMA, hf_dir)
    hf_conversion.hf_to_megatron(str(hf_dir), str(meg), TrainerLayout(2, 1), progress=False)
    os.remove(meg / "mp_rank_01_000.safetensors")
    with pytest.raises(FileNotFoundError, match="mp_rank_01_000.safetensors"):
        hf_conversion.megatron_to_hf(str(meg), str(tmp_path / "out"), progress=False)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


# ---- a trained policy out to HF, and runs started from Megatron checkpoints --------------------------------------
# One launch of the run's own pieces (flags, run setup, roles, the trainer executor) at TP=2, PP=2, one generator
# rank idle: the trainer starts from a TP=1 converted checkpoint (--load-megatron), takes one optimizer step, saves
# an RL checkpoint and an HF export ("save_hf"). Trainer logits are taken before and after the step.

RUN_SPEC = get_model_spec("tiny-llama")  # vocab 128: padded to 256 at TP=2; holds the character tokenizer
RUN_FLAGS = ["--model", "tiny-llama", "--seq-length", "32", "--rollout-tensor-parallel-size", "1",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2"]
IDS = torch.randint(0, RUN_SPEC.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))


def _trainer_logits(policy, ids):
    """Full-vocabulary logits of the trainer's forward (every trainer rank calls it; the last stage returns them)."""
    from helpers import gather_vocab_parallel

    from megatron_rl.trainer.policy import run_microbatches

    def fn(logits, mb):
        return logits.sum() * 0, {"logits": gather_vocab_parallel(logits).detach()}

    out = run_microbatches(policy, [{"tokens": ids}], fn, forward_only=True)
    return out[0]["logits"][..., :RUN_SPEC.vocab_size].clone() if out else None


def _run_rank(flags, world, save, hf_export):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.checkpoint import rl_checkpoint
    from megatron_rl.config.arguments import parse_args
    from megatron_rl.config.setup import build_run_setup
    from megatron_rl.runtime.roles import init_roles
    from megatron_rl.trainer.batch import TrainBatch

    setup = build_run_setup(parse_args(flags), world)
    roles = init_roles(setup.trainer.world_size, 1, 1)
    out = {}
    if roles.is_trainer:
        from megatron_rl.trainer.executor import TrainerExecutor

        trainer = TrainerExecutor(setup, roles)
        policy = trainer.trainer.policy
        out["before"] = _trainer_logits(policy, IDS)
        if save is not None and roles.is_controller:
            g = torch.Generator().manual_seed(0)
            vocab = RUN_SPEC.vocab_size
            batch = TrainBatch.from_sequences([torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(4)],
                                              [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(4)],
                                              [[-2.0] * 6] * 4, [1.0, -1.0, 0.5, -0.5])
            out["metrics"] = trainer.command("train", batch)
            rl_checkpoint.save_rl_checkpoint(save, 1, trainer, {"model": RUN_SPEC.weight_fields(), "buffer": {},
                                                                "inflight": {}, "transformer_impl": "local"})
            trainer.command("save_hf", hf_export)
            trainer.stop()
        elif save is not None:
            trainer.serve()
        out["after"] = _trainer_logits(policy, IDS)
        out["last_stage_tp0"] = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    dist.destroy_process_group()
    return out


def _launch(flags, tp, pp, save=None, hf_export=None):
    world = tp * pp + 1
    flags = [*RUN_FLAGS, *flags, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    results = run_on_ranks(_run_rank, world, flags, world, save, hf_export, backend=None, timeout_s=900)
    return {**next(r for r in results if r.get("last_stage_tp0")), "metrics": results[0].get("metrics")}


@pytest.fixture(scope="module")
def rl_trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("rl_trained")
    hf_dir, meg = base / "hf", base / "meg"
    hf_model = save_random_hf_model(RUN_SPEC, hf_dir, seed=6)
    from megatron_rl.checkpoint.hf_conversion import hf_to_megatron

    hf_to_megatron(str(hf_dir), str(meg), TrainerLayout(1, 1), progress=False)
    with torch.no_grad():
        hf_logits = hf_model(IDS).logits
    save, export = base / "save", base / "export" / "iter_0000001"
    run = _launch(["--load-megatron", str(meg), "--output-dir", str(base / "out")], 2, 2, str(save), str(export))
    return {"base": base, "hf_logits": hf_logits, "run": run, "save": save, "export": export}


def _hf_logits(directory):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(IDS).logits


def test_a_run_started_from_a_converted_checkpoint_has_its_weights(rl_trained):
    # The TP=1 safetensors checkpoint served as HF slices to a TP=2, PP=2 trainer.
    torch.testing.assert_close(rl_trained["run"]["before"], rl_trained["hf_logits"], atol=2e-5, rtol=0)


def test_a_trained_policy_exports_to_hf_with_the_trainers_logits(rl_trained):
    from megatron_rl.data.tokenizer import build_char_tokenizer

    run, save, export = rl_trained["run"], rl_trained["save"], rl_trained["export"]
    assert run["metrics"]["update_successful"]
    trained = run["after"]
    assert (trained - run["before"]).abs().max() > 1e-3  # the optimizer step moved the policy
    # The RL checkpoint (its latest iteration), read by TP x PP processes, and the run's own streamed export.
    out = rl_trained["base"] / "from_rl_checkpoint"
    r = _tool("convert_megatron_to_hf.py", "--load", str(save), "--save", str(out))
    assert r.returncode == 0, r.stderr
    for directory in (out, export):
        torch.testing.assert_close(_hf_logits(directory), trained, atol=2e-5, rtol=0, msg=str(directory))
    exported, streamed = load_file(out / "model.safetensors"), load_file(export / "model.safetensors")
    assert exported.keys() == streamed.keys() and all(torch.equal(exported[n], streamed[n]) for n in exported)

    import transformers

    tokenizer, char = transformers.AutoTokenizer.from_pretrained(out), build_char_tokenizer()
    assert tokenizer.encode("12+3=15", add_special_tokens=False) == char.encode("12+3=15", add_special_tokens=False)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [char.eos_token_id]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == char.eos_token_id


def test_a_run_starts_from_an_rl_checkpoint_at_another_layout(rl_trained):
    # --load-megatron of an RL checkpoint directory: its latest iteration's distributed checkpoint, saved at TP=2,
    # PP=2, resharded by Megatron-Core into a TP=1 trainer.
    run = _launch(["--load-megatron", str(rl_trained["save"]), "--output-dir", str(rl_trained["base"] / "out1")],
                  1, 1)
    torch.testing.assert_close(run["before"], rl_trained["run"]["after"], atol=2e-5, rtol=0)


def test_a_missing_iteration_and_a_directory_of_neither_kind_are_named(rl_trained, tmp_path):
    save = str(rl_trained["save"])
    r = _tool("convert_megatron_to_hf.py", "--load", save, "--iteration", "7", "--save", str(tmp_path / "x"))
    assert r.returncode == 2 and "--iteration 7" in r.stderr and "no iter_0000007 (saved iterations: 1)" in r.stderr, \
        r.stderr
    (tmp_path / "empty").mkdir()
    r = _tool("convert_megatron_to_hf.py", "--load", str(tmp_path / "empty"), "--save", str(tmp_path / "x"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "is neither an RL checkpoint (latest_checkpointed_iteration.txt" in r.stderr, r.stderr
    assert "nor a Megatron checkpoint of weights (megatron_rl.json" in r.stderr
    assert not (tmp_path / "x").exists()


def test_a_damaged_rl_checkpoint_is_refused_before_anything_is_written(rl_trained, tmp_path):
    """The converter checks the iteration against its checksums.json, whether given the RL checkpoint directory or
    the iteration itself: a file of the same size with one byte changed is named."""
    save = tmp_path / "ckpt"
    shutil.copytree(rl_trained["save"], save)
    iteration = next(save.glob("iter_*"))
    victim = max((p for p in iteration.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(data)
    for load in (save, iteration):
        r = _tool("convert_megatron_to_hf.py", "--load", str(load), "--save", str(tmp_path / "x"))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"{victim} does not match its checksum" in r.stderr, r.stderr
        assert not (tmp_path / "x").exists()


def _dry_run(capsys, *flags):
    from megatron_rl.train import main

    code = main([*RUN_FLAGS, "--dry-run", "--world-size", "2", *flags])
    return code, capsys.readouterr().err


def test_run_start_checks_of_load_megatron(rl_trained, tmp_path, capsys):
    meg, save = str(rl_trained["base"] / "meg"), str(rl_trained["save"])
    assert _dry_run(capsys, "--load-megatron", meg)[0] == 0
    assert _dry_run(capsys, "--load-megatron", save)[0] == 0
    (tmp_path / "empty").mkdir()
    code, err = _dry_run(capsys, "--load-megatron", str(tmp_path / "empty"))
    assert code == 2 and "--load-megatron" in err and "is neither an RL checkpoint" in err, err
    code, err = _dry_run(capsys, "--load", meg)
    assert code == 2 and "weights only" in err and "--load-megatron" in err, err
    code, err = _dry_run(capsys, "--load-megatron", meg, "--num-layers", "4")
    assert code == 2 and "the checkpoint's model has num_layers 2, this run's is 4" in err, err
    code, err = _dry_run(capsys, "--load-megatron", save, "--transformer-impl", "transformer_engine")
    assert code == 2 and "saved with --transformer-impl local, this run uses transformer_engine" in err, err


@pytest.mark.parametrize("flags,message", [
    (["--load-hf", "a", "--load-megatron", "b"], "--load-hf and --load-megatron both give the initial weights"),
    (["--save-hf-interval", "-1"], "--save-hf-interval must be >= 0, got -1"),
])
def test_export_and_initial_weight_flags_are_checked(flags, message, capsys):
    from megatron_rl.config.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err
