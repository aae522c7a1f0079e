"""Process groups of one launch: which ranks train, which generate, and the group that joins them.

Under one `torchrun` launch (one node or many: torchrun's own multi-node flags), global ranks
[0, T) are the trainer and [T, T + G) the generators, G = rollout TP x replicas. Each role initializes its
own default process group on a prefix of the launch's rendezvous store, so Megatron-Core sees exactly the
trainer's ranks (its collectives, e.g. the optimizer's all_gather_object, never involve a generator), and
each generator replica gets a TP group inside the generators' world. A separate gloo group spanning every
rank carries the channels; its ranks are the global ranks. The roles' own groups use the backend of the rank's
device (NCCL on GPUs) for tensors; what ranks wait for (a replica's control messages, like the trainer's commands)
goes on gloo, so that no idle rank waits inside NCCL. Every rank's `DeviceId` is shared through the store so that
DDMA can choose its transport, and its group over all ranks is made here, by every rank in the same order
(`new_ddma_group`: NCCL connected at once, or gloo; `choose_transport` says which).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import pickle

import torch
import torch.distributed as dist

from megatron_rl.runtime.device import DeviceId, backend_for


@dataclasses.dataclass
class Roles:
    rank: int
    world_size: int
    trainer_world_size: int
    rollout_tp: int
    rollout_replicas: int
    sync_group: object  # gloo ProcessGroup over all ranks
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))  # this rank's
    devices: list[DeviceId] = dataclasses.field(default_factory=list)  # every rank's, by global rank
    store: object | None = None  # the launch's rendezvous store (more groups over all ranks are made on it)
    timeout: datetime.timedelta = datetime.timedelta(minutes=30)
    replica_group: object | None = None  # this generator replica's TP group (generator ranks only)
    replica_control_group: object | None = None  # the same ranks on gloo: the controller's messages, host side
    ddma: tuple[str, object] | None = None  # (transport kind, group over all ranks): `new_ddma_group`

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.trainer_world_size

    @property
    def is_controller(self) -> bool:
        return self.rank == 0

    @property
    def replica(self) -> int:
        return (self.rank - self.trainer_world_size) // self.rollout_tp

    @property
    def rollout_tp_rank(self) -> int:
        return (self.rank - self.trainer_world_size) % self.rollout_tp

    @property
    def is_leader(self) -> bool:
        return not self.is_trainer and self.rollout_tp_rank == 0


def init_roles(trainer_world_size: int, rollout_tp: int, rollout_replicas: int,
               device: torch.device | str = "cpu", timeout_minutes: int = 30) -> Roles:
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))  # node 0's store: waited for this long
    store.set_timeout(timeout)
    generators = rollout_tp * rollout_replicas
    if trainer_world_size + generators != world:
        raise ValueError(f"world size {world} != trainer ranks {trainer_world_size} + generator ranks "
                         f"{generators} (--rollout-tensor-parallel-size {rollout_tp} x --rollout-num-replicas "
                         f"{rollout_replicas})")
    device = torch.device(device)
    backend = backend_for(device)
    if rank < trainer_world_size:
        dist.init_process_group(backend, store=dist.PrefixStore("trainer/", store), rank=rank,
                                world_size=trainer_world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.PrefixStore("generator/", store), rank=rank - trainer_world_size,
                                world_size=generators, timeout=timeout)
    sync = dist.ProcessGroupGloo(dist.PrefixStore("sync/", store), rank, world, timeout)
    store.set(f"device/{rank}", pickle.dumps(DeviceId.of(device)))
    devices = [pickle.loads(store.get(f"device/{r}")) for r in range(world)]
    roles = Roles(rank, world, trainer_world_size, rollout_tp, rollout_replicas, sync, device, devices, store, timeout)
    roles.ddma = new_ddma_group(devices, rank, store, timeout, device)
    if not roles.is_trainer:
        for r in range(rollout_replicas):  # new_group is collective over the generators' world
            ranks = list(range(r * rollout_tp, (r + 1) * rollout_tp))
            group = dist.new_group(ranks)
            control = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if r == roles.replica:
                roles.replica_group, roles.replica_control_group = group, control
    return roles


_groups = itertools.count()


def choose_transport(devices: list[DeviceId]) -> tuple[str, str]:
    """("gloo" | "nccl" | "staged", why) for ranks computing on these devices (by rank)."""
    if all(d.type == "cpu" for d in devices):
        return "gloo", f"all {len(devices)} ranks compute on CPUs"
    if any(d.type == "cpu" for d in devices):
        return "staged", "some ranks compute on CPUs and others on GPUs"
    first_rank: dict[DeviceId, int] = {}
    for rank, device in enumerate(devices):
        if device in first_rank:
            return "staged", (f"ranks {first_rank[device]} and {rank} share one GPU ({device}); NCCL needs a GPU per "
                              "rank, so weights go through pinned host memory over gloo")
        first_rank[device] = rank
    return "nccl", f"{len(devices)} ranks on {len(devices)} distinct GPUs: NCCL between GPU memories"


def new_ddma_group(devices: list[DeviceId], rank: int, store, timeout, device: torch.device):
    """(the transport's kind, the DDMA group): a group over every rank of the launch, on its store, whose ranks are
    the global ranks, NCCL bound to `device` and connected now when `choose_transport` says NCCL, else gloo. Every
    rank must call it, in the same order (`runtime.roles.init_roles` does). Made like torch.distributed's own groups
    (and SGLang's custom weight-update groups) rather than with `new_group`, because each role's default group
    holds only that role's ranks."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    kind, why = choose_transport(devices)
    if rank == 0:
        print(f"[megatron-rl] DDMA transport: {kind} ({why})", flush=True)
    name = f"megatron_rl_ddma_{next(_groups)}"
    group, _ = _new_process_group_helper(len(devices), rank, [], "nccl" if kind == "nccl" else "gloo",
                                         dist.PrefixStore(name, store), group_name=name, timeout=timeout,
                                         device_id=torch.device(device) if kind == "nccl" else None)
    _world.pg_group_ranks[group] = {r: r for r in range(len(devices))}
    return kind, group
