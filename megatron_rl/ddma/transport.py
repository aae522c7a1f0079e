"""Point-to-point transport for DDMA, behind a small interface so that a CUDA-IPC or RDMA transport can
replace it. The torch.distributed one posts every send and receive of a round at once and counts the bytes each
rank moves. Buffers are byte views of the source and destination tensors themselves, so contiguous pieces are
never copied.

Which one a run uses follows from where its ranks compute (`choose_transport`): gloo when every rank is on a CPU;
NCCL between GPU memories when every rank has a GPU of its own (the paper's path); and, when ranks share a GPU
(a one-GPU machine: NCCL refuses two ranks on one device) or mix CPUs and GPUs, gloo through pinned host buffers.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from megatron_rl.runtime.device import DeviceId
from megatron_rl.runtime.multinode import lost_peer


class Transport(Protocol):
    bytes_sent: int
    bytes_received: int

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> Transfer:
        """Post a send of each uint8 buffer to its peer and a receive into each uint8 buffer from its peer, all
        at once. Messages between two ranks are matched in the order they are posted on both sides."""
        ...


class Transfer:
    """Posted point-to-point operations and their buffers (which must stay untouched until `wait` returns);
    `wait` blocks until all completed and counts their bytes on the transport. A peer that died or stayed silent
    for the group's timeout is raised as `multinode.LostPeer` naming its rank and node."""

    def __init__(self, transport, works: list[tuple[int, object]], sends: list[tuple[int, torch.Tensor]],
                 recvs: list[tuple[int, torch.Tensor]], copies: list[tuple[torch.Tensor, torch.Tensor]] = ()):
        self.transport, self.works, self.sends, self.recvs = transport, works, sends, recvs
        self.copies = list(copies)  # (destination, staging buffer) pairs to copy once the receives completed

    def wait(self) -> None:
        for peer, work in self.works:
            try:
                work.wait()
            except RuntimeError as e:  # the peer's process or node died, or the group's timeout passed
                raise lost_peer("a DDMA transfer with", peer, e) from e
        for destination, staging in self.copies:
            destination.copy_(staging, non_blocking=True)
        self.copies = []
        self.transport.bytes_sent += sum(b.numel() for _, b in self.sends)
        self.transport.bytes_received += sum(b.numel() for _, b in self.recvs)
        self.works, self.sends, self.recvs = [], [], []


class TorchDistTransport:
    """Over a torch.distributed ProcessGroup: the default world, or a standalone group that spans trainer
    and generator ranks (the controller's sync group). Peers are ranks of that group."""

    TAG = 7

    def __init__(self, group=None):
        self.group = group
        self.bytes_sent = 0
        self.bytes_received = 0

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> Transfer:
        pg = self.group if self.group is not None else dist.group.WORLD
        works = [(peer, pg.send([buf], peer, self.TAG)) for peer, buf in sends]
        works += [(peer, pg.recv([buf], peer, self.TAG)) for peer, buf in recvs]
        return Transfer(self, works, sends, recvs)


class StagedTransport(TorchDistTransport):
    """Over a gloo group, for buffers in GPU memory: each send is copied to the host first, each receive lands in a
    pinned host buffer and is copied to its GPU destination by `wait`. For ranks that cannot use NCCL between
    themselves (two processes on one GPU)."""

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> Transfer:
        host_sends = [(peer, buf.cpu()) for peer, buf in sends]  # a no-op for host buffers
        host_recvs, copies = [], []
        for peer, buf in recvs:
            if buf.device.type == "cpu":
                host_recvs.append((peer, buf))
            else:
                staging = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
                host_recvs.append((peer, staging))
                copies.append((buf, staging))
        transfer = super().start(host_sends, host_recvs)
        transfer.copies = copies
        return transfer


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


def make_transport(roles) -> Transport:
    """The DDMA transport for this rank of a launch (`roles.Roles`). Every rank must call it: with NCCL it creates
    a process group over all ranks (trainer and generators), on the launch's store."""
    kind, why = choose_transport(roles.devices)
    if roles.rank == 0:
        print(f"[megatron-rl] DDMA transport: {kind} ({why})", flush=True)
    if kind == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = roles.timeout
        options.group_name = "megatron_rl_ddma"
        options.global_ranks_in_group = list(range(roles.world_size))
        group = dist.ProcessGroupNCCL(dist.PrefixStore("ddma/", roles.store), roles.rank, roles.world_size, options)
        return TorchDistTransport(group)
    if kind == "staged":
        return StagedTransport(roles.sync_group)
    return TorchDistTransport(roles.sync_group)
