"""Checkpoint hygiene, fast (no run is launched; tests/cpu/test_reliability.py does the same on a real run's
checkpoint): RNG files round-trip exactly and hold plain values only; no file of a checkpoint runs code when it is
read (the RNG file, Megatron's common.pt and sharded objects, torch's .metadata index); checksums name a damaged,
missing or added file; --keep-last-n-checkpoints keeps the newest N complete iterations, never the tracker's, and
a crash in the middle of deleting leaves only complete iterations under their names."""

import io
import json
import os
import pickle
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_rl.checkpoint import checksums, rl_checkpoint, safe_load


class _RunsCode:
    """Unpickling this creates the file `path`: the mark of code run by a load."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (io.open, (self.path, "w"))


# ---- RNG states ----------------------------------------------------------------------------------------------------

def _draws():
    return torch.rand(5).tolist(), [random.random() for _ in range(3)], random.gauss(0, 1), \
        np.random.rand(3).tolist(), np.random.standard_normal()


def test_rng_states_round_trip_exactly_and_load_weights_only(tmp_path):
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # leave a cached Gaussian in both (a part of their state)
    rl_checkpoint.save_rng(str(tmp_path), 0)
    expected = _draws()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    rl_checkpoint.load_rng(str(tmp_path), 0)
    assert _draws() == expected
    # plain values and tensors only: torch alone (without the classes megatron.core allow-lists on import) reads it
    path = rl_checkpoint.rng_file(str(tmp_path), 0)
    r = subprocess.run([sys.executable, "-c", f"import torch; torch.load({path!r}, weights_only=True)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_device_rng_state_is_saved_and_restored_when_there_is_one(tmp_path, monkeypatch):
    device_state = {"now": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: device_state["now"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: device_state.update(now=s))
    rl_checkpoint.save_rng(str(tmp_path), 3)
    saved = device_state["now"]
    device_state["now"] = torch.zeros(16, dtype=torch.uint8)
    rl_checkpoint.load_rng(str(tmp_path), 3)
    assert torch.equal(device_state["now"], saved)


def test_a_rank_without_a_saved_state_keeps_its_own(tmp_path):
    rl_checkpoint.save_rng(str(tmp_path), 0)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    rl_checkpoint.load_rng(str(tmp_path), 1)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_pickle_that_runs_code_is_refused_as_the_rng_file(tmp_path):
    marker = tmp_path / "ran"
    path = rl_checkpoint.rng_file(str(tmp_path), 0)
    os.makedirs(os.path.dirname(path))
    torch.save({"torch": _RunsCode(marker)}, path)
    with pytest.raises(ValueError, match=r"rng/rank00000\.pt is not an RNG state file .* refused"):
        rl_checkpoint.load_rng(str(tmp_path), 0)
    assert not marker.exists()
    # the file does run code under a load that is not weights-only (the check above is not vacuous)
    torch.load(path, weights_only=False)
    assert marker.exists()


# ---- Megatron's distributed checkpoint files -----------------------------------------------------------------------

def test_loads_during_a_dist_checkpoint_load_are_weights_only(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    torch.save(_RunsCode(marker), tmp_path / "obj.pt")
    monkeypatch.setenv(safe_load.FORCE_NO_WEIGHTS_ONLY, "1")  # a user's environment asking for unsafe loads
    with safe_load.weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "obj.pt", weights_only=False)  # as torch's DefaultLoadPlanner.load_bytes asks
    assert not marker.exists()
    assert os.environ.get(safe_load.FORCE_NO_WEIGHTS_ONLY) == "1"
    assert safe_load.FORCE_WEIGHTS_ONLY not in os.environ


def test_a_sharded_object_that_runs_code_is_refused(tmp_path):
    """Through torch's own reader and planner (Megatron's planner inherits its `load_bytes`)."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    dcp.save({"w": torch.zeros(2), "obj": _RunsCode(marker)}, checkpoint_id=str(tmp_path / "ckpt"))
    safe_load.check_index(str(tmp_path / "ckpt"), "--load")  # the index itself is torch's
    with safe_load.weights_only_loads(), pytest.raises(BaseException) as refused:  # torch's CheckpointException
        dcp.load({"w": torch.zeros(2), "obj": None}, checkpoint_id=str(tmp_path / "ckpt"))
    assert "Weights only load failed" in str(refused.value) + str(getattr(refused.value, "failures", ""))
    assert not marker.exists()
    dcp.load({"w": torch.zeros(2), "obj": None}, checkpoint_id=str(tmp_path / "ckpt"))  # not vacuous: it runs
    assert marker.exists()


def test_a_common_pt_that_runs_code_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv(safe_load.FORCE_NO_WEIGHTS_ONLY, "1")  # would make Megatron's torch.load(path) unsafe
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"extra": _RunsCode(marker)}, tmp_path / "common.pt")
    with pytest.raises(pickle.UnpicklingError):
        safe_load.load_common(str(tmp_path))
    assert not marker.exists()


def test_a_real_dist_checkpoint_index_passes_the_check(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}, checkpoint_id=str(tmp_path))
    safe_load.check_index(str(tmp_path), "--load")


