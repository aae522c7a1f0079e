"""Streaming safetensors I/O: write a file tensor by tensor, and read slices of HF checkpoints lazily.

`safetensors.torch.save_file` needs every tensor in memory at once; the writer here lays out the header
from (name, shape, dtype) first and then writes each tensor as it is produced, so converting a checkpoint
holds one tensor at a time. Reading uses `safe_open(...).get_slice`, which reads only the requested rows.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import torch
from safetensors import safe_open

from megatron_rl.models.layout import Segment

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
}
_NAMES = {v: k for k, v in _DTYPES.items()}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def dtype_from_name(name: str) -> torch.dtype:
    return _NAMES[name]


def write_streaming(path: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                    produce: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None,
                    on_tensor: Callable[[str], None] | None = None) -> int:
    """Write `entries` (name, shape, dtype) to a safetensors file, calling `produce(name)` one tensor at a
    time in order. Returns bytes of tensor data written. Raises if a produced tensor does not match."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape, dtype in entries:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section is 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape, dtype in entries:
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"tensor {name!r}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {tuple(shape)} {dtype}")
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
            if on_tensor:
                on_tensor(name)
    return offset


class HFCheckpoint:
    """A HuggingFace checkpoint directory (one or several .safetensors files), read lazily by slice."""

    def __init__(self, directory: str):
        self.directory = directory
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"--hf-dir {directory!r} is not a directory")
        config_path = os.path.join(directory, "config.json")
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"{config_path} is missing")
        with open(config_path) as f:
            self.config = json.load(f)
        files = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors weight files in {directory!r} (.bin checkpoints are not read)")
        self._file_of: dict[str, str] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name in files:
            path = os.path.join(directory, name)
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    self._file_of[key] = path
                    self._meta[key] = (tuple(sl.get_shape()), dtype_from_name(sl.get_dtype()))
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def _handle(self, name: str):
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, "pt")
        return self._handles[path]

    def get_slice(self, seg: Segment, dim: int) -> torch.Tensor:
        if seg.hf_name not in self._meta:
            raise KeyError(f"HF tensor {seg.hf_name!r} is missing from {self.directory!r}")
        sl = self._handle(seg.hf_name).get_slice(seg.hf_name)
        if len(self.shape(seg.hf_name)) == 1 or dim == 0:
            return sl[seg.start:seg.stop]
        return sl[:, seg.start:seg.stop]

    def read(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def auxiliary_files(directory: str) -> Iterable[str]:
    """Files of a checkpoint that are not weights (tokenizer, generation config, ...)."""
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES) and name not in (
            "config.json", "model.safetensors.index.json", "megatron_rl.json"):
            yield name
