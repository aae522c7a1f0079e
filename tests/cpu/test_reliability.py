"""Reliability: a run killed with SIGKILL (right after a checkpoint, and in the middle of writing one: exact
points, by the MEGATRON_RL_FAILPOINT fault injection) resumes exactly, through the user's interface
(examples/run_tiny_aipo.sh with --save/--load, keeping the last 2 checkpoints); bad input of every kind (dataset
lines, configs, checkpoint directories: damaged, changed or added files, a pickle that would run code) stops the run
at start with an error naming it. tests/cpu/test_checkpoint_hygiene.py tests the same mechanisms without a run."""

import json
import os
import subprocess
import threading
import time
import uuid

import pytest
from helpers import ROOT

from megatron_rl.algorithms import policy_losses
from megatron_rl.observability.accounting import account
from megatron_rl.observability.accounting import main as accounting_main
from megatron_rl.runtime.lifetime import wait_until_gone

SMALL = ["--sft-warmup-iters", "2", "--train-iters", "8", "--eval-size", "8", "--global-batch-size", "16",
         "--micro-batch-size", "8", "--rollout-max-response-len", "4", "--reward-num-workers", "1",
         "--keep-uniform-groups", "--max-oversample", "2"]
MARKER = "MEGATRON_RL_RELIABILITY_RUN"  # in every process a launch starts: what is left of it can be found


def _start(out, *flags, failpoint=None, watch=None):
    """Launch the tiny example; its output goes to the returned log. `watch`: also set `run.seen` (an Event) when
    a line of the output contains it (or the output ends)."""
    from megatron_rl.runtime import failpoints
    from megatron_rl.runtime.spawn import free_port

    env = {**os.environ, "OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           MARKER: uuid.uuid4().hex}
    if failpoint:
        env[failpoints.ENV] = failpoint  # the controller's rank SIGKILLs itself there; torchrun ends the rest
    log = open(out.parent / f"{out.name}-{time.monotonic_ns()}.log", "w")
    run = subprocess.Popen(["bash", "examples/run_tiny_aipo.sh", *SMALL, *flags], cwd=ROOT, env=env,
                           stdout=log if watch is None else subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True, text=True)
    run.marker = env[MARKER]
    if watch is not None:
        run.seen = threading.Event()

        def copy():
            for line in run.stdout:
                log.write(line)
                log.flush()
                if watch in line:
                    run.seen.set()
            run.seen.set()

        threading.Thread(target=copy, daemon=True).start()
    return run, log.name


def _assert_nothing_left(run):
    """Every process of the ended launch `run` (reward workers, checkpoint writers, ...) is gone within seconds."""
    left = wait_until_gone(MARKER, run.marker, timeout_s=30)
    assert not left, f"{len(left)} processes left behind: {left}"


def _crash(out, failpoint, *flags):
    run, log = _start(out, *flags, failpoint=failpoint)
    code = run.wait(600)
    text = open(log).read()
    assert code != 0 and "held-out accuracy after RL" not in text, text[-3000:]
    _assert_nothing_left(run)  # the SIGKILLed rank's reward worker and Megatron's checkpoint writers included


def _rows(path):
    return [json.loads(line) for line in open(path) if line.strip()]


@pytest.mark.slow  # two launches of the tiny example (about 25 s here): the slow tier keeps the default suite short
def test_a_sigterm_saves_a_checkpoint_that_the_same_command_resumes(tmp_path):
    import signal

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    flags = ("--save", str(ckpt), "--load", str(ckpt), "--save-interval", "100", "--exit-signal-handler",
             "--log-interval", "1")
    run, log = _start(out, *flags, watch="step 1/8 |")  # the run's own progress line after its first RL step
    assert run.seen.wait(300) and run.poll() is None, open(log).read()[-3000:]
    os.killpg(run.pid, signal.SIGTERM)  # every process of the launch, as a scheduler signals a job
    run.wait(300)
    _assert_nothing_left(run)
    text = open(log).read()
    step = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert f"SIGTERM received (--exit-signal-handler): stopping, checkpoint of step {step}" in text, text[-3000:]
    assert 1 <= step < 8 and "held-out accuracy after RL" not in text
    run, log = _start(out, *flags)  # the same command: resumes from that checkpoint and finishes
    assert run.wait(600) == 0, open(log).read()[-3000:]
    assert [r["step"] for r in _rows(out / "metrics.jsonl") if "rollout" in r] == list(range(1, 9))


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory):
    base = tmp_path_factory.mktemp("crash")
    out, ckpt = base / "out", base / "ckpt"
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    # Every launch is the same command, --load = --save, as a requeued job's: the first one is killed while its
    # first checkpoint is being written, so the second finds none and starts again from the beginning.
    save = ("--save", str(ckpt), "--save-interval", "2", "--save-hf-interval", "4",  # HF export: out/hf/iter_N
            "--keep-last-n-checkpoints", "2", "--load", str(ckpt))
    _crash(out, "checkpoint-partial:2", *save)
    assert (ckpt / "iter_0000002.partial").is_dir() and not tracker.exists()
    _crash(out, "checkpoint-saved:4", *save)  # killed right after the step-4 checkpoint became the latest
    assert tracker.read_text() == "4"
    state_at_4 = json.loads((ckpt / "iter_0000004" / "rl_state.json").read_text())
    # resume, and crash again in the middle of writing the step-6 checkpoint
    _crash(out, "checkpoint-partial:6", *save)
    assert (ckpt / "iter_0000006.partial" / "rl_state.json").exists() and not (ckpt / "iter_0000006").exists()
    tracker_after_mid_save_kill = tracker.read_text()
    for leftover in ("iter_0000003.partial", "iter_0000001.deleting"):  # of an older crashed save, and deletion
        (ckpt / leftover).mkdir()
        (ckpt / leftover / "common.pt").write_bytes(b"x")
    run, log = _start(out, *save)
    assert run.wait(600) == 0, open(log).read()[-3000:]
    _assert_nothing_left(run)
    return out, state_at_4, tracker_after_mid_save_kill, open(log).read()


