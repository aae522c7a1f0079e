"""Point-to-point transport for DDMA, behind a small interface so that a CUDA-IPC or RDMA transport can
replace it. The torch.distributed one posts every send and receive of a round at once
(`batch_isend_irecv`: gloo on CPU, NCCL on GPU) and counts the bytes each rank moves. Buffers are byte
views of the source and destination tensors themselves, so contiguous pieces are never copied."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Transport(Protocol):
    bytes_sent: int
    bytes_received: int

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        """Send each uint8 buffer to its peer and receive into each uint8 buffer from its peer, all at once.
        Messages between two ranks are matched in the order they are listed on both sides."""
        ...


class TorchDistTransport:
    def __init__(self, group=None):
        self.group = group
        self.bytes_sent = 0
        self.bytes_received = 0

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, buf, peer, self.group) for peer, buf in sends]
        ops += [dist.P2POp(dist.irecv, buf, peer, self.group) for peer, buf in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.bytes_sent += sum(b.numel() for _, b in sends)
        self.bytes_received += sum(b.numel() for _, b in recvs)
