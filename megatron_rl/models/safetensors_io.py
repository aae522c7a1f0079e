"""Streaming safetensors I/O: write a file tensor by tensor, and read slices of HF checkpoints lazily.

`safetensors.torch.save_file` needs every tensor in memory at once; the writer here lays out the header
from (name, shape, dtype) first and then writes each tensor as it is produced, so converting a checkpoint
holds one tensor at a time. Reading uses positioned reads of just the requested rows (no mmap, whose pages
would stay resident while a handle is open).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import torch

from megatron_rl.models import weight_map
from megatron_rl.models.spec import ModelSpec
from megatron_rl.models.weight_map import Segment

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
            if tensor.numel():
                f.write(tensor.detach().contiguous().view(torch.uint8).numpy().data)
            if on_tensor:
                on_tensor(name)
    return offset


class SafetensorsFile:
    """Reads tensors or row/column ranges of a .safetensors file with positioned reads (no mmap), so
    that what was read is freed when the caller drops it: converting stays at one tensor in memory."""

    _CHUNK_BYTES = 64 * 2**20

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        self.entries = {
            name: (tuple(e["shape"]), dtype_from_name(e["dtype"]), e["data_offsets"][0]) for name, e in header.items()
        }

    def keys(self) -> list[str]:
        return list(self.entries)

    def _read(self, fd: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = torch.Size(shape).numel()
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], self._data_start + offset + got)
            if n <= 0:
                raise OSError(f"{self.path}: file ends before the data of a tensor")
            got += n
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, restricted to [start, stop) along `dim` (0 or 1)."""
        shape, dtype, offset = self.entries[name]
        stop = shape[dim] if stop is None else stop
        itemsize = torch.empty((), dtype=dtype).element_size()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if dim == 0 or len(shape) == 1:
                row = torch.Size(shape[1:]).numel() * itemsize
                return self._read(fd, offset + start * row, (stop - start, *shape[1:]), dtype)
            # Columns [start, stop) of a 2-D tensor: read whole rows in bounded chunks and keep the columns.
            rows, cols = shape
            out = torch.empty((rows, stop - start), dtype=dtype)
            step = max(1, self._CHUNK_BYTES // (cols * itemsize))
            for r in range(0, rows, step):
                block = self._read(fd, offset + r * cols * itemsize, (min(step, rows - r), cols), dtype)
                out[r:r + block.shape[0]] = block[:, start:stop]
            return out
        finally:
            os.close(fd)


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
        self._file_of: dict[str, SafetensorsFile] = {}
        for name in files:
            st = SafetensorsFile(os.path.join(directory, name))
            for key in st.keys():  # noqa: SIM118 - SafetensorsFile is not iterable
                self._file_of[key] = st

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file_of[name].entries[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._file_of[name].entries[name][1]

    def get_slice(self, seg: Segment, dim: int) -> torch.Tensor:
        if seg.hf_name not in self._file_of:
            raise KeyError(f"HF tensor {seg.hf_name!r} is missing from {self.directory!r}")
        return self._file_of[seg.hf_name].read(seg.hf_name, dim, seg.start, seg.stop)

    def read(self, name: str) -> torch.Tensor:
        return self._file_of[name].read(name)


def auxiliary_files(directory: str) -> Iterable[str]:
    """Files of a checkpoint that are not weights (tokenizer, generation config, ...)."""
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES) and name not in (
            "config.json", "model.safetensors.index.json", "megatron_rl.json"):
            yield name


def validate_hf_checkpoint(spec: ModelSpec, ckpt: HFCheckpoint) -> torch.dtype:
    """Every tensor the spec needs is present with the right shape, and there is nothing unexplained.
    Returns the checkpoint's dtype."""
    expected = weight_map.hf_shapes(spec)
    present = set(ckpt.keys())
    if spec.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints still store the alias
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(f"HF checkpoint {ckpt.directory!r} is missing tensor {missing[0]!r}"
                         f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    unexpected = sorted(n for n in present - set(expected) if not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ValueError(f"HF checkpoint {ckpt.directory!r} has tensor {unexpected[0]!r} that model "
                         f"{spec.name!r} does not use")
    for name, shape in expected.items():
        if ckpt.shape(name) != shape:
            raise ValueError(f"HF tensor {name!r} has shape {ckpt.shape(name)}, config.json implies {shape}")
    dtypes = {ckpt.dtype(n) for n in expected}
    if len(dtypes) != 1:
        raise ValueError(f"HF checkpoint mixes dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()