def test_a_kill_mid_save_leaves_the_previous_checkpoint_latest(crashed_and_resumed):
    _, _, tracker, log = crashed_and_resumed
    assert tracker == "4"
    assert "resumed at step 4" in log


def test_only_the_last_two_checkpoints_are_kept(crashed_and_resumed):
    out, _, _, log = crashed_and_resumed
    assert sorted(os.listdir(out.parent / "ckpt")) == ["iter_0000006", "iter_0000008",
                                                       "latest_checkpointed_iteration.txt"]
    assert "--keep-last-n-checkpoints 2: deleted iter_0000002" in log
    assert "--keep-last-n-checkpoints 2: deleted iter_0000004" in log


def test_steps_versions_and_data_continue_across_the_crashes(crashed_and_resumed):
    out, _, _, _ = crashed_and_resumed
    metrics = [m for m in _rows(out / "metrics.jsonl") if "rollout" in m]  # RL steps (not evaluations)
    assert [m["step"] for m in metrics] == list(range(1, 9))  # lines of lost steps were dropped
    assert [m["train"]["weight_version"] for m in metrics] == [m["step"] + 1 for m in metrics]  # version 1: after SFT
    assert [m["train"]["consumed_samples"] for m in metrics] == [16 * m["step"] for m in metrics]
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["prompts_dispatched_more_than_once"] == 0