def test_an_index_that_runs_code_is_refused_before_it_is_unpickled(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ValueError, match=r"--load: .*/\.metadata is not a torch.distributed.checkpoint index .*"
                                         r"it names io\.open.*refused without unpickling it"):
        safe_load.check_index(str(tmp_path), "--load")
    assert not marker.exists()


def test_an_index_that_changes_a_class_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    # Metadata (an allowed class) itself, then BUILD with slot state {"hijacked": 1}: setattr on the class
    data = b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x08\x00\x00\x00hijackedK\x01s\x86b."
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(ValueError, match="it sets attributes of <class"):
        safe_load.check_index(str(tmp_path), "--load")
    assert not hasattr(Metadata, "hijacked")


# ---- checksums -----------------------------------------------------------------------------------------------------

def _files(root):
    (root / "rng").mkdir(parents=True)
    (root / "rng" / "rank00000.pt").write_bytes(b"r" * 1000)
    (root / "__0_0.distcp").write_bytes(os.urandom(3 * 2**20))
    (root / "rl_state.json").write_text("{}")
    return checksums.write_checksums(str(root), "test")


def test_checksums_list_every_file(tmp_path):
    summary = _files(tmp_path)
    listed = json.loads((tmp_path / "checksums.json").read_text())["files"]
    assert sorted(listed) == ["__0_0.distcp", "rl_state.json", "rng/rank00000.pt"] and summary["files"] == 3
    assert checksums.verify_checksums(str(tmp_path), "--load x")["files"] == 3


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "rl_state.json").write_text("{ }"), "rl_state.json has 3 bytes, checksums.json says 2"),
    (lambda d: _flip_byte(d / "__0_0.distcp"), r"__0_0\.distcp does not match its checksum"),
    (lambda d: (d / "rng" / "rank00000.pt").unlink(), r"rng/rank00000\.pt is missing"),
    (lambda d: (d / "rng" / "rank00001.pt").write_bytes(b"x"), r"rng/rank00001\.pt is not listed in checksums.json"),
    (lambda d: (d / "checksums.json").unlink(), "has no checksums.json"),
    (lambda d: (d / "checksums.json").write_text("[1]"), "is not a checksum list of this project"),
])
def test_a_damaged_file_is_named(tmp_path, damage, message):
    _files(tmp_path)
    damage(tmp_path)
    with pytest.raises(ValueError, match=r"^--load x: .*" + message):
        checksums.verify_checksums(str(tmp_path), "--load x")


def _flip_byte(path, offset=12345):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def test_a_process_hashes_files_once_unless_they_change(tmp_path):
    _files(tmp_path)
    assert checksums.verify_checksums(str(tmp_path), "--load x")["hashed"]
    assert not checksums.verify_checksums(str(tmp_path), "--load x")["hashed"]  # the load after the start check
    _flip_byte(tmp_path / "__0_0.distcp")  # same size, a new modification time
    with pytest.raises(ValueError, match="does not match its checksum"):
        checksums.verify_checksums(str(tmp_path), "--load x")


def test_other_ranks_check_names_and_sizes_only(tmp_path):
    _files(tmp_path)
    _flip_byte(tmp_path / "__0_0.distcp")
    assert not checksums.verify_checksums(str(tmp_path), "--load x", full=False)["hashed"]


# ---- retention -----------------------------------------------------------------------------------------------------

class _Trainer:
    """The trainer's "save" command, as files: a dist checkpoint's metadata and data, and the RNG file."""

    def command(self, name, path):
        assert name == "save"
        os.makedirs(path)
        for fname in ("metadata.json", "__0_0.distcp", "common.pt"):
            with open(os.path.join(path, fname), "wb") as f:
                f.write(os.urandom(1000))
        rl_checkpoint.save_rng(path, 0)


def _save(directory, steps, keep):
    for step in steps:
        rl_checkpoint.save_rl_checkpoint(str(directory), step, _Trainer(), {"buffer": {}, "inflight": {}, "model": {}},
                                         keep_last=keep)


def _loadable(directory):
    """The start-up checks of what a resume reads: the tracker's iteration, its state and every file's checksum."""
    step = rl_checkpoint.latest_checkpoint_step(str(directory))
    rl_checkpoint.read_rl_state(str(directory), step)
    rl_checkpoint.verify_files(rl_checkpoint.iteration_dir(str(directory), step), "--load")
    return step


