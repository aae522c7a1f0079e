"""Point-to-point transport for DDMA, behind a small interface so that a CUDA-IPC or RDMA transport can
replace it. The torch.distributed one posts every send and receive of a round at once
(gloo on CPU, NCCL on GPU) and counts the bytes each rank moves. Buffers are byte
views of the source and destination tensors themselves, so contiguous pieces are never copied."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Transport(Protocol):
    bytes_sent: int
    bytes_received: int

    def start(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> Transfer:
        """Post a send of each uint8 buffer to its peer and a receive into each uint8 buffer from its peer, all
        at once. Messages between two ranks are matched in the order they are posted on both sides."""
        ...


class Transfer:
    """Posted point-to-point operations and their buffers (which must stay untouched until `wait` returns);
    `wait` blocks until all completed and counts their bytes on the transport."""

    def __init__(self, transport, works: list, sends: list[tuple[int, torch.Tensor]],
                 recvs: list[tuple[int, torch.Tensor]]):
        self.transport, self.works, self.sends, self.recvs = transport, works, sends, recvs

    def wait(self) -> None:
        for work in self.works:
            work.wait()
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
        works = [pg.send([buf], peer, self.TAG) for peer, buf in sends]
        works += [pg.recv([buf], peer, self.TAG) for peer, buf in recvs]
        return Transfer(self, works, sends, recvs)
