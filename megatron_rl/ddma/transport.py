"""Point-to-point transport for DDMA, behind a small interface so that a CUDA-IPC or RDMA transport can
replace it. The torch.distributed one posts every send and receive of a round as one `batch_isend_irecv` (one
NCCL group on GPUs; gloo has no groups and takes them one by one) and counts the bytes each rank moves. Buffers are
byte views of the source and destination tensors themselves, so contiguous pieces are never copied.

Which one a run uses follows from where its ranks compute (`runtime.roles.choose_transport`): gloo when every rank
is on a CPU; NCCL between GPU memories when every rank has a GPU of its own (the paper's path: an SGLang generator
rank lives on its TP worker's GPU); and, when ranks share a GPU (a one-GPU machine: NCCL refuses two ranks on one
device) or mix CPUs and GPUs, gloo through pinned host buffers. The group spans every rank of the launch, is made by
every rank in the same order (`runtime.roles.new_ddma_group`), and on NCCL is bound to the rank's GPU and connected
at once: one communicator for all pairs, not one per pair made on first use.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

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
    `wait` blocks until all completed (on a GPU: until the current stream, which NCCL's work joins, finished them,
    so that received bytes are there and sent buffers may be reused) and counts their bytes on the transport. A
    peer that died or stayed silent for the group's timeout is raised as `multinode.LostPeer` naming it (one of the
    round's peers, on NCCL)."""

    def __init__(self, transport, works: list, sends: list[tuple[int, torch.Tensor]],
                 recvs: list[tuple[int, torch.Tensor]], copies: list[tuple[torch.Tensor, torch.Tensor]] = ()):
        self.transport, self.works, self.sends, self.recvs = transport, works, sends, recvs
        self.copies = list(copies)  # (destination, staging buffer) pairs to copy once the receives completed

    def wait(self) -> None:
        peers = sorted({peer for peer, _ in self.sends + self.recvs})
        try:
            for work in self.works:
                work.wait()
            device = next((b.device for _, b in self.sends + self.recvs if b.device.type == "cuda"), None)
            if device is not None:
                torch.cuda.current_stream(device).synchronize()
        except RuntimeError as e:  # the peer's process or node died, or the group's timeout passed
            raise lost_peer("a DDMA transfer with", peers[0] if len(peers) == 1 else None, e, peers) from e
        for destination, staging in self.copies:
            destination.copy_(staging, non_blocking=True)
        self.copies = []
        self.transport.bytes_sent += sum(b.numel() for _, b in self.sends)
        self.transport.bytes_received += sum(b.numel() for _, b in self.recvs)
        self.works, self.sends, self.recvs = [], [], []


class TorchDistTransport:
    """Over a torch.distributed group known to torch.distributed (`new_ddma_group`, or the default group in tests);
    peers are its ranks, which are the launch's global ranks."""

    def __init__(self, group=None):
        self.group = group
        self.bytes_sent = 0
        self.bytes_received = 0

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> Transfer:
        ops = [dist.P2POp(dist.isend, buf, peer, self.group) for peer, buf in sends]
        ops += [dist.P2POp(dist.irecv, buf, peer, self.group) for peer, buf in recvs]
        works = [w for w in dist.batch_isend_irecv(ops) if w is not None] if ops else []
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


def make_transport(roles) -> Transport:
    """The DDMA transport of this rank of a launch (`roles.Roles`), over its DDMA group (`roles.new_ddma_group`)."""
    kind, group = roles.ddma
    return StagedTransport(group) if kind == "staged" else TorchDistTransport(group)
