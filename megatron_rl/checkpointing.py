"""The RL checkpoint directory (Megatron's layout): `iter_NNNNNNN/` per saved step, holding the trainer's
dist checkpoint, per-rank RNG states and the controller's `rl_state.json`, and the tracker
`latest_checkpointed_iteration.txt`, which moves last, so a crash at any point of a save leaves the previous
checkpoint the latest. Also: the start-up check of a `--load` directory, and cutting the run's JSONL logs
back to the resumed step."""

from __future__ import annotations

import json
import os

from megatron_rl.models.spec import ModelSpec

TRACKER_FILE, RL_STATE_FILE = "latest_checkpointed_iteration.txt", "rl_state.json"
MODEL_FIELDS = ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "ffn_hidden_size", "vocab_size", "tie_word_embeddings", "qkv_bias")


def iteration_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"iter_{step:07d}")


def model_fields(spec: ModelSpec) -> dict:
    return {field: getattr(spec, field) for field in MODEL_FIELDS}


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
    return state


def check_checkpoint(directory: str, spec: ModelSpec) -> int:
    """Everything that can be checked before any work: the tracker, the step's directory, the trainer's dist
    checkpoint metadata, the controller state, and that the saved model is this run's. Returns the step."""
    step = latest_checkpoint_step(directory)
    path = iteration_dir(directory, step)
    if not os.path.isdir(path):
        raise ValueError(f"--load {directory!r}: {path} does not exist (the tracker names step {step})")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ValueError(f"--load {directory!r}: {os.path.basename(path)} is not a complete trainer checkpoint "
                         "(no metadata.json)")
    saved = read_rl_state(directory, step)["model"]
    for field, value in model_fields(spec).items():
        if saved.get(field) != value:
            raise ValueError(f"--load {directory!r}: the saved model has {field} {saved.get(field)}, this run's is "
                             f"{value} (model {spec.name!r})")
    return step


def write_json_durably(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def publish_tracker(directory: str, step: int) -> None:
    tracker = os.path.join(directory, TRACKER_FILE)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker + ".tmp", tracker)


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
