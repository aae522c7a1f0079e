"""The RL checkpoint directory (Megatron's layout): `iter_NNNNNNN/` per saved step, holding the trainer's
dist checkpoint, per-rank RNG states (`rng/rankNNNNN.pt`, tensors and plain values only: read with
`torch.load(weights_only=True)`), the controller's `rl_state.json` and `checksums.json` (every other file's sha256,
written last), and the tracker `latest_checkpointed_iteration.txt`. A save is written to `iter_N.partial`, renamed
when complete, and only then named by the tracker, so a crash at any point of a save leaves the previous
checkpoint the latest. Each iteration also describes its model (`megatron_rl.json`, the tokenizer and generation
config, written by the trainer's "save"), so that it can be exported to HF or started from as a Megatron checkpoint
of weights. Also: retention (--keep-last-n-checkpoints), the start-up checks of a `--load` (resume) and a
`--load-megatron` (initial weights) directory, and cutting the run's JSONL logs back to the resumed step.

No file of a checkpoint is read in a way that can run code from it: JSON, weights-only `torch.load`, and
Megatron's distributed checkpoint through `safe_load` (which says what is still unpickled, and how it is checked
first)."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch

from megatron_rl.checkpoint import safe_load
from megatron_rl.checkpoint.checksums import CHECKSUMS_FILE, verify_checksums, write_checksums
from megatron_rl.checkpoint.megatron_format import DIST_CHECKPOINTS, META_FILE, MegatronCheckpoint, read_meta
from megatron_rl.models.safetensors_io import HFCheckpoint, validate_hf_checkpoint
from megatron_rl.models.spec import ModelSpec
from megatron_rl.runtime import failpoints

TRACKER_FILE, RL_STATE_FILE = "latest_checkpointed_iteration.txt", "rl_state.json"
# 2: the controller's whole state in rl_state.json, rollouts as {output, meta, reward}, the trainer's layer spec.
# 3: RNG files of tensors and plain values (weights-only loadable, no numpy objects); checksums.json.
RL_STATE_FORMAT = 3
HAS_REFERENCE = "has_reference"  # the trainer's common state: whether the reference model was saved beside it
PARTIAL, DELETING = ".partial", ".deleting"  # suffixes of an iteration being written, and being deleted


def save_rl_checkpoint(directory: str, step: int, trainer, rl_state: dict, keep_last: int | None = None) -> None:
    """The whole RL state of `step`: the trainer's (model, optimizer, schedule, RNG; every trainer rank writes
    its part through `trainer.command("save")`) and the controller's `rl_state` (JSON), then the checksums of
    every file. Written to iter_N.partial, renamed when complete, and only then named by the tracker; then
    `keep_last` (--keep-last-n-checkpoints) deletes older iterations (`prune_checkpoints`)."""
    final = iteration_dir(directory, step)
    partial = final + PARTIAL
    shutil.rmtree(partial, ignore_errors=True)
    trainer.command("save", partial)
    write_durably(os.path.join(partial, RL_STATE_FILE),
                  json.dumps({"format": RL_STATE_FORMAT, "step": step, **rl_state}))
    summary = write_checksums(partial, f"checkpoint step {step}: checksums")
    if summary["seconds"] >= 10:
        print(f"[megatron-rl] checkpoint step {step}: checksums of {summary['files']} files "
              f"({summary['bytes'] / 2**30:.1f} GiB) in {summary['seconds']:.0f} s", flush=True)
    failpoints.crash("checkpoint-partial", step)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    publish_tracker(directory, step)
    failpoints.crash("checkpoint-saved", step)
    if keep_last is not None:
        deleted = prune_checkpoints(directory, keep_last)
        if deleted:
            print(f"[megatron-rl] --keep-last-n-checkpoints {keep_last}: deleted "
                  f"{', '.join(os.path.basename(iteration_dir(directory, s)) for s in deleted)}", flush=True)


def prune_checkpoints(directory: str, keep_last: int) -> list[int]:
    """--keep-last-n-checkpoints: keep the newest `keep_last` complete iterations up to the tracker's (which is
    always kept), delete the other iterations up to it, oldest first, and the leftovers of crashed saves
    (`iter_N.partial`) and of interrupted deletions (`iter_N.deleting`). Complete: it has checksums.json, which a
    save writes last, so an iteration damaged by hand, or of an older format, does not count as one of the N.
    Each iteration is renamed to `iter_N.deleting` (atomic) before its files go, so a crash at any point leaves no
    half-deleted `iter_NNNNNNN`. Iterations newer than the tracker's (left by a run that resumed from an earlier
    one) are neither counted nor deleted: the run replaces them when it saves those steps. Returns the deleted
    steps."""
    latest = latest_checkpoint_step(directory, "--save")
    for name in sorted(os.listdir(directory)):
        if name.startswith("iter_") and name.endswith((PARTIAL, DELETING)):
            shutil.rmtree(os.path.join(directory, name))
    saved = [s for s in saved_iterations(directory) if s <= latest]
    complete = [s for s in saved if os.path.isfile(os.path.join(iteration_dir(directory, s), CHECKSUMS_FILE))]
    if latest not in complete:
        return []  # the tracker's iteration is not known to be complete: nothing is deleted
    doomed = [s for s in saved if s not in complete[-keep_last:]]
    for step in doomed:
        path = iteration_dir(directory, step)
        os.replace(path, path + DELETING)
        failpoints.crash("checkpoint-retention", step)
        shutil.rmtree(path + DELETING)
    return doomed


def load_rl_checkpoint(directory: str, trainer) -> dict:
    """Restore the trainer's state of the latest checkpoint (checked at start-up: its checksums are verified
    again here, which costs nothing when this process verified the same files then) and return the controller's."""
    step = latest_checkpoint_step(directory)
    state = read_rl_state(directory, step)
    verify_files(iteration_dir(directory, step), f"--load {directory!r}")
    trainer.command("load", iteration_dir(directory, step))
    return state


