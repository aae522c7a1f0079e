"""Reading Megatron-Core distributed checkpoints (the trainer's, in each RL iteration, and the converter's
torch_dist format) without running code from them.

What such a checkpoint holds, and how megatron-core 0.16.1 and torch 2.13 read it:

- `metadata.json`: JSON (Megatron's description of the format).
- `common.pt` (plain state: scheduler, optimizer param groups, our `extra`): `torch.load` with torch's default,
  `weights_only=True` since torch 2.6 (unless the environment sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD).
- `__R_T.distcp`: tensor bytes, read with `torch.load(weights_only=True)`, and the sharded objects Megatron packs
  beside them (here the layers' `_extra_state`), read by torch's `DefaultLoadPlanner.load_bytes` with
  `torch.load(weights_only=False)`: any pickled callable would run.
- `.metadata`: torch.distributed.checkpoint's index of the `.distcp` files, read by
  `FileSystemReader.read_metadata` with a plain `pickle.load`: any global it names is imported and may be called.

Neither Megatron nor torch takes an argument for the last two, so `dist_load` and `load_common` (1) force
`weights_only=True` on every `torch.load` during the load, through torch's documented environment variable
TORCH_FORCE_WEIGHTS_ONLY_LOAD, which overrides a call's explicit `weights_only=False` (Megatron registers the few
classes its own files need with `torch.serialization.add_safe_globals` when it is imported); and (2) unpickle
`.metadata` first with an unpickler that resolves only the classes torch's checkpoint index is made of (the
"restricting globals" recipe of Python's pickle documentation) and sets no attribute of a class or function. A
`.metadata` that names anything else is refused before torch reads it; one that passes does in torch's
`pickle.load` only what it did in the check (the globals it resolves are the only code an unpickling runs), that
is build torch's index objects. `.metadata` thus remains the one file read with
`pickle.load`, after that check (and, on a resume, after its checksum: `checksums`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
import os
import pickle

import torch

METADATA_FILE = ".metadata"  # torch.distributed.checkpoint.filesystem's index file
FORCE_WEIGHTS_ONLY, FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


def _index_classes() -> dict[str, set[str]]:
    """The globals a torch.distributed.checkpoint index may name: the dataclasses and enums of its metadata and
    planner modules, its storage record, torch.Size, dtypes and layouts (by name), OrderedDict, and the path
    classes of a checkpoint id (torch's own `dcp.save` records one)."""
    import torch.distributed.checkpoint.metadata as metadata
    import torch.distributed.checkpoint.planner as planner

    allowed = {m.__name__: {n for n, v in vars(m).items() if inspect.isclass(v) and v.__module__ == m.__name__
                            and (dataclasses.is_dataclass(v) or issubclass(v, enum.Enum))}
               for m in (metadata, planner)}
    allowed["torch.distributed.checkpoint.filesystem"] = {"_StorageInfo"}
    allowed["torch.serialization"] = {"_get_layout"}  # looks a layout up by name among torch's
    allowed["torch"] = {"Size"} | {n for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    allowed["collections"] = {"OrderedDict"}
    allowed["pathlib"] = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}
    return allowed


class _IndexUnpickler(pickle._Unpickler):
    """Python's own unpickler (the pure-Python one, whose opcodes can be overridden), resolving only `allowed`
    globals and refusing to set attributes on a class or a function (BUILD on them), so that an index that
    passes has built data objects and changed nothing else."""

    allowed: dict[str, set[str]] = {}
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if name not in self.allowed.get(module, ()):
            raise pickle.UnpicklingError(f"it names {module}.{name}")
        return super().find_class(module, name)

    def load_build(self):
        target = self.stack[-2]
        if isinstance(target, type) or inspect.isroutine(target):
            raise pickle.UnpicklingError(f"it sets attributes of {target!r}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def check_index(directory: str, flag: str) -> None:
    """Unpickle `directory`/.metadata resolving only the classes of torch's checkpoint index; a file that names
    any other global is refused (ValueError naming `flag` and the file) before anything runs it. A directory
    without the file is left to the load's own error."""
    path = os.path.join(directory, METADATA_FILE)
    if not os.path.isfile(path):
        return
    _IndexUnpickler.allowed = _IndexUnpickler.allowed or _index_classes()
    try:
        with open(path, "rb") as f:
            _IndexUnpickler(f).load()
    except Exception as e:  # any damage: truncation, a foreign global, a bad opcode
        raise ValueError(f"{flag}: {path} is not a torch.distributed.checkpoint index that can be read safely "
                         f"({type(e).__name__}: {e}); refused without unpickling it") from None


@contextlib.contextmanager
def weights_only_loads():
    """Every `torch.load` in the block uses `weights_only=True`, even one that asks for `weights_only=False`
    (TORCH_FORCE_WEIGHTS_ONLY_LOAD, read by torch at each call)."""
    saved = {k: os.environ.get(k) for k in (FORCE_WEIGHTS_ONLY, FORCE_NO_WEIGHTS_ONLY)}
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    os.environ.pop(FORCE_NO_WEIGHTS_ONLY, None)  # both set is an error in torch
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def dist_load(sharded_state_dict: dict, directory: str, flag: str = "--load") -> dict:
    """`megatron.core.dist_checkpointing.load`, with the index checked first and every torch.load weights-only.
    Collective, as Megatron's."""
    from megatron.core import dist_checkpointing

    check_index(directory, flag)
    with weights_only_loads():
        return dist_checkpointing.load(sharded_state_dict, directory)


def load_common(directory: str) -> dict:
    """The common (non-sharded) state of a distributed checkpoint (`common.pt`), weights-only."""
    from megatron.core import dist_checkpointing

    with weights_only_loads():
        return dist_checkpointing.load_common_state_dict(directory)
