"""Distributed checkpoints of the trainer (model, optimizer, scheduler, step) with Megatron-Core's
`dist_checkpointing`: saved under one TP/PP layout, loadable under another.

The optimizer state is saved "fully_reshardable" (see shared/notes/megatron-core-cpu.md: the default
sharding type fails on CPU and `dp_reshardable` resumed with a wrong loss).
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


def save_trainer_checkpoint(policy: Policy, directory: str, scheduler=None, extra: dict | None = None) -> None:
    """Collective: every trainer rank calls it. `extra` (plain data) is saved as common state."""
    from megatron.core import dist_checkpointing

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
    if policy.optimizer.config.use_distributed_optimizer:
        # A fresh distributed optimizer has no state to shard into; one zero-gradient step creates it.
        _prime_optimizer_state(policy)
    state = _sharded_state(policy, scheduler, is_loading=True)
    state["extra"] = {}
    loaded = dist_checkpointing.load(state, directory)
    policy.module.load_state_dict(loaded["model"])
    policy.optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    return loaded.get("extra", {})


def _prime_optimizer_state(policy: Policy) -> None:
    groups = policy.optimizer.param_groups
    saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in groups]
    for g in groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    policy.model.zero_grad_buffer()
    policy.optimizer.step()
    for g, (lr, wd) in zip(groups, saved):
        g["lr"], g["weight_decay"] = lr, wd
