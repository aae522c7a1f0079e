"""Megatron checkpoints of weights on disk: what a directory written by the HF converter (or one iteration of an
RL checkpoint) holds, and reading any HF tensor slice out of it.

Such a directory holds `megatron_rl.json` (the HF config, the trainer layout the weights are sharded in, the dtype
and the format) and the weights in one of these formats:

- `safetensors` (default): one file per model-parallel rank, `mp_rank_{TP:02d}_{PP:03d}.safetensors`, with
  Megatron's parameter names (local or Transformer-Engine, as the layout says) and fused layouts. Written and
  read one tensor at a time. With expert parallelism, the experts of one TP x PP rank differ between the first
  `expert_replica_span` DP ranks (which together hold every expert once): then one file per (TP, PP, DP) rank of
  those, `mp_rank_{TP:02d}_{PP:03d}_{DP:03d}.safetensors`, and the layout in megatron_rl.json has that many DP
  ranks.
- `torch_dist`: Megatron-Core's distributed checkpoint (`dist_checkpointing`, directory `torch_dist/`),
  written by TP x PP (x the expert replica span) real ranks; any TP/PP/EP layout can load it.
- `rl`: an iteration of an RL run's checkpoint (`iter_NNNNNNN/`): the trainer's distributed checkpoint in the
  directory itself, the model under key "model" beside the optimizer and scheduler (only the model is read).

`MegatronCheckpoint` serves any HF tensor slice out of the per-rank files (the segments of `models.weight_map`
say where each HF row lives), so exporting to HF (`checkpoint.hf_conversion`) and loading at another TP/PP/EP
(`trainer.weights.load_megatron_weights`) are the same operation. A distributed checkpoint is first written out
as per-rank files by the saved layout's ranks, each building its shard of the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import torch

from megatron_rl.models import weight_map
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.safetensors_io import SafetensorsFile, auxiliary_files, write_streaming
from megatron_rl.models.spec import ModelSpec

META_FILE = "megatron_rl.json"
FORMATS = ("safetensors", "torch_dist")  # what the HF -> Megatron converter writes
RL_FORMAT = "rl"
# Formats held as a Megatron-Core distributed checkpoint: its directory (relative) and the key of the model's
# sharded state dict in it (None: the model's state dict is the checkpoint's top level).
DIST_CHECKPOINTS = {"torch_dist": ("torch_dist", None), RL_FORMAT: ("", "model")}


def rank_file(tp_rank: int, pp_rank: int, dp_rank: int | None = None) -> str:
    """The `safetensors` format's file of a model-parallel rank; `dp_rank` only for a layout whose experts span
    several DP ranks (`TrainerLayout.expert_replica_span` > 1)."""
    suffix = "" if dp_rank is None else f"_{dp_rank:03d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}{suffix}.safetensors"


def rank_files(layout: TrainerLayout) -> list[tuple[int, int, int, str]]:
    """(tp, pp, dp, file name) of every rank file that holds `layout`'s weights: one per TP x PP rank, times the DP
    ranks its experts span."""
    span = layout.expert_replica_span
    return [(t, p, d, rank_file(t, p, d if span > 1 else None)) for p in range(layout.pipeline_parallel_size)
            for t in range(layout.tensor_parallel_size) for d in range(span)]


# ---- the description beside the weights ---------------------------------------------------------------------

LAYOUT_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size", "make_vocab_size_divisible_by", "transformer_impl",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "expert_model_parallel_size",
                 "expert_tensor_parallel_size")


def write_meta(directory: str, weights_format: str, hf_config: dict, dtype: torch.dtype, layout: TrainerLayout,
               auxiliary: list[str]) -> dict:
    """Write `megatron_rl.json`, which makes `directory` readable by `MegatronCheckpoint`: the weights' format,
    the HF config of the model, their dtype, the trainer layout they are sharded in, and the files beside them
    that an HF export copies (tokenizer, generation config). Returns what it wrote."""
    meta = {"format": weights_format, "hf_config": hf_config, "dtype": str(dtype).removeprefix("torch."),
            **{f: getattr(layout, f) for f in LAYOUT_FIELDS}, "auxiliary_files": sorted(auxiliary)}
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def read_meta(directory: str, flag: str = "--load") -> dict:
    """`directory`'s megatron_rl.json, checked for the fields every reader needs; errors name `flag`."""
    meta_path = os.path.join(directory, META_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {directory!r} is not a megatron-rl checkpoint ({META_FILE} missing)") \
            from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {directory!r}: cannot read {META_FILE} ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{flag} {directory!r}: {META_FILE} is not a JSON object")
    for field in ("format", "hf_config", "tensor_parallel_size", "pipeline_parallel_size", "dtype"):
        if field not in meta:
            raise ValueError(f"{flag} {directory!r}: {META_FILE} has no field {field!r}")
    if meta["format"] not in ("safetensors", *DIST_CHECKPOINTS):
        raise ValueError(f"{flag} {directory!r}: {META_FILE} names an unknown format {meta['format']!r}")
    return meta


