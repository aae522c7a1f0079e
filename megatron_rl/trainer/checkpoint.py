"""Distributed checkpoints of the trainer (model, optimizer, scheduler, step, and the frozen reference model
of a KL penalty) with Megatron-Core's `dist_checkpointing`: saved under one TP/PP layout, loadable under another.

The optimizer state is saved "fully_reshardable": on CPU the default sharding type fails, and
`dp_reshardable` resumed with a wrong loss. Loads go through `safe_load` (weights-only, the index checked first).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_rl.checkpoint.rl_checkpoint import HAS_REFERENCE, check_has_reference
from megatron_rl.trainer.policy import Policy

SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


REFERENCE_KEY = "ref_model"  # the reference model's weights, under their own tensor names (this prefix)


def _sharded_state(policy: Policy, scheduler, is_loading: bool, reference: torch.nn.Module | None = None) -> dict:
    model_sd = policy.module.sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=SHARDED_METADATA),
    }
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if reference is not None:
        state[REFERENCE_KEY] = reference.sharded_state_dict(prefix=REFERENCE_KEY + ".")
    return state


def _check_resumable(policy: Policy) -> None:
    """Megatron-Core 0.16 restores distributed-optimizer state only for Apex/TE Adam; torch's Adam (the
    fallback without them, always on CPU) keeps a per-parameter 'step' that the load cannot map."""
    from megatron_rl.trainer.model import have_transformer_engine

    if policy.optimizer.config.use_distributed_optimizer and not have_transformer_engine():
        raise ValueError("--use-distributed-optimizer checkpoints need Transformer Engine or Apex Adam "
                         "(torch's Adam state cannot be restored by megatron-core 0.16); train without "
                         "--use-distributed-optimizer on this machine")


def save_trainer_checkpoint(policy: Policy, directory: str, scheduler=None, extra: dict | None = None,
                            reference: torch.nn.Module | None = None) -> None:
    """Collective: every trainer rank calls it. `extra` (plain data) is saved as common state; `reference`: the
    reference model (this rank's shard), saved beside the policy."""
    from megatron.core import dist_checkpointing

    _check_resumable(policy)
    state = _sharded_state(policy, scheduler, is_loading=False, reference=reference)
    state["extra"] = extra or {}
    state[HAS_REFERENCE] = reference is not None
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, directory, content_metadata=SHARDED_METADATA)


def load_trainer_checkpoint(policy: Policy, directory: str, scheduler=None,
                            reference: torch.nn.Module | None = None) -> dict:
    """Collective: load model, optimizer and scheduler state saved under any TP/PP layout (and, when `reference` is
    given, the reference model's weights into it); return `extra`."""
    from megatron_rl.checkpoint.safe_load import dist_load

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--load {directory!r}: no checkpoint directory")
    _check_resumable(policy)
    if reference is not None:
        check_has_reference(directory)
    state = _sharded_state(policy, scheduler, is_loading=True, reference=reference)
    state["extra"] = {}
    loaded = dist_load(state, directory)
    policy.module.load_state_dict(loaded["model"])
    policy.optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    if reference is not None:
        prefix = REFERENCE_KEY + "."
        reference.load_state_dict({k.removeprefix(prefix): v for k, v in loaded[REFERENCE_KEY].items()})
    return loaded.get("extra", {})