def test_retention_keeps_the_newest_n_complete_iterations(tmp_path):
    (tmp_path / "iter_0000001.partial").mkdir(parents=True)  # an earlier crashed save
    _save(tmp_path, [2, 4, 6, 8, 10], keep=2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000008", "iter_0000010", "latest_checkpointed_iteration.txt"]
    assert _loadable(tmp_path) == 10
    _save(tmp_path, [12], keep=1)
    assert rl_checkpoint.saved_iterations(str(tmp_path)) == [12]


def test_an_iteration_without_checksums_does_not_count_as_complete(tmp_path):
    _save(tmp_path, [2, 4, 6], keep=None)
    (tmp_path / "iter_0000004" / checksums.CHECKSUMS_FILE).unlink()  # damaged by hand, or of an older format
    assert rl_checkpoint.prune_checkpoints(str(tmp_path), 2) == [4]
    assert rl_checkpoint.saved_iterations(str(tmp_path)) == [2, 6]


def test_without_the_flag_every_iteration_is_kept(tmp_path):
    _save(tmp_path, [1, 2, 3], keep=None)
    assert rl_checkpoint.saved_iterations(str(tmp_path)) == [1, 2, 3]


def test_retention_never_deletes_the_trackers_iteration_nor_newer_ones(tmp_path):
    _save(tmp_path, [2, 4, 6, 8], keep=None)
    rl_checkpoint.publish_tracker(str(tmp_path), 4)  # a run resumed from step 4 (6 and 8 are its abandoned future)
    assert rl_checkpoint.prune_checkpoints(str(tmp_path), 1) == [2]
    assert rl_checkpoint.saved_iterations(str(tmp_path)) == [4, 6, 8] and _loadable(tmp_path) == 4


@pytest.mark.parametrize("where", ["after the rename", "in the middle of deleting files"])
def test_a_crash_during_retention_leaves_a_loadable_directory(tmp_path, monkeypatch, where):
    _save(tmp_path, [2, 4, 6], keep=None)

    class Crash(Exception):
        pass

    def crash_at_point(name, step):
        if where == "after the rename" and name == "checkpoint-retention":
            raise Crash

    real_rmtree = rl_checkpoint.shutil.rmtree

    def crash_in_rmtree(path, *args, **kwargs):
        if where == "in the middle of deleting files" and path.endswith(".deleting"):
            os.unlink(os.path.join(path, "__0_0.distcp"))  # some of its files are gone, then the crash
            os.unlink(os.path.join(path, checksums.CHECKSUMS_FILE))
            raise Crash
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(rl_checkpoint.failpoints, "crash", crash_at_point)
    monkeypatch.setattr(rl_checkpoint.shutil, "rmtree", crash_in_rmtree)
    with pytest.raises(Crash):
        rl_checkpoint.prune_checkpoints(str(tmp_path), 1)
    assert os.path.isdir(tmp_path / "iter_0000002.deleting")  # oldest first
    assert rl_checkpoint.saved_iterations(str(tmp_path)) == [4, 6]  # the half-deleted one is not complete
    assert _loadable(tmp_path) == 6
    monkeypatch.undo()
    _save(tmp_path, [8], keep=1)  # the next save's retention finishes the job
    assert sorted(os.listdir(tmp_path)) == ["iter_0000008", "latest_checkpointed_iteration.txt"]


def test_keep_last_n_checkpoints_is_validated(capsys):
    from megatron_rl.config.arguments import parse_args

    for argv, message in ((["--save", "x", "--keep-last-n-checkpoints", "0"], "--keep-last-n-checkpoints must be >= 1"),
                          (["--keep-last-n-checkpoints", "2"], "--keep-last-n-checkpoints needs --save")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["--save", "x", "--keep-last-n-checkpoints", "3"]).keep_last_n_checkpoints == 3


# ---- --load on a directory without a checkpoint: resume or start ---------------------------------------------------

def _load_args(load, save=None, load_hf=None, load_megatron=None):
    import argparse

    return argparse.Namespace(load=str(load), save=save and str(save), load_hf=load_hf, load_megatron=load_megatron)


def test_a_load_without_a_checkpoint_starts_a_new_run_when_the_command_says_from_what(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000002.partial").mkdir(parents=True)  # the first save of a killed job
    args = _load_args(ckpt, save=ckpt)
    rl_checkpoint.resume_or_start(args, clean=False)  # a dry run: reported, nothing removed
    assert args.load is None and (ckpt / "iter_0000002.partial").is_dir()
    args = _load_args(ckpt, save=ckpt)
    rl_checkpoint.resume_or_start(args)
    assert args.load is None and not (ckpt / "iter_0000002.partial").exists()
    assert "no checkpoint yet, a new run from the model's initialization; removed iter_0000002.partial" in \
        capsys.readouterr().out
    args = _load_args(tmp_path / "absent", load_hf="/models/hf")  # a job's first launch, the directory not made yet
    rl_checkpoint.resume_or_start(args)
    assert args.load is None and "a new run from --load-hf /models/hf" in capsys.readouterr().out


def test_a_load_without_a_checkpoint_or_a_fallback_is_an_error_naming_the_ways_out(tmp_path):
    with pytest.raises(ValueError, match=r"--load .*: no checkpoint to resume .*\(--load-hf or --load-megatron\) "
                                         r"or --save the same directory"):
        rl_checkpoint.resume_or_start(_load_args(tmp_path, save=tmp_path / "elsewhere"))


def test_a_load_with_a_checkpoint_resumes_and_says_the_initial_weights_are_not_read(tmp_path, capsys):
    (tmp_path / rl_checkpoint.TRACKER_FILE).write_text("4")
    args = _load_args(tmp_path, save=tmp_path, load_hf="/models/hf")
    rl_checkpoint.resume_or_start(args)
    assert args.load == str(tmp_path) and "resuming its latest checkpoint; --load-hf" in capsys.readouterr().out