def weights_layout(layout: TrainerLayout) -> TrainerLayout:
    """`layout` with as many DP ranks as it takes to hold every weight once: 1, or the DP ranks its experts span."""
    return dataclasses.replace(layout, data_parallel_size=layout.expert_replica_span)


def meta_layout(meta: dict) -> TrainerLayout:
    """The trainer layout a checkpoint's weights are sharded in (DP: the ranks its experts span, see
    `weights_layout`)."""
    return weights_layout(TrainerLayout(**{f: meta[f] for f in LAYOUT_FIELDS if f in meta}))


# ---- reading Megatron checkpoints --------------------------------------------------------------------------------

class MegatronCheckpoint:
    """A Megatron checkpoint written by this module, read as HF slices (any layout can be served)."""

    def __init__(self, directory: str, flag: str = "--load"):
        self.meta = read_meta(directory, flag)
        self.directory = directory
        self.spec = ModelSpec.from_hf_config(self.meta["hf_config"])
        self.layout = meta_layout(self.meta)
        self.dtype = getattr(torch, self.meta["dtype"])
        self._shards_dir = directory
        self._tmp: str | None = None
        if self.meta["format"] in DIST_CHECKPOINTS:
            self._shards_dir = self._dist_checkpoint_to_rank_files()
        self._index = self._build_index()

    def auxiliary_files(self) -> list[str]:
        """The files beside the weights that an HF export copies (tokenizer, generation config, ...)."""
        if "auxiliary_files" in self.meta:
            return list(self.meta["auxiliary_files"])
        return list(auxiliary_files(self.directory))  # written before megatron_rl.json listed them

    def _dist_checkpoint_to_rank_files(self) -> str:
        """Per-rank safetensors files of the distributed checkpoint, written by the saved layout's ranks (TP x PP x
        the DP ranks its experts span)."""
        from megatron_rl.runtime.spawn import run_on_ranks

        subdir, key = DIST_CHECKPOINTS[self.meta["format"]]
        self._tmp = tempfile.mkdtemp(prefix="megatron_rl_export_")
        try:
            run_on_ranks(_load_torch_dist_rank, self.layout.world_size, self.spec, self.layout,
                         os.path.join(self.directory, subdir), key, self._tmp, self.dtype, timeout_s=3600)
        except BaseException:
            self.close()
            raise
        return self._tmp

    def close(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _build_index(self):
        """hf_name -> [(hf_start, hf_stop, file, megatron_name, dim, offset_in_shard)], sorted by start. The files
        of DP ranks > 0 (expert parallelism) are indexed for their experts only: their other tensors are replicas."""
        index: dict[str, list] = {}
        for t, p, d, fname in rank_files(self.layout):
            path = os.path.join(self._shards_dir, fname)
            if not os.path.exists(path):
                raise FileNotFoundError(f"checkpoint file {path!r} is missing")
            shards = weight_map.megatron_shards(self.spec, self.layout, t, p, d)
            replicas = weight_map.megatron_shards(self.spec, self.layout, t, p, 0) if d else {}
            f = SafetensorsFile(path)
            for name, shard in shards.items():
                if name not in f.entries:
                    raise ValueError(f"{path}: tensor {name!r} is missing")
                shape = f.entries[name][0]
                if shape != shard.shape:
                    raise ValueError(f"{path}: tensor {name!r} has shape {shape}, expected {shard.shape}")
                if replicas.get(name) == shard:
                    continue
                offset = 0
                for seg in shard.segments:
                    if seg.hf_name is not None:
                        index.setdefault(seg.hf_name, []).append((seg.start, seg.stop, f, name, shard.dim, offset))
                    offset += seg.length
        for pieces in index.values():
            pieces.sort(key=lambda x: x[0])
        return index

    def read_full(self, hf_name: str) -> torch.Tensor:
        """One whole HF tensor, assembled from the ranks that hold its pieces."""
        pieces = self._index.get(hf_name)
        if not pieces:
            raise KeyError(f"checkpoint {self.directory!r} holds no piece of {hf_name!r}")
        shape = weight_map.hf_shapes(self.spec)[hf_name]
        dim = pieces[0][4] if len(shape) > 1 else 0
        return self.get_slice(weight_map.Segment(hf_name, 0, shape[dim]), dim)

    def get_slice(self, seg: weight_map.Segment, dim: int) -> torch.Tensor:
        """HF tensor `seg.hf_name`, rows [start, stop) along `dim`, read from whichever ranks hold them."""
        parts, cursor = [], seg.start
        for start, stop, file, name, sdim, offset in self._index.get(seg.hf_name, []):
            if stop <= cursor or start > cursor:
                continue  # not overlapping the next needed row (or a replica of rows already read)
            take = min(stop, seg.stop) - cursor
            lo = offset + cursor - start
            parts.append(file.read(name, sdim, lo, lo + take))
            cursor += take
            if cursor >= seg.stop:
                break
        if parts and parts[0].dim() > 1 and dim != sdim:
            raise ValueError(f"{seg.hf_name!r} is split along dim {sdim} in the checkpoint, asked along dim {dim}")
        if cursor < seg.stop:
            raise KeyError(f"checkpoint {self.directory!r} does not hold rows {cursor}:{seg.stop} of {seg.hf_name!r}")
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts, dim if parts[0].dim() > 1 else 0)


