"""HF <-> Megatron checkpoint conversion, streamed tensor by tensor through `models.weight_map`: the engine of
tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py, and of the trainer's HF export.

HF -> Megatron writes a Megatron checkpoint of weights (`checkpoint.megatron_format`: per-rank safetensors files,
or Megatron-Core's distributed checkpoint written by real trainer ranks); Megatron -> HF reads any of its formats
through `MegatronCheckpoint` and writes HF safetensors shards. Directories are written under a temporary name and
renamed when complete: an interrupted conversion never leaves a directory that looks valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch

from megatron_rl.checkpoint.megatron_format import FORMATS, MegatronCheckpoint, rank_files, weights_layout, write_meta
from megatron_rl.models import weight_map
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.safetensors_io import HFCheckpoint, auxiliary_files, validate_hf_checkpoint, write_streaming
from megatron_rl.models.spec import ModelSpec


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, dynamic_ncols=True)


@contextlib.contextmanager
def atomic_directory(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary sibling directory that becomes `path` only if the block completes."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"--save {path!r} already exists (pass --overwrite to replace it)")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".partial-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
        os.replace(path, os.path.join(old, "x"))
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


# ---- HF -> Megatron --------------------------------------------------------------------------------------------

def hf_to_megatron(hf_dir: str, save: str, layout: TrainerLayout = TrainerLayout(),
                   megatron_format: str = "safetensors", overwrite: bool = False, progress: bool = True) -> dict:
    """Write `hf_dir` as a Megatron checkpoint of `layout` (its data-parallel size is replaced by the DP ranks its
    experts span)."""
    if megatron_format not in FORMATS:
        raise ValueError(f"--megatron-format {megatron_format!r}: choose one of {FORMATS}")
    ckpt = HFCheckpoint(hf_dir)
    spec = ModelSpec.from_hf_config(ckpt.config, name=os.path.basename(os.path.normpath(hf_dir)))
    layout = weights_layout(layout)
    layout.validate(spec)
    dtype = validate_hf_checkpoint(spec, ckpt)
    with atomic_directory(save, overwrite) as out:
        if megatron_format == "safetensors":
            _write_rank_files(spec, layout, ckpt.get_slice, dtype, out, progress)
        else:
            from megatron_rl.runtime.spawn import run_on_ranks

            run_on_ranks(_save_torch_dist_rank, layout.world_size, spec, layout,
                         hf_dir, os.path.join(out, "torch_dist"), dtype, timeout_s=3600)
        copied = list(auxiliary_files(hf_dir))
        for name in copied:
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(out, name))
        return write_meta(out, megatron_format, ckpt.config, dtype, layout, copied)


def _write_rank_files(spec, layout, get_slice, dtype, out, progress):
    shards = {fname: weight_map.megatron_shards(spec, layout, t, p, d) for t, p, d, fname in rank_files(layout)}
    bar = _progress(sum(len(s) for s in shards.values()), "HF -> Megatron", progress)
    for fname, params in shards.items():
        entries = [(name, s.shape, dtype) for name, s in params.items()]
        write_streaming(os.path.join(out, fname), entries,
                        lambda name, params=params: weight_map.assemble(params[name], get_slice, dtype=dtype),
                        on_tensor=lambda _: bar.update())
    bar.close()


def _save_torch_dist_rank(spec, layout, hf_dir, directory, dtype):
    from megatron.core import dist_checkpointing

    from megatron_rl.models.megatron_config import transformer_config
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.model import build_gpt_model
    from megatron_rl.trainer.weights import load_hf_weights

    parallel.initialize(layout, spec)
    model = build_gpt_model(spec, layout, transformer_config(spec, layout, params_dtype=dtype))
    load_hf_weights(model, spec, layout, HFCheckpoint(hf_dir).get_slice)
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    parallel.destroy()


# ---- Megatron -> HF --------------------------------------------------------------------------------------------

def megatron_to_hf(load: str, save: str, max_shard_bytes: int = 5 * 2**30, overwrite: bool = False,
                   progress: bool = True) -> dict:
    ckpt = MegatronCheckpoint(load)
    try:
        spec, dtype = ckpt.spec, ckpt.dtype
        shapes = weight_map.hf_shapes(spec)
        files = _plan_hf_files(shapes, dtype, max_shard_bytes)
        bar = _progress(len(shapes), "Megatron -> HF", progress)
        with atomic_directory(save, overwrite) as out:
            index = {}
            for fname, names in files:
                entries = [(n, shapes[n], dtype) for n in names]
                write_streaming(os.path.join(out, fname), entries,
                                lambda n: ckpt.read_full(n).to(dtype),
                                metadata={"format": "pt"}, on_tensor=lambda _: bar.update())
                index.update({n: fname for n in names})
            if len(files) > 1:
                itemsize = torch.empty((), dtype=dtype).element_size()
                total = sum(torch.Size(s).numel() for s in shapes.values()) * itemsize
                with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=2)
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump(ckpt.meta["hf_config"], f, indent=2)
            for name in ckpt.auxiliary_files():
                shutil.copy2(os.path.join(load, name), os.path.join(out, name))
        bar.close()
        return {"tensors": len(shapes), "files": len(files)}
    finally:
        ckpt.close()


def _plan_hf_files(shapes, dtype, max_shard_bytes):
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = torch.Size(shape).numel() * itemsize
        if current and size + nbytes > max_shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    groups.append(current)
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    n = len(groups)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]
