"""JSONL prompt datasets: {"prompt": ..., "answer": ...} per line, plus optional fields kept as they are.

The file is validated and indexed once (byte offset of each record; records are not held in memory), then
read lazily in a seeded order that is reshuffled each epoch. The read position is a small cursor
(epoch, position) that checkpoints save and resumes restore, so every prompt is consumed exactly once per
epoch across restarts.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

REQUIRED_FIELDS = ("prompt", "answer")


@dataclasses.dataclass
class Cursor:
    epoch: int = 0
    position: int = 0


class JsonlDataset:
    def __init__(self, path: str, seed: int = 0, shuffle: bool = True):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--data-path {path!r}: no such file")
        self.path, self.seed, self.shuffle = path, seed, shuffle
        self.offsets = self._index()
        if not self.offsets:
            raise ValueError(f"{path}: no records")
        self.cursor = Cursor()
        self._order = self._permutation(0)

    def _index(self) -> list[int]:
        offsets = []
        with open(self.path, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    _parse(raw, self.path, lineno)
                    offsets.append(offset)
                offset += len(raw)
        return offsets

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.offsets)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __len__(self) -> int:
        return len(self.offsets)

    def record(self, index: int) -> dict:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[index])
            record = _parse(f.readline(), self.path, None)
        record.setdefault("id", index)
        return record

    def next(self, count: int) -> list[dict]:
        """The next `count` records in order, advancing the cursor (crossing epochs as needed)."""
        out = []
        for _ in range(count):
            if self.cursor.position == len(self.offsets):
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
                self._order = self._permutation(self.cursor.epoch)
            out.append(self.record(int(self._order[self.cursor.position])))
            self.cursor.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.cursor.epoch, "position": self.cursor.position, "seed": self.seed,
                "records": len(self.offsets)}

    def load_state_dict(self, state: dict) -> None:
        for field in ("epoch", "position", "seed", "records"):
            if field not in state:
                raise ValueError(f"data cursor state: field {field!r} is missing")
        if state["records"] != len(self.offsets) or state["seed"] != self.seed:
            raise ValueError(f"data cursor was saved for {state['records']} records with seed {state['seed']}; "
                             f"{self.path} has {len(self.offsets)} records and --seed is {self.seed}")
        self.cursor = Cursor(state["epoch"], state["position"])
        self._order = self._permutation(self.cursor.epoch)


def _parse(raw: bytes, path: str, lineno: int | None) -> dict:
    where = f"{path}:{lineno}" if lineno else path
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    for field in REQUIRED_FIELDS:
        if field not in record:
            raise ValueError(f"{where}: field {field!r} is missing")
        if not isinstance(record[field], str):
            raise ValueError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")
    if not record["prompt"].strip():
        raise ValueError(f"{where}: field 'prompt' is empty")
    return record
