"""The RL checkpoint directory (Megatron's layout): `iter_NNNNNNN/` per saved step, holding the trainer's
dist checkpoint, per-rank RNG states (`rng/rankNNNNN.pt`) and the controller's `rl_state.json`, and the tracker
`latest_checkpointed_iteration.txt`, which moves last, so a crash at any point of a save leaves the previous
checkpoint the latest. Also: the start-up check of a `--load` directory, cutting the run's JSONL logs back to
the resumed step."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch

from megatron_rl import failpoints
from megatron_rl.models.spec import ModelSpec

TRACKER_FILE, RL_STATE_FILE = "latest_checkpointed_iteration.txt", "rl_state.json"
# 2: the controller's whole state in rl_state.json, rollouts as {output, meta, reward}, the trainer's layer spec.
RL_STATE_FORMAT = 2


def save_rl_checkpoint(directory: str, step: int, trainer, rl_state: dict) -> None:
    """The whole RL state of `step`: the trainer's (model, optimizer, schedule, RNG; every trainer rank writes
    its part through `trainer.command("save")`) and the controller's `rl_state` (JSON). Written to
    iter_N.partial, renamed when complete, and only then named by the tracker."""
    final = iteration_dir(directory, step)
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    trainer.command("save", partial)
    write_durably(os.path.join(partial, RL_STATE_FILE),
                  json.dumps({"format": RL_STATE_FORMAT, "step": step, **rl_state}))
    failpoints.crash("checkpoint-partial", step)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    publish_tracker(directory, step)
    failpoints.crash("checkpoint-saved", step)


def load_rl_checkpoint(directory: str, trainer) -> dict:
    """Restore the trainer's state of the latest checkpoint (checked at start-up) and return the controller's."""
    step = latest_checkpoint_step(directory)
    state = read_rl_state(directory, step)
    trainer.command("load", iteration_dir(directory, step))
    return state


def iteration_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"iter_{step:07d}")


def latest_checkpoint_step(directory: str) -> int:
    tracker = os.path.join(directory, TRACKER_FILE)
    try:
        with open(tracker) as f:
            text = f.read().strip()
    except OSError:
        raise ValueError(f"--load {directory!r}: no {TRACKER_FILE} (not a checkpoint directory of this project)") \
            from None
    if not text.isdigit():
        raise ValueError(f"--load {directory!r}: {TRACKER_FILE} holds {text[:40]!r}, not a step number")
    return int(text)


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
                         "start a new run from its weights)")
    return state


def check_checkpoint(directory: str, spec: ModelSpec, transformer_impl: str, needs_reference: bool = False) -> int:
    """Everything that can be checked before any work: the tracker, the step's directory, the trainer's dist
    checkpoint metadata, the controller state, that the saved model and layer spec (whose parameter names
    the trainer's checkpoint uses) are this run's, and (`needs_reference`: a KL penalty to the default reference)
    that the checkpoint saved the reference model. Returns the step."""
    step = latest_checkpoint_step(directory)
    path = iteration_dir(directory, step)
    if not os.path.isdir(path):
        raise ValueError(f"--load {directory!r}: {path} does not exist (the tracker names step {step})")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ValueError(f"--load {directory!r}: {os.path.basename(path)} is not a complete trainer checkpoint "
                         "(no metadata.json)")
    state = read_rl_state(directory, step)
    if state.get("transformer_impl") != transformer_impl:
        raise ValueError(f"--load {directory!r}: the checkpoint was saved with --transformer-impl "
                         f"{state.get('transformer_impl')}, this run uses {transformer_impl}")
    saved = state["model"]
    for field, value in spec.weight_fields().items():
        if saved.get(field) != value:
            raise ValueError(f"--load {directory!r}: the saved model has {field} {saved.get(field)}, this run's is "
                             f"{value} (model {spec.name!r})")
    if needs_reference:
        from megatron_rl.trainer.checkpoint import check_has_reference

        check_has_reference(path)
    return step


def write_durably(path: str, text: str) -> None:
    """Write `text` to `path` atomically: a crash leaves the old file or the new one, never a torn one."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def publish_tracker(directory: str, step: int) -> None:
    write_durably(os.path.join(directory, TRACKER_FILE), str(step))


def save_rng(directory: str, rank: int) -> None:
    os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device (Megatron's tracker forks from it)
    torch.save(state, os.path.join(directory, "rng", f"rank{rank:05d}.pt"))


def load_rng(directory: str, rank: int) -> None:
    """Restore this rank's RNG states; a rank the checkpoint has none for (more ranks than were saved) keeps its
    own seeded state."""
    path = os.path.join(directory, "rng", f"rank{rank:05d}.pt")
    if os.path.isfile(path):
        state = torch.load(path, weights_only=False)
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
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
