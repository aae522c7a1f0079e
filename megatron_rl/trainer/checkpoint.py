"""Distributed checkpoints of the trainer (model, optimizer, scheduler, step) with Megatron-Core's
`dist_checkpointing`: saved under one TP/PP layout, loadable under another.

The optimizer state is saved "fully_reshardable": on CPU the default sharding type fails, and
`dp_reshardable` resumed with a wrong loss.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron_rl.trainer.policy import Policy

SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(policy: Policy, scheduler, is_loading: bool) -> dict:
    model_sd = policy.module.sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=SHARDED_METADATA),
    }
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def _check_resumable(policy: Policy) -> None:
    """Megatron-Core 0.16 restores distributed-optimizer state only for Apex/TE Adam; torch's Adam (the
    fallback without them, always on CPU) keeps a per-parameter 'step' that the load cannot map."""
    from megatron_rl.trainer.model import have_transformer_engine

    if policy.optimizer.config.use_distributed_optimizer and not have_transformer_engine():
        raise ValueError("--use-distributed-optimizer checkpoints need Transformer Engine or Apex Adam "
                         "(torch's Adam state cannot be restored by megatron-core 0.16); train without "
                         "--use-distributed-optimizer on this machine")


def save_trainer_checkpoint(policy: Policy, directory: str, scheduler=None, extra: dict | None = None) -> None:
    """Collective: every trainer rank calls it. `extra` (plain data) is saved as common state."""
    from megatron.core import dist_checkpointing

    _check_resumable(policy)
    state = _sharded_state(policy, scheduler, is_loading=False)
    state["extra"] = extra or {}
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, directory, content_metadata=SHARDED_METADATA)


def load_trainer_checkpoint(policy: Policy, directory: str, scheduler=None) -> dict:
    """Collective: load model, optimizer and scheduler state saved under any TP/PP layout; return `extra`."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--load {directory!r}: no checkpoint directory")
    _check_resumable(policy)
    state = _sharded_state(policy, scheduler, is_loading=True)
    state["extra"] = {}
    loaded = dist_checkpointing.load(state, directory)
    policy.module.load_state_dict(loaded["model"])
    policy.optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    return loaded.get("extra", {})

