"""Prompt datasets (--prompt-data): a JSONL or parquet file of records, served in a seeded, resumable order.

Every record is checked and normalized when the dataset opens (`records.normalize`; ids must be unique), so a
bad record fails the run at start, naming its file, line or row, and field. Records are then read on demand in
a seeded order that is reshuffled each epoch. The read position is a small cursor (epoch, position) that
checkpoints save and resumes restore, so every prompt is consumed exactly once per epoch across restarts.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from megatron_rl.data.readers import open_reader
from megatron_rl.data.records import RecordFields, normalize


@dataclasses.dataclass
class Cursor:
    epoch: int = 0
    position: int = 0


class PromptDataset:
    def __init__(self, path: str, seed: int = 0, shuffle: bool = True, fields: RecordFields = RecordFields()):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--prompt-data {path!r}: no such file")
        self.path, self.seed, self.shuffle, self.fields = path, seed, shuffle, fields
        self.reader = open_reader(path, fields.columns())
        if not len(self.reader):
            raise ValueError(f"{path}: no records")
        # Where the first prompt given as a message list is (None if all are strings): such prompts need a chat
        # template, which the caller checks against its flags.
        self.first_message_prompt: str | None = None
        self._validate()
        self.cursor = Cursor()
        self._order = self._permutation(0)

    def _validate(self) -> None:
        seen: dict[str, str] = {}
        for index, (where, raw) in enumerate(self.reader.rows()):
            record = normalize(raw, where, index, self.fields)
            if record["id"] in seen:
                raise ValueError(f"{where}: field 'id' {record['id']!r} repeats the id at {seen[record['id']]}")
            seen[record["id"]] = where
            if self.first_message_prompt is None and isinstance(record["prompt"], list):
                self.first_message_prompt = where

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.reader)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __len__(self) -> int:
        return len(self.reader)

    def record(self, index: int) -> dict:
        """Record `index` of the file: {"id", "prompt", "answer", "metadata"}."""
        where, raw = self.reader.read(index)
        return normalize(raw, where, index, self.fields)

    def next(self, count: int) -> list[dict]:
        """The next `count` records in order, advancing the cursor (crossing epochs as needed)."""
        out = []
        for _ in range(count):
            if self.cursor.position == len(self):
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
                self._order = self._permutation(self.cursor.epoch)
            out.append(self.record(int(self._order[self.cursor.position])))
            self.cursor.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.cursor.epoch, "position": self.cursor.position, "seed": self.seed, "records": len(self)}

    def load_state_dict(self, state: dict) -> None:
        for field in ("epoch", "position", "seed", "records"):
            if field not in state:
                raise ValueError(f"data cursor state: field {field!r} is missing")
        if state["records"] != len(self) or state["seed"] != self.seed:
            raise ValueError(f"data cursor was saved for {state['records']} records with seed {state['seed']}; "
                             f"{self.path} has {len(self)} records and --seed is {self.seed}")
        self.cursor = Cursor(state["epoch"], state["position"])
        self._order = self._permutation(self.cursor.epoch)
