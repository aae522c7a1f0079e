"""Raw records of a prompt file, by format: JSONL (.jsonl, .json: one JSON object per line) or parquet.

Both readers give `len(reader)`, `rows()` (every raw record in file order, with where it is) and `read(i)` (the
i-th record, on demand). The JSONL reader keeps only the byte offset and line number of each record and reads a
line when it is asked for. The parquet reader reads the columns it needs into memory once, as an Arrow table
(columnar and compact); a row becomes Python objects only when it is read. Errors name a JSONL record by its
line ("path:7") and a parquet record by its row, counted from 0 ("path:row 6").
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def file_format(path: str, flag: str = "--prompt-data") -> str:
    """'jsonl' or 'parquet', by the extension of `path` (`flag` names the file in errors)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"{flag} {path!r}: unknown extension {ext!r}; use one of {sorted(FORMATS)}")
    return FORMATS[ext]


def open_reader(path: str, columns: list[str]):
    """The reader of `path`; `columns`: the fields a record needs (parquet reads only those, and "id")."""
    return JsonlReader(path) if file_format(path) == "jsonl" else ParquetReader(path, columns)


class JsonlReader:
    def __init__(self, path: str):
        self.path = path
        offsets, lines = [], []
        with open(path, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    offsets.append(offset)
                    lines.append(lineno)
                offset += len(raw)
        self.offsets, self.lines = np.array(offsets, dtype=np.int64), np.array(lines, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, index: int) -> str:
        return f"{self.path}:{self.lines[index]}"

    def rows(self) -> Iterator[tuple[str, object]]:
        with open(self.path, "rb") as f:
            for index, offset in enumerate(self.offsets):
                f.seek(offset)
                yield self.where(index), self._parse(f.readline(), index)

    def read(self, index: int) -> tuple[str, object]:
        with open(self.path, "rb") as f:
            f.seek(self.offsets[index])
            return self.where(index), self._parse(f.readline(), index)

    def _parse(self, raw: bytes, index: int):
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.where(index)}: invalid JSON ({e})") from None


class ParquetReader:
    def __init__(self, path: str, columns: list[str]):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path = path
        try:
            schema = pq.read_schema(path)
            missing = [c for c in columns if c not in schema.names]
            if missing:
                raise ValueError(f"{path}: field {missing[0]!r} is missing (the file's columns: {schema.names})")
            wanted = columns + (["id"] if "id" in schema.names and "id" not in columns else [])
            self.table = pq.read_table(path, columns=wanted)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: not a readable parquet file ({e})") from None
        # A map column reads as a list of (key, value) pairs; a record's metadata is an object.
        self._maps = [f.name for f in self.table.schema if pa.types.is_map(f.type)]

    def __len__(self) -> int:
        return self.table.num_rows

    def where(self, index: int) -> str:
        return f"{self.path}:row {index}"

    def rows(self) -> Iterator[tuple[str, object]]:
        index = 0
        for batch in self.table.to_batches():
            for row in batch.to_pylist():
                yield self.where(index), self._objects(row)
                index += 1

    def read(self, index: int) -> tuple[str, object]:
        return self.where(index), self._objects(self.table.slice(index, 1).to_pylist()[0])

    def _objects(self, row: dict) -> dict:
        for name in self._maps:
            if row[name] is not None:
                row[name] = dict(row[name])
        return row