def test_every_prompt_is_consumed_once_and_buffered_rollouts_are_accounted_for(crashed_and_resumed):
    out, state_at_4, _, _ = crashed_and_resumed
    rows = [r for r in _rows(out / "rollouts.jsonl") if r["event"] != "dispatched"]
    resent = [r for r in rows if r["outcome"].startswith("in flight at the checkpoint")]
    final = [r for r in rows if r not in resent]
    keys = [(r["prompt_id"], r["sample_index"]) for r in final]
    assert len(keys) == len(set(keys))  # each sample trained on or discarded (with its reason) once
    assert sum(r["outcome"] == "trained" for r in final) == 16 * 8
    prompts = {pid for pid, _ in keys}
    assert all(sum(1 for p, _ in keys if p == pid) == 4 for pid in prompts)  # whole groups, across the crash
    # the checkpoint's buffered rollouts were used or discarded after the resume, with their reasons
    buffered = {(pid, r["meta"]["sample_index"]) for pid, group in state_at_4["buffer"]["groups"].items()
                for r in group}
    assert buffered <= set(keys)
    # its in-flight samples that the buffer did not hold were generated again, then used or discarded
    inflight = {(pid, k) for pid in state_at_4["inflight"] for k in range(4)} - buffered
    assert inflight and inflight == {(r["prompt_id"], r["sample_index"]) for r in resent if r["step"] == 4}
    assert inflight <= set(keys)


def test_the_run_accounts_for_itself_from_its_own_records(crashed_and_resumed):
    out, _, _, _ = crashed_and_resumed
    figures = account(str(out))
    assert figures["problems"] == [] and accounting_main([str(out)]) == 0
    assert figures["steps"] == 8 and figures["samples_trained"] == 16 * 8
    assert figures["samples_generated_again"] > 0 and figures["generated_again_reasons"]


def _trained_twice(rows):
    return rows + [next(r for r in rows if r["event"] == "trained")]


def _a_sample_lost(rows):
    lost = next(r for r in rows if r["event"] == "trained")
    return [r for r in rows if r is not lost]


def _dispatched_twice(rows):
    first = next(i for i, r in enumerate(rows) if r["event"] == "dispatched")
    return rows[:first + 1] + [rows[first]] + rows[first + 1:]


def _never_dispatched(rows):
    first = next(r for r in rows if r["event"] == "dispatched")
    return [r for r in rows if r is not first]


def _versions_from_step_5_one_less(out, skipped):
    rows = _rows(out / "metrics.jsonl")
    for m in rows:
        if "rollout" in m and m["step"] >= 5:
            m["train"]["weight_version"] -= 1
            m["train"]["skipped_steps"] += skipped
    return rows


def test_a_skipped_update_is_not_a_broken_version_sequence(crashed_and_resumed, tmp_path):
    out, _, _, _ = crashed_and_resumed
    for name in ("rollouts.jsonl", "eval.json"):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    rows = _versions_from_step_5_one_less(out, skipped=1)  # step 5's update skipped (NaN/Inf): no version 6
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert account(str(tmp_path))["problems"] == []


def test_a_prompt_dispatched_again_after_it_was_consumed_is_accounted_for(crashed_and_resumed, tmp_path):
    """As a file dataset's next epoch does: the prompt's earlier samples were all consumed, the new dispatch is open
    at the end."""
    out, _, _, _ = crashed_and_resumed
    (tmp_path / "metrics.jsonl").write_bytes((out / "metrics.jsonl").read_bytes())
    rows = _rows(out / "rollouts.jsonl")
    again = next(r for r in rows if r["event"] == "dispatched")
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [again]))
    final = json.loads((out / "eval.json").read_text())
    final["prompts_in_flight_at_end"] += 1
    (tmp_path / "eval.json").write_text(json.dumps(final))
    figures = account(str(tmp_path))
    assert figures["problems"] == [] and figures["prompts_dispatched_again"] == 1