def resume_or_start(args, clean: bool = True) -> None:
    """--load DIR that holds no checkpoint yet (a job's first launch, or one killed before its first save completed)
    starts a new run: from --load-hf / --load-megatron's weights, or from the model's initialization when DIR is
    also --save (the same command then serves every launch of a job). `args.load` becomes None and, with `clean`,
    the leftovers of an interrupted save (`iter_N.partial`) are removed. Without either, it is an error naming both
    ways out. A DIR with a checkpoint is resumed; the initial weights' flags are then not read."""
    directory = args.load
    if not directory or saved_iterations(directory) or any(  # a resume, or the error latest_checkpoint_step gives
            os.path.isfile(os.path.join(directory, name)) for name in (TRACKER_FILE, META_FILE)):
        if directory and (args.load_hf or args.load_megatron) and is_first_process():
            flag = "--load-hf" if args.load_hf else "--load-megatron"
            print(f"[megatron-rl] --load {directory}: resuming its latest checkpoint; {flag} (the initial weights) "
                  "is not read", flush=True)
        return
    initial = "--load-hf" if args.load_hf else "--load-megatron" if args.load_megatron else None
    same = bool(args.save) and os.path.realpath(args.save) == os.path.realpath(directory)
    if initial is None and not same:
        raise ValueError(f"--load {directory!r}: no checkpoint to resume ({TRACKER_FILE}); to start a new run when "
                         "there is none, also pass the initial weights (--load-hf or --load-megatron) or --save "
                         "the same directory")
    leftovers = sorted(n for n in (os.listdir(directory) if os.path.isdir(directory) else [])
                       if n.startswith("iter_") and n.endswith((PARTIAL, DELETING)))
    if clean and is_first_process():
        for name in leftovers:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    if is_first_process():
        source = f"{initial} {args.load_hf or args.load_megatron}" if initial else "the model's initialization"
        removed = f"; removed {', '.join(leftovers)} (a save that did not complete)" if leftovers and clean else ""
        print(f"[megatron-rl] --load {directory}: no checkpoint yet, a new run from {source}{removed}", flush=True)
    args.load = None


def iteration_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"iter_{step:07d}")


def latest_checkpoint_step(directory: str, flag: str = "--load") -> int:
    tracker = os.path.join(directory, TRACKER_FILE)
    try:
        with open(tracker) as f:
            text = f.read().strip()
    except OSError:
        if os.path.isfile(os.path.join(directory, META_FILE)):
            raise ValueError(f"{flag} {directory!r}: no {TRACKER_FILE}: this is a Megatron checkpoint of weights "
                             f"only ({META_FILE}, no RL state to resume); start a new run from it with "
                             "--load-megatron") from None
        raise ValueError(f"{flag} {directory!r}: no {TRACKER_FILE} (not a checkpoint directory of this project)") \
            from None
    if not text.isdigit():
        raise ValueError(f"{flag} {directory!r}: {TRACKER_FILE} holds {text[:40]!r}, not a step number")
    return int(text)


