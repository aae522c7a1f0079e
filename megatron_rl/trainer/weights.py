"""Move weights into and out of this rank's Megatron-Core model: HF-named tensors through `models.weight_map`,
and Megatron checkpoints of weights (`checkpoint.megatron_format`) at any TP/PP/EP."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

from megatron_rl.models import weight_map
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import ModelSpec


def load_hf_weights(model: torch.nn.Module, spec: ModelSpec, layout: TrainerLayout,
                    get_slice: Callable[[weight_map.Segment, int], torch.Tensor] | Mapping[str, torch.Tensor]) -> None:
    """Copy HF weights (a mapping, or a `get_slice` reader) into this rank's shard of `model`, whose TP, PP and DP
    ranks come from Megatron's parallel state (the DP rank picks the experts of an expert-parallel rank)."""
    if isinstance(get_slice, Mapping):
        get_slice = weight_map.slicer(get_slice)
    shards = rank_shards(spec, layout)
    params = dict(model.named_parameters())
    unexpected = sorted(set(params) - set(shards))
    missing = sorted(set(shards) - set(params))
    if unexpected or missing:
        raise ValueError(f"model parameters do not match the layout ({layout.describe()}, --transformer-impl "
                         f"{layout.transformer_impl}): unexpected {unexpected}, missing {missing}")
    with torch.no_grad():
        for name, shard in shards.items():
            params[name].copy_(weight_map.assemble(shard, get_slice, dtype=params[name].dtype))


def rank_shards(spec: ModelSpec, layout: TrainerLayout) -> dict[str, weight_map.ShardLayout]:
    """The layout of every parameter of this rank, from Megatron's parallel state. With experts, the layout's
    expert ranks of this (TP, DP) rank are checked against the expert groups Megatron-Core built: a mismatch would
    put experts on the wrong ranks without any shape error."""
    from megatron.core import parallel_state as ps

    tp, dp = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    if spec.is_moe:
        mine = layout.expert_ranks(dp, tp)
        megatron = (ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
        if mine != megatron:
            raise RuntimeError(f"{layout.describe()}: trainer rank (TP {tp}, DP {dp}) is (EP, expert-TP) rank "
                               f"{megatron} in Megatron-Core's groups but {mine} in the layout")
    return weight_map.megatron_shards(spec, layout, tp, ps.get_pipeline_model_parallel_rank(), dp)


def load_weights_from(model: torch.nn.Module, spec: ModelSpec, layout: TrainerLayout, directory: str,
                      flag: str) -> None:
    """This rank's shard of `model` from a directory of weights: an HF checkpoint (config.json), or Megatron weights
    as --load-megatron reads them (converter output of either format, an RL checkpoint or one of its iterations).
    Collective over the trainer's ranks for a distributed checkpoint. `flag` names the directory in errors."""
    from megatron_rl.checkpoint import rl_checkpoint

    if rl_checkpoint.is_hf_directory(directory):
        from megatron_rl.models.safetensors_io import HFCheckpoint

        load_hf_weights(model, spec, layout, HFCheckpoint(directory).get_slice)
    else:
        load_megatron_weights(model, spec, layout, rl_checkpoint.weights_directory(directory, flag=flag))


def load_megatron_weights(model: torch.nn.Module, spec: ModelSpec, layout: TrainerLayout, directory: str) -> None:
    """Collective over the trainer's ranks: this rank's shard of `model` (any TP/PP/EP) from a Megatron checkpoint of
    weights (`checkpoint.megatron_format`). Per-rank safetensors files are read as HF slices
    (`MegatronCheckpoint.get_slice`); a distributed checkpoint is resharded by Megatron-Core itself (its keys follow
    the layer spec, which the run setup checks)."""
    from megatron_rl.checkpoint.megatron_format import DIST_CHECKPOINTS, MegatronCheckpoint, load_dist_model, read_meta

    meta = read_meta(directory)
    if meta["format"] in DIST_CHECKPOINTS:
        subdir, key = DIST_CHECKPOINTS[meta["format"]]
        load_dist_model(model, os.path.join(directory, subdir), key)
        return
    load_hf_weights(model, spec, layout, MegatronCheckpoint(directory).get_slice)


def merge_to_hf(spec: ModelSpec, layout: TrainerLayout,
                shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full HF tensors from the parameters of ranks keyed (tp_rank, pp_rank) (one model replica, DP rank 0) or
    (tp_rank, pp_rank, dp_rank): with expert parallelism, the ranks of DP 0 .. `layout.expert_replica_span` - 1
    together hold every expert."""
    shapes = weight_map.hf_shapes(spec)
    hf: dict[str, torch.Tensor] = {}
    for key, params in shards.items():
        tp_rank, pp_rank, dp_rank = (*key, 0)[:3]
        for name, shard in weight_map.megatron_shards(spec, layout, tp_rank, pp_rank, dp_rank).items():
            if name not in params:
                raise KeyError(f"tensor {name!r} of TP rank {tp_rank}, PP rank {pp_rank}, DP rank {dp_rank} is "
                               "missing")
            if name == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # the last stage's copy of the tied embedding
            weight_map.scatter(shard, params[name], hf, shapes)
    missing = sorted(set(shapes) - set(hf))
    if missing:
        raise KeyError(f"no shard provides HF tensor(s) {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return hf