def _load_torch_dist_rank(spec, layout, directory, key, out_dir, dtype):
    from megatron_rl.models.megatron_config import transformer_config
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.model import build_gpt_model

    parallel.initialize(layout, spec)
    model = build_gpt_model(spec, layout, transformer_config(spec, layout, params_dtype=dtype))
    load_dist_model(model, directory, key)
    write_rank_file(model, out_dir, layout)
    parallel.destroy()


def load_dist_model(model: torch.nn.Module, directory: str, key: str | None = None) -> None:
    """Collective over Megatron's ranks: this rank's shard of `model` from a Megatron-Core distributed checkpoint
    saved under any TP/PP layout (the model's state under `key`, or at the top level); only the model is read,
    through `safe_load` (weights-only, the index checked first)."""
    from megatron_rl.checkpoint.safe_load import dist_load

    sharded = model.sharded_state_dict()
    state = dist_load({key: sharded} if key else sharded, directory, flag="Megatron weights")
    model.load_state_dict(state[key] if key else state, strict=False)


def write_rank_file(model: torch.nn.Module, out_dir: str, layout: TrainerLayout) -> str | None:
    """This rank's parameters as its file of the `safetensors` format in `out_dir` (`rank_file` of its TP and PP
    rank, and of its DP rank when the layout's experts span several), one tensor at a time (a GPU tensor is copied to
    the host alone). Returns the path; None on a DP rank that holds only replicas of other ranks' files."""
    from megatron.core import parallel_state as ps

    span, dp = layout.expert_replica_span, ps.get_data_parallel_rank()
    if dp >= span:
        return None
    params = dict(model.named_parameters())
    path = os.path.join(out_dir, rank_file(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                                           dp if span > 1 else None))
    write_streaming(path, [(n, tuple(p.shape), p.dtype) for n, p in params.items()],
                    lambda n: params[n].detach().cpu())
    return path