@pytest.mark.parametrize("damage, problem", [
    (_trained_twice, "samples consumed more than once"),
    (_a_sample_lost, "prompts with only some samples consumed"),
    (_never_dispatched, "prompts consumed but never dispatched"),
    (_dispatched_twice, "prompts dispatched again while in flight"),
    ("drop step 5", "steps are not contiguous from 1"),
    ("step 5 publishes nothing", "weight versions do not advance one per step"),
])
def test_the_accounting_names_what_a_broken_run_would_leave(crashed_and_resumed, tmp_path, damage, problem):
    out, _, _, _ = crashed_and_resumed
    for name in ("rollouts.jsonl", "metrics.jsonl", "eval.json"):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    if damage == "drop step 5":
        path, rows = tmp_path / "metrics.jsonl", [m for m in _rows(out / "metrics.jsonl") if m.get("step") != 5]
    elif damage == "step 5 publishes nothing":
        path, rows = tmp_path / "metrics.jsonl", _versions_from_step_5_one_less(out, skipped=0)
    else:
        path, rows = tmp_path / "rollouts.jsonl", damage(_rows(out / "rollouts.jsonl"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert any(problem in line for line in account(str(tmp_path))["problems"])
    assert accounting_main([str(tmp_path)]) == 1


# ---- bad input ---------------------------------------------------------------------------------------------------

def _train_cli(capsys, *args):
    """The command line's entry point in this process: (exit code, stderr)."""
    from megatron_rl.train import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "1+1"', ":2: invalid JSON"),
    ('{"prompt": "1+1"}', ":2: field 'answer' is missing"),
    ('["1+1", "2"]', ":2: a record must be a JSON object, got list"),
    ('{"prompt": 5, "answer": "2"}', ":2: field 'prompt' must be a string or a list of messages, got int"),
    ('{"prompt": "  ", "answer": "2"}', ":2: field 'prompt' is empty"),
    ("\x00\x01garbage", ":2: invalid JSON"),
])
def test_malformed_dataset_lines_are_named(tmp_path, line, message):
    from megatron_rl.data.dataset import PromptDataset

    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "2+2", "answer": "4"}\n' + line + "\n")
    with pytest.raises(ValueError) as error:
        PromptDataset(str(path))
    assert str(error.value).startswith(f"{path}{message}")


@pytest.mark.parametrize("content,message", [
    ("{not json", ": invalid JSON"),
    ('{"tensor_model_paralel_size": 2}', ": unknown field(s) ['tensor_model_paralel_size']"),
    ('{"lr": "fast"}', ": field 'lr' must be float, got str"),
    ('{"loss": "grpo"}', f": field 'loss' must be one of {policy_losses()}, got 'grpo'"),
    ('{"train_iters": 2.5}', ": field 'train_iters' must be int, got float"),
    ("[1, 2]", ": must be a JSON object of flag values, got list"),
])
def test_malformed_configs_are_named(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, err = _train_cli(capsys, "--config", str(path), "--dry-run")
    assert code == 2 and message in err, err


def test_the_rl_checkpoint_exports_to_hf_as_the_run_exported_it(crashed_and_resumed, tmp_path):
    """tools/convert_megatron_to_hf.py on the run's RL checkpoint: its latest iteration (the trainer's distributed
    checkpoint, read by TP x PP processes) equals bit for bit the HF export the run streamed from its trainer at
    that step (--save-hf-interval); --iteration 6 is an earlier policy. Both load with `transformers`."""
    import sys

    import torch
    import transformers
    from safetensors.torch import load_file

    out = crashed_and_resumed[0]
    exports = {}
    for name, extra in (("latest", []), ("iter6", ["--iteration", "6"])):
        r = subprocess.run([sys.executable, "tools/convert_megatron_to_hf.py", "--load", str(out.parent / "ckpt"),
                            "--save", str(tmp_path / name), "--no-progress", *extra],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        exports[name] = load_file(tmp_path / name / "model.safetensors")
    streamed = load_file(out / "hf" / "iter_0000008" / "model.safetensors")
    assert exports["latest"].keys() == streamed.keys()
    assert all(torch.equal(exports["latest"][n], streamed[n]) for n in streamed)
    assert any(not torch.equal(exports["iter6"][n], streamed[n]) for n in streamed)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "latest")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "latest")
    assert tokenizer.decode(tokenizer.encode("12+3=15", add_special_tokens=False)) == "12+3=15"


