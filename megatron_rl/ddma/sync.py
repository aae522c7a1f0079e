"""Executing a DDMA plan: versioned, atomic publication of new weights to the generators.

Every rank in the plan calls `publish` with the same plan and version (trainer ranks pass their Megatron
shards; generator ranks pass their engine). Pieces travel in rounds: each (sender, receiver) pair's pieces
are grouped into buckets of at most `bucket_bytes`, and round k moves bucket k of every pair at once, one
message per piece, straight from the trainer's tensor into the generator's (a row range of a contiguous
tensor is contiguous; only column ranges of row-parallel weights are staged).
A generator brackets the transfer with begin/end_weight_update, checks that it received exactly the planned
bytes (and, with `debug_checksums`, a checksum per bucket), and only then serves the new version; on any
failure the update is aborted and the previous version keeps serving.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import torch

from megatron_rl.ddma.plan import Piece, Plan
from megatron_rl.ddma.transport import TorchDistTransport, Transfer, Transport
from megatron_rl.models.fp8 import BLOCK, SCALE_SUFFIX, quantize_block_fp8, scale_shape

CHECKSUM_BYTES = 8


class DDMAError(RuntimeError):
    pass


@dataclasses.dataclass
class SyncStats:
    version: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    rounds: int


def _buckets(pieces: list[Piece], bucket_bytes: int) -> list[list[Piece]]:
    out: list[list[Piece]] = [[]]
    size = 0
    for p in pieces:
        if out[-1] and size + p.nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.nbytes
    return out


def _schedule(plan: Plan, rank: int, bucket_bytes: int) -> tuple[dict[tuple[int, int], list[list[Piece]]], int]:
    """This rank's (sender, receiver) pairs, each cut into buckets. Only the two ends of a pair must agree on
    its buckets (they do: both cut the same piece list), so each rank schedules its own pairs, once per plan."""
    key = (rank, bucket_bytes)
    if key not in plan.schedules:
        pairs: dict[tuple[int, int], list[Piece]] = defaultdict(list)
        for p in plan.sends(rank) + plan.recvs(rank):
            pairs[(p.src, p.dst)].append(p)
        buckets = {pair: _buckets(pieces, bucket_bytes) for pair, pieces in pairs.items()}
        plan.schedules[key] = (buckets, max((len(b) for b in buckets.values()), default=0))
    return plan.schedules[key]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _checksum(buffers: list[torch.Tensor]) -> torch.Tensor:
    total = sum(int(b.to(torch.int64).sum()) for b in buffers)
    return torch.tensor([total], dtype=torch.int64).view(torch.uint8)


def _send_buffers(p: Piece, tensors: dict[str, torch.Tensor], dtype_bytes: int) -> list[torch.Tensor]:
    source = tensors[p.src_tensor].detach()
    if source.element_size() != dtype_bytes:
        raise DDMAError(f"trainer tensor {p.src_tensor!r} has {source.element_size()}-byte elements; the plan "
                        f"assumed {dtype_bytes}")
    piece = source.narrow(p.dim if source.dim() > 1 else 0, p.src_offset, p.length)
    if p.quantize:
        q, scale_inv = quantize_block_fp8(piece)
        return [_as_bytes(q), _as_bytes(scale_inv)]
    return [_as_bytes(piece.contiguous())]  # a row range of a contiguous tensor is already contiguous


class _Receiver:
    """This generator rank's runtime tensors, filled in place by the pieces as they arrive."""

    def __init__(self, plan: Plan, rank: int, dtype: torch.dtype):
        self.tensors: dict[str, torch.Tensor] = {}
        for name, shard in plan.runtime[rank].items():
            if name in plan.quantized_tensors:
                self.tensors[name] = torch.zeros(shard.shape, dtype=torch.float8_e4m3fn)
                self.tensors[name + SCALE_SUFFIX] = torch.zeros(scale_shape(shard.shape), dtype=torch.float32)
            else:
                self.tensors[name] = torch.zeros(shard.shape, dtype=dtype)  # padding rows stay zero
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _target(self, view: torch.Tensor) -> torch.Tensor:
        if view.is_contiguous():
            return _as_bytes(view)
        staging = torch.empty(view.shape, dtype=view.dtype)
        self._pending.append((view, staging))
        return _as_bytes(staging)

    def buffers(self, p: Piece) -> list[torch.Tensor]:
        target = self.tensors[p.dst_tensor]
        dim = p.dim if target.dim() > 1 else 0
        out = [self._target(target.narrow(dim, p.dst_offset, p.length))]
        if p.quantize:
            scales = self.tensors[p.dst_tensor + SCALE_SUFFIX]
            out.append(self._target(scales.narrow(dim, p.dst_offset // BLOCK, -(-p.length // BLOCK))))
        return out

    def finish_round(self) -> None:
        for view, staging in self._pending:
            view.copy_(staging)
        self._pending.clear()


def _round(k: int, buckets: dict, rank: int, plan: Plan, trainer_tensors, receiver: _Receiver | None,
           debug_checksums: bool):
    """Round k's sends, receives and (with debug_checksums) checks for this rank."""
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    checks: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []
    for (src, dst), chunks in buckets.items():
        if k >= len(chunks):
            continue
        if src == rank:
            bufs = [b for p in chunks[k] for b in _send_buffers(p, trainer_tensors, plan.trainer.dtype_bytes)]
            sends += [(dst, b) for b in bufs]
            if debug_checksums:
                sends.append((dst, _checksum(bufs)))
        else:
            bufs = [b for p in chunks[k] for b in receiver.buffers(p)]
            recvs += [(src, b) for b in bufs]
            if debug_checksums:
                check = torch.empty(CHECKSUM_BYTES, dtype=torch.uint8)
                recvs.append((src, check))
                checks.append((src, bufs, check))
    return sends, recvs, checks


def publish(plan: Plan, rank: int, version: int, trainer_tensors: dict[str, torch.Tensor] | None = None,
            engine=None, transport: Transport | None = None, bucket_bytes: int = 256 * 2**20,
            debug_checksums: bool = False, dtype: torch.dtype = torch.float32,
            background: bool = False) -> SyncStats | Transfer:
    """Run the plan's transfers that involve `rank`. Trainer ranks give `trainer_tensors` (their Megatron
    parameters by local name); generator ranks give `engine` (begin/load/end_weight_update).

    `background`: a rank that only sends posts every round at once and returns the `Transfer` instead of
    waiting, so that a trainer goes on (the next batch's forward and backward) while its generators reach a
    step boundary and receive; it must `wait()` before it next changes the parameters."""
    transport = transport or TorchDistTransport()
    start = time.perf_counter()
    buckets, rounds = _schedule(plan, rank, bucket_bytes)
    is_generator = rank in plan.runtime
    if background and not is_generator:
        return transport.start([s for k in range(rounds)
                                for s in _round(k, buckets, rank, plan, trainer_tensors, None, debug_checksums)[0]], [])
    receiver = _Receiver(plan, rank, dtype) if is_generator else None
    sent0, recv0 = transport.bytes_sent, transport.bytes_received
    checksum_bytes = 0
    if is_generator:
        engine.begin_weight_update()
    try:
        for k in range(rounds):
            sends, recvs, checks = _round(k, buckets, rank, plan, trainer_tensors, receiver, debug_checksums)
            transport.start(sends, recvs).wait()
            for src, bufs, check in checks:
                checksum_bytes += CHECKSUM_BYTES
                if not torch.equal(_checksum(bufs), check):
                    raise DDMAError(f"checksum mismatch in a bucket from rank {src} (round {k})")
            if receiver is not None:
                receiver.finish_round()
        got = transport.bytes_received - recv0 - checksum_bytes
        if is_generator and got != plan.bytes_received(rank):
            raise DDMAError(f"rank {rank} received {got} bytes, the plan says {plan.bytes_received(rank)}")
        if is_generator:
            engine.load_weights(receiver.tensors.items(), copy=False)
            engine.end_weight_update(version)
    except BaseException:
        if is_generator:
            engine.abort_weight_update()
        raise
    return SyncStats(version, time.perf_counter() - start, transport.bytes_sent - sent0,
                     transport.bytes_received - recv0, rounds)