def saved_iterations(directory: str) -> list[int]:
    """The steps of the complete iterations in an RL checkpoint directory: `iter_NNNNNNN` (an `iter_N.partial` one
    is being written, an `iter_N.deleting` one being deleted; neither is complete)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n[5:]) for n in names if n.startswith("iter_") and n[5:].isdigit())


def is_hf_directory(directory: str) -> bool:
    """An HF checkpoint (config.json), not Megatron weights (megatron_rl.json) nor an RL checkpoint (the tracker)."""
    return os.path.isfile(os.path.join(directory, "config.json")) and not any(
        os.path.isfile(os.path.join(directory, name)) for name in (META_FILE, TRACKER_FILE))


def weights_directory(directory: str, iteration: int | None = None, flag: str = "--load") -> str:
    """The directory whose `megatron_rl.json` describes the weights to read: in an RL checkpoint directory (the
    tracker, written by --save), the iteration `iteration` or else the latest; a Megatron checkpoint of weights
    (`megatron_rl.json`: tools/convert_hf_to_megatron.py's output, or one iteration of an RL checkpoint) is its
    own. An RL checkpoint's iteration is checked against its checksums.json (`verify_files`). Errors name
    `flag` (and --iteration), both kinds of directory, and what is missing or damaged."""
    if not os.path.isdir(directory):
        raise ValueError(f"{flag} {directory!r}: no such directory")
    if os.path.isfile(os.path.join(directory, TRACKER_FILE)):
        step = latest_checkpoint_step(directory, flag) if iteration is None else iteration
        path = iteration_dir(directory, step)
        if not os.path.isdir(path):
            saved = ", ".join(map(str, saved_iterations(directory))) or "none"
            which = f"--iteration {step}" if iteration is not None else f"{TRACKER_FILE} names step {step}, but"
            raise ValueError(f"{which}: {flag} {directory!r} has no {os.path.basename(path)} (saved iterations: "
                             f"{saved})")
        if not os.path.isfile(os.path.join(path, META_FILE)):
            raise ValueError(f"{flag} {directory!r}: {os.path.basename(path)} has no {META_FILE} (saved by a "
                             "megatron-rl version that did not describe the model beside its weights)")
        verify_files(path, f"{flag} {directory!r}")
        return path
    if os.path.isfile(os.path.join(directory, META_FILE)):
        if iteration is not None:
            raise ValueError(f"--iteration {iteration}: {flag} {directory!r} is a Megatron checkpoint of one set of "
                             f"weights ({META_FILE}), not an RL checkpoint with iterations; drop --iteration")
        if os.path.isfile(os.path.join(directory, CHECKSUMS_FILE)):  # one iteration of an RL checkpoint
            verify_files(directory, f"{flag} {directory!r}")
        return directory
    raise ValueError(f"{flag} {directory!r} is neither an RL checkpoint ({TRACKER_FILE} and iter_NNNNNNN/, "
                     f"written by --save) nor a Megatron checkpoint of weights ({META_FILE}, written by "
                     "tools/convert_hf_to_megatron.py or in each iteration of an RL checkpoint)")


def read_rl_state(directory: str, step: int) -> dict:
    path = os.path.join(iteration_dir(directory, step), RL_STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--load {directory!r}: cannot read {path} ({e})") from None
    if not isinstance(state, dict) or not {"step", "buffer", "inflight", "model"} <= set(state):
        raise ValueError(f"--load {directory!r}: {path} is not an RL state file of this project")
    if state.get("format") != RL_STATE_FORMAT:
        raise ValueError(f"--load {directory!r}: {path} has RL state format {state.get('format', 1)}, this version "
                         f"reads format {RL_STATE_FORMAT} (resume it with the megatron-rl version that wrote it, or "
                         "start a new run from its weights with --load-megatron)")
    return state


def is_first_process() -> bool:
    """Global rank 0 of a launch (or a process outside one): the one that hashes a checkpoint at start-up."""
    return os.environ.get("RANK", "0") == "0"


def verify_files(path: str, flag: str) -> None:
    """An iteration's files against its checksums.json (`checksums.verify_checksums`; errors start with `flag`):
    all their bytes on the first process, names and sizes on the others; a line says what it cost when it took a
    while."""
    summary = verify_checksums(path, flag, full=is_first_process())
    if summary["hashed"] and summary["seconds"] >= 1:
        print(f"[megatron-rl] {flag}: checksums of {summary['files']} files ({summary['bytes'] / 2**30:.1f} GiB) "
              f"verified in {summary['seconds']:.1f} s", flush=True)


def check_checkpoint(directory: str, spec: ModelSpec, transformer_impl: str, needs_reference: bool = False,
                     expert_model_parallel_size: int = 1, controlled_lag: int | None = None) -> int:
    """Everything that can be checked before any work: the tracker, the step's directory, the trainer's dist
    checkpoint metadata, the controller state (JSON) and its format, every file against its checksum (before
    anything but JSON is read), the dist checkpoint's index (`safe_load.check_index`), that the saved model and
    layer spec (whose parameter names the trainer's checkpoint uses) are this run's, that its expert parallelism
    is this run's (Megatron-Core gives expert parameters an optimizer of their own when EP > 1, and its state does
    not load into another EP), that its --controlled-lag is this run's (its held batches were collected for that
    lag), and (`needs_reference`: a KL penalty to the default reference) that the checkpoint saved the reference
    model. Returns the step."""
    step = latest_checkpoint_step(directory)
    path = iteration_dir(directory, step)
    if not os.path.isdir(path):
        raise ValueError(f"--load {directory!r}: {path} does not exist (the tracker names step {step})")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ValueError(f"--load {directory!r}: {os.path.basename(path)} is not a complete trainer checkpoint "
                         "(no metadata.json)")
    state = read_rl_state(directory, step)
    verify_files(path, f"--load {directory!r}")
    safe_load.check_index(path, f"--load {directory!r}")
    if state.get("transformer_impl") != transformer_impl:
        raise ValueError(f"--load {directory!r}: the checkpoint was saved with --transformer-impl "
                         f"{state.get('transformer_impl')}, this run uses {transformer_impl}")
    check_controlled_lag(directory, state, controlled_lag)
    saved = state["model"]
    for field, value in spec.weight_fields().items():
        if saved.get(field) != value:
            raise ValueError(f"--load {directory!r}: the saved model has {field} {saved.get(field)}, this run's is "
                             f"{value} (model {spec.name!r})")
    saved_ep = (read_meta(path, "--load").get("expert_model_parallel_size", 1)
                if os.path.isfile(os.path.join(path, META_FILE)) else 1)
    if spec.is_moe and saved_ep != expert_model_parallel_size:
        raise ValueError(f"--load {directory!r}: the checkpoint was saved with --expert-model-parallel-size "
                         f"{saved_ep}, this run uses {expert_model_parallel_size}; Megatron-Core's optimizer state "
                         "does not move between expert layouts: resume with the saved EP, or start a new run from "
                         "its weights (--load-megatron, any EP)")
    if needs_reference:
        check_has_reference(path)
    return step


def check_has_reference(directory: str) -> None:
    """A run whose reference is the policy RL started from can resume only from a checkpoint that saved it."""
    if not safe_load.load_common(directory).get(HAS_REFERENCE):
        raise ValueError(f"--load: checkpoint {directory!r} holds no reference model (it was saved without "
                         "--kl-coef), and the default reference, the policy as RL began, cannot be restored: pass "
                         "--ref-load, or resume with --kl-coef 0")


def check_controlled_lag(directory: str, state: dict, controlled_lag: int | None) -> None:
    """A resume keeps the run's --controlled-lag: the checkpoint holds the batches collected for its lag (none
    without the flag), and another lag would train them at the wrong one."""
    saved = state.get("controlled_lag")
    if saved != controlled_lag:
        then, now = ("no --controlled-lag" if lag is None else f"--controlled-lag {lag}"
                     for lag in (saved, controlled_lag))
        raise ValueError(f"--load {directory!r}: the checkpoint was saved with {then}, this run has {now}; resume "
                         "with the saved one (or start a new run from its weights with --load-megatron)")


def check_initial_weights(directory: str, spec: ModelSpec, transformer_impl: str,
                          flag: str = "--load-megatron") -> str:
    """The start-up check of a run's initial weights from a Megatron checkpoint (of weights, or an RL checkpoint's
    latest iteration): the model in it is this run's, its files are there, and a distributed checkpoint (whose
    keys follow the layer spec) was saved with this run's --transformer-impl. Returns the weights' directory."""
    path = weights_directory(directory, flag=flag)
    meta = read_meta(path, flag)
    try:
        saved = ModelSpec.from_hf_config(meta["hf_config"]).weight_fields()
    except ValueError as e:
        raise ValueError(f"{flag} {directory!r}: {META_FILE}'s hf_config: {e}") from None
    for field, value in spec.weight_fields().items():
        if saved.get(field) != value:
            raise ValueError(f"{flag} {directory!r}: the checkpoint's model has {field} {saved.get(field)}, this "
                             f"run's is {value} (model {spec.name!r})")
    if meta["format"] in DIST_CHECKPOINTS:
        saved_impl = meta.get("transformer_impl", "local")
        if saved_impl != transformer_impl:
            raise ValueError(f"{flag} {directory!r}: the checkpoint was saved with --transformer-impl {saved_impl}, "
                             f"this run uses {transformer_impl}")
        dist_dir = os.path.join(path, DIST_CHECKPOINTS[meta["format"]][0])
        if not os.path.isfile(os.path.join(dist_dir, "metadata.json")):
            raise ValueError(f"{flag} {directory!r}: {dist_dir} is not a complete distributed checkpoint "
                             "(no metadata.json)")
        safe_load.check_index(dist_dir, f"{flag} {directory!r}")
    else:
        try:
            MegatronCheckpoint(path, flag)  # reads each rank file's header: a missing or foreign file fails here
        except (FileNotFoundError, KeyError) as e:
            raise ValueError(f"{flag} {directory!r}: {e}") from None
    return path


def check_reference_checkpoint(directory: str, spec: ModelSpec, transformer_impl: str) -> None:
    """Everything about --ref-load that can be checked before any weight exists: the directory holds an HF
    checkpoint (config.json and every tensor of the model, right shapes) or Megatron weights that --load-megatron
    would accept (converter output of either format, an RL checkpoint or one of its iterations), of the same
    architecture as the policy. Errors name the flag."""
    if not os.path.isdir(directory):
        raise ValueError(f"--ref-load {directory!r}: no such directory")
    if not is_hf_directory(directory):
        check_initial_weights(directory, spec, transformer_impl, flag="--ref-load")
        return
    try:
        ckpt = HFCheckpoint(directory)
        ref_spec = ModelSpec.from_hf_config(ckpt.config)
        validate_hf_checkpoint(ref_spec, ckpt)
    except (OSError, KeyError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"--ref-load {directory!r}: {e}") from None
    for field, value in spec.weight_fields().items():
        if getattr(ref_spec, field) != value:
            raise ValueError(f"--ref-load {directory!r}: the reference model has {field} {getattr(ref_spec, field)}, "
                             f"the policy's is {value} (model {spec.name!r})")


def write_durably(path: str, text: str) -> None:
    """Write `text` to `path` atomically: a crash leaves the old file or the new one, never a torn one."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def publish_tracker(directory: str, step: int) -> None:
    write_durably(os.path.join(directory, TRACKER_FILE), str(step))


def rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, "rng", f"rank{rank:05d}.pt")


def rng_state() -> dict:
    """This rank's RNG states (torch, Python's random, numpy's global one, and the device's), as tensors and
    plain Python values only, so that `load_rng` reads them with `torch.load(weights_only=True)`."""
    version, mt, gauss_next = random.getstate()
    _, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "state": list(mt), "gauss_next": gauss_next},
             "numpy": {"key": [int(k) for k in key], "pos": int(pos), "has_gauss": int(has_gauss),
                       "cached_gaussian": float(cached_gaussian)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device (Megatron's tracker forks from it)
    return state


def save_rng(directory: str, rank: int, state: dict | None = None) -> None:
    """Write `state` (by default this rank's `rng_state()` now) as this rank's RNG file of `directory`."""
    os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
    torch.save(rng_state() if state is None else state, rng_file(directory, rank))


def load_rng(directory: str, rank: int) -> None:
    """Restore this rank's RNG states, read weights-only (a file that holds anything but tensors and plain values
    is refused without running it); a rank the checkpoint has none for (more ranks than were saved) keeps its own
    seeded state."""
    path = rng_file(directory, rank)
    if not os.path.isfile(path):
        return
    try:
        state = torch.load(path, weights_only=True)
        python, numpy = state["python"], state["numpy"]
        python_state = (python["version"], tuple(python["state"]), python["gauss_next"])
        numpy_state = ("MT19937", np.array(numpy["key"], dtype=np.uint32), numpy["pos"], numpy["has_gauss"],
                       numpy["cached_gaussian"])
    except Exception as e:  # whatever the file holds, the error names it
        raise ValueError(f"--load: {path} is not an RNG state file of RL state format {RL_STATE_FORMAT} "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); refused") from None
    torch.set_rng_state(state["torch"])
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def truncate_logs_to_checkpoint(load: str, output_dir: str) -> None:
    """On a resume the run's logs continue from the checkpoint's step: lines of later (lost) steps are dropped."""
    step = latest_checkpoint_step(load)
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        truncate_jsonl_after_step(os.path.join(output_dir, name), step)


def truncate_jsonl_after_step(path: str, step: int) -> None:
    """Keep the lines of a JSONL log up to `step` (a torn last line is dropped); atomic."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