@pytest.fixture
def checkpoint_copy(crashed_and_resumed, tmp_path):
    import shutil

    out, _, _, _ = crashed_and_resumed
    copy = tmp_path / "ckpt"
    shutil.copytree(out.parent / "ckpt", copy)
    (copy / "latest_checkpointed_iteration.txt").write_text("6")
    return copy


ITER = "iter_0000006"  # the iteration checkpoint_copy's tracker names


DRY_RUN = ("--model", "tiny-arith", "--seq-length", "32", "--dry-run", "--world-size", "2",
           "--tensor-model-parallel-size", "1")  # the layout of examples/run_tiny_aipo.sh, which wrote the checkpoint


def test_an_intact_checkpoint_passes_the_start_checks(checkpoint_copy, capsys):
    code, err = _train_cli(capsys, *DRY_RUN, "--load", str(checkpoint_copy))
    assert code == 0, err


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "latest_checkpointed_iteration.txt").unlink(), "no latest_checkpointed_iteration.txt"),
    (lambda d: (d / "latest_checkpointed_iteration.txt").write_text("soon"), "holds 'soon', not a step number"),
    (lambda d: (d / "latest_checkpointed_iteration.txt").write_text("9"), "iter_0000009"),
    (lambda d: (d / ITER / "rl_state.json").write_text("{trunc"), "cannot read .*rl_state.json"),
    (lambda d: (d / ITER / "metadata.json").unlink(), f"{ITER} is not a complete trainer checkpoint"),
    (lambda d: _edit_state(d, model={"hidden_size": 256}), "saved model has hidden_size 256, this run's is 128"),
    (lambda d: _drop_state_key(d, "format"), r"has RL state format 1, this version reads format 3"),
    (lambda d: _old_format(d), r"has RL state format 2, this version reads format 3 .*--load-megatron"),
    (lambda d: _flip_byte(d / ITER / "__0_0.distcp"), rf"error: --load '.*': .*/{ITER}/__0_0\.distcp does not match "
                                                      "its checksum"),
    (lambda d: _flip_byte(d / ITER / "common.pt", 100), rf"{ITER}/common\.pt does not match its checksum"),
    (lambda d: (d / ITER / "common.pt").unlink(), rf"{ITER}/common\.pt is missing"),
    (lambda d: (d / ITER / "rng" / "rank00001.pt").write_bytes(b"x"), r"rank00001\.pt is not listed in checksums"),
    (lambda d: (d / ITER / "checksums.json").unlink(), f"{ITER} has no checksums.json"),
])
def test_damaged_checkpoints_are_named(checkpoint_copy, capsys, damage, message):
    import re

    damage(checkpoint_copy)
    code, err = _train_cli(capsys, *DRY_RUN, "--load", str(checkpoint_copy))
    assert code == 2 and re.search(message, err), err


def test_a_checkpoint_of_another_layer_spec_is_named(checkpoint_copy, capsys):
    code, err = _train_cli(capsys, *DRY_RUN, "--load", str(checkpoint_copy), "--transformer-impl", "transformer_engine")
    assert code == 2 and "saved with --transformer-impl local, this run uses transformer_engine" in err, err


def _drop_state_key(directory, key):
    path = directory / ITER / "rl_state.json"
    state = json.loads(path.read_text())
    del state[key]
    path.write_text(json.dumps(state))


def _old_format(directory):
    """What a checkpoint of format 2 looks like to this version: no checksums.json."""
    path = directory / ITER / "rl_state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "format": 2}))
    (directory / ITER / "checksums.json").unlink()


def _edit_state(directory, **changes):
    """Change the RL state and its checksum (a consistent checkpoint of another model)."""
    from megatron_rl.checkpoint.checksums import write_checksums

    path = directory / ITER / "rl_state.json"
    state = json.loads(path.read_text())
    for key, value in changes.items():
        state[key].update(value)
    path.write_text(json.dumps(state))
    write_checksums(str(directory / ITER), "test")


def _flip_byte(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def test_a_pickle_that_runs_code_as_the_rng_file_is_refused_without_running(checkpoint_copy, capsys, tmp_path):
    """A checkpoint whose RNG file was replaced by a pickle that writes a file when unpickled: the start-up check
    names it; with checksums.json rewritten to match, the trainer's load refuses it without running it."""
    import torch

    from megatron_rl.checkpoint import rl_checkpoint
    from megatron_rl.checkpoint.checksums import write_checksums

    class RunsCode:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    iteration = checkpoint_copy / ITER
    torch.save({"torch": RunsCode()}, iteration / "rng" / "rank00000.pt")
    code, err = _train_cli(capsys, *DRY_RUN, "--load", str(checkpoint_copy))
    assert code == 2 and f"{ITER}/rng/rank00000.pt has " in err and "changed after the save" in err, err
    write_checksums(str(iteration), "test")
    with pytest.raises(ValueError, match="rank00000.pt is not an RNG state file"):
        rl_checkpoint.load_rng(str(iteration), 0)
    assert not (tmp_path / "ran").exists()


def test_a_crash_in_the_middle_of_retention_leaves_a_loadable_checkpoint(checkpoint_copy, capsys, monkeypatch):
    """--keep-last-n-checkpoints 1 killed while it deletes iter_0000006 (renamed first, some files gone): the
    tracker's iteration passes every start-up check, and the half-deleted one is not listed as saved."""
    from megatron_rl.checkpoint import rl_checkpoint

    (checkpoint_copy / "latest_checkpointed_iteration.txt").write_text("8")

    def crash(name, step):
        if name == "checkpoint-retention":
            for f in ("common.pt", "checksums.json"):
                os.unlink(checkpoint_copy / f"{ITER}.deleting" / f)
            raise KeyboardInterrupt  # stands for the SIGKILL of the failpoint

    monkeypatch.setattr(rl_checkpoint.failpoints, "crash", crash)
    with pytest.raises(KeyboardInterrupt):
        rl_checkpoint.prune_checkpoints(str(checkpoint_copy), 1)
    assert rl_checkpoint.saved_iterations(str(checkpoint_copy)) == [8]
    code, err = _train_cli(capsys, *DRY_RUN, "--load", str(checkpoint_copy))
    assert code == 0, err


def test_randomly_damaged_dataset_files_fail_cleanly_or_load(tmp_path):
    """Byte-level fuzzing: every damaged copy of a valid file either loads or raises a ValueError that names
    the file and line; nothing else escapes (no UnicodeDecodeError, KeyError, TypeError...)."""
    import random

    from megatron_rl.data.dataset import PromptDataset

    good = "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "id": i}) + "\n" for i in range(20))
    rng = random.Random(0)
    failures = 0
    for trial in range(200):
        data = bytearray(good.encode())
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        path = tmp_path / f"fuzz{trial}.jsonl"
        path.write_bytes(bytes(data))
        try:
            dataset = PromptDataset(str(path))
            assert all(isinstance(r["prompt"], str) for r in dataset.next(len(dataset)))
        except ValueError as e:
            failures += 1
            assert str(e).startswith(f"{path}:"), e
    assert failures > 100  # most damage is caught at load, before any work


def test_randomly_damaged_configs_fail_cleanly(tmp_path, capsys):
    import random

    good = json.dumps({"model": "tiny-arith", "tensor_model_parallel_size": 2, "lr": 5e-4, "train_iters": 10,
                       "rollout_fp8": False, "loss": "aipo"})
    rng = random.Random(1)
    for trial in range(40):
        data = bytearray(good.encode())
        data[rng.randrange(len(data))] = rng.choice(b'{}[]":,0a-. ')
        path = tmp_path / f"fuzz{trial}.json"
        path.write_bytes(bytes(data))
        code, err = _train_cli(capsys, "--config", str(path), "--dry-run", "--world-size", "3")
        assert code in (0, 2), err
        assert code == 0 or f"--config {path}" in err or "error:" in err, err
