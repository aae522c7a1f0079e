"""Executing a DDMA plan: versioned, atomic publication of new weights to the generators.

Every rank in the plan calls `publish` with the same plan and version (trainer ranks pass their Megatron
shards; generator ranks pass their engine). Pieces travel in rounds: each (sender, receiver) pair's pieces
are grouped into buckets of at most `bucket_bytes`, and round k moves bucket k of every pair at once, one
message per piece, straight from the trainer's tensor into the generator's (a row range of a contiguous
tensor is contiguous; only column ranges of row-parallel weights are staged), except that small pieces bound for
adjacent rows of one tensor are sent together (`MERGE_MAX_BYTES`).
A generator brackets the transfer with begin/end_weight_update, checks that it received exactly the planned
bytes (and, with `debug_checksums`, a checksum per bucket), and only then serves the new version; on any
failure the update is aborted and the previous version keeps serving.

A generator rank whose engine allows it (`reusable_receive_buffers`: the built-in engine) receives into one of two
sets of runtime tensors allocated once, on its device, and kept with the plan: the engine serves one set while the
next update arrives in the other, and a successful update makes the received set the serving one (a failed one
leaves both roles as they were). Nothing is allocated, zeroed or copied per update on the receiving side except the
staging of non-contiguous pieces. An engine that hands the tensors to another process (SGLang, through shared
memory) gets fresh ones at every update.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import torch

from megatron_rl.ddma.plan import Piece, Plan
from megatron_rl.ddma.transport import TorchDistTransport, Transfer, Transport
from megatron_rl.models.fp8 import BLOCK, SCALE_SUFFIX, quantize_block_fp8, scale_shape
from megatron_rl.runtime import failpoints

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


# Pieces smaller than this whose destinations are adjacent rows of one tensor (a fused QKV's per-group q, k and v
# pieces, say) travel as one message: the sender copies them together, the receiver takes them in place. Each
# message costs a round trip of the transport, so hundreds of small ones are slower than the copy.
MERGE_MAX_BYTES = 2**20

Message = tuple[Piece, ...]  # pieces that travel as one buffer (one piece, or several with adjacent destinations)


def _mergeable(a: Piece, b: Piece) -> bool:
    return (a.dst_tensor == b.dst_tensor and a.dim == b.dim == 0 and not (a.quantize or b.quantize)
            and a.dst_offset + a.length == b.dst_offset and max(a.nbytes, b.nbytes) < MERGE_MAX_BYTES)


def _built_by_sender(m: Message) -> bool:
    """Whether the sender builds this message's buffer (merged pieces, a column range, FP8 quantization) rather than
    sending a view of its tensor."""
    return len(m) > 1 or m[0].quantize or m[0].dim != 0


def _messages(pieces: list[Piece]) -> list[Message]:
    """One pair's pieces as messages (both ends of the pair compute the same list): the views of the sender's
    tensors first, so that they are on the wire while the sender builds the others."""
    out: list[Message] = []
    for p in sorted(pieces, key=lambda p: (p.dst_tensor, p.dst_offset)):
        if out and _mergeable(out[-1][-1], p):
            out[-1] += (p,)
        else:
            out.append((p,))
    return sorted(out, key=_built_by_sender)


def _buckets(messages: list[Message], bucket_bytes: int) -> list[list[Message]]:
    out: list[list[Message]] = [[]]
    size = 0
    for m in messages:
        nbytes = sum(p.nbytes for p in m)
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(m)
        size += nbytes
    return out


def _schedule(plan: Plan, rank: int, bucket_bytes: int) -> tuple[dict[tuple[int, int], list[list[Message]]], int]:
    """This rank's (sender, receiver) pairs, each cut into buckets of messages. Only the two ends of a pair must
    agree on its buckets (they do: both cut the same piece list), so each rank schedules its own pairs, once per
    plan."""
    key = (rank, bucket_bytes)
    if key not in plan.schedules:
        pairs: dict[tuple[int, int], list[Piece]] = defaultdict(list)
        for p in plan.sends(rank) + plan.recvs(rank):
            pairs[(p.src, p.dst)].append(p)
        buckets = {pair: _buckets(_messages(pieces), bucket_bytes) for pair, pieces in pairs.items()}
        plan.schedules[key] = (buckets, max((len(b) for b in buckets.values()), default=0))
    return plan.schedules[key]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _checksum(buffers: list[torch.Tensor]) -> torch.Tensor:
    total = sum(int(b.to(torch.int64).sum()) for b in buffers)
    return torch.tensor([total], dtype=torch.int64, device=buffers[0].device).view(torch.uint8)


def _source_piece(p: Piece, tensors: dict[str, torch.Tensor], dtype_bytes: int) -> torch.Tensor:
    source = tensors[p.src_tensor].detach()
    if source.element_size() != dtype_bytes:
        raise DDMAError(f"trainer tensor {p.src_tensor!r} has {source.element_size()}-byte elements; the plan "
                        f"assumed {dtype_bytes}")
    return source.narrow(p.dim if source.dim() > 1 else 0, p.src_offset, p.length)


def _send_buffers(message: Message, tensors: dict[str, torch.Tensor], dtype_bytes: int,
                  staging: dict[Message, torch.Tensor]) -> list[torch.Tensor]:
    """The buffers that carry `message`: a view of the trainer's tensor, or (merged small pieces) a staging buffer
    of this rank's, reused at every publish (the previous publish's sends have completed by then)."""
    if len(message) > 1:
        parts = [_source_piece(p, tensors, dtype_bytes) for p in message]
        if message not in staging:
            staging[message] = torch.empty((sum(t.shape[0] for t in parts), *parts[0].shape[1:]),
                                           dtype=parts[0].dtype, device=parts[0].device)
        return [_as_bytes(torch.cat(parts, out=staging[message]))]
    p, = message
    piece = _source_piece(p, tensors, dtype_bytes)
    if p.quantize:
        q, scale_inv = quantize_block_fp8(piece)
        return [_as_bytes(q), _as_bytes(scale_inv)]
    return [_as_bytes(piece.contiguous())]  # a row range of a contiguous tensor is already contiguous


class _Receiver:
    """One set of this generator rank's runtime tensors, filled in place by the pieces as they arrive. The byte
    views (and staging buffers) of each piece are made on first use and kept: the set is reused update after
    update."""

    def __init__(self, plan: Plan, rank: int, dtype: torch.dtype, device: torch.device):
        self.device = device
        self.tensors: dict[str, torch.Tensor] = {}
        for name, shard in plan.runtime[rank].items():
            if name in plan.quantized_tensors:
                self.tensors[name] = torch.zeros(shard.shape, dtype=torch.float8_e4m3fn, device=device)
                self.tensors[name + SCALE_SUFFIX] = torch.zeros(scale_shape(shard.shape), dtype=torch.float32,
                                                                device=device)
            else:  # padding rows stay zero: no piece writes them
                self.tensors[name] = torch.zeros(shard.shape, dtype=dtype, device=device)
        self._views: dict[Message, tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _views_of(self, message: Message) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        p = message[0]
        target = self.tensors[p.dst_tensor]
        dim = p.dim if target.dim() > 1 else 0
        views = [target.narrow(dim, p.dst_offset, sum(q.length for q in message))]
        if p.quantize:
            scales = self.tensors[p.dst_tensor + SCALE_SUFFIX]
            views.append(scales.narrow(dim, p.dst_offset // BLOCK, -(-p.length // BLOCK)))
        buffers, staged = [], []
        for view in views:
            if view.is_contiguous():
                buffers.append(_as_bytes(view))
            else:  # a column range: received contiguously, then copied into place
                staging = torch.empty(view.shape, dtype=view.dtype, device=self.device)
                staged.append((view, staging))
                buffers.append(_as_bytes(staging))
        return buffers, staged

    def buffers(self, message: Message) -> list[torch.Tensor]:
        if message not in self._views:
            self._views[message] = self._views_of(message)
        buffers, staged = self._views[message]
        self._pending += staged
        return buffers

    def finish_round(self) -> None:
        for view, staging in self._pending:
            view.copy_(staging)
        self._pending.clear()


class _ReceiveBuffers:
    """The two receive sets of a generator rank: the engine serves one (`serving`), updates arrive in the other."""

    def __init__(self, plan: Plan, rank: int, dtype: torch.dtype, device: torch.device):
        self.sets = [_Receiver(plan, rank, dtype, device), _Receiver(plan, rank, dtype, device)]
        self.serving: _Receiver | None = None

    def free(self) -> _Receiver:
        receiver = self.sets[1] if self.serving is self.sets[0] else self.sets[0]
        receiver._pending.clear()  # left over by a failed update
        return receiver

    @classmethod
    def of(cls, plan: Plan, rank: int, dtype: torch.dtype, device: torch.device) -> _ReceiveBuffers:
        key = ("receive", rank, dtype, torch.device(device))
        if key not in plan.buffers:
            plan.buffers[key] = cls(plan, rank, dtype, device)
        return plan.buffers[key]


def _round(k: int, buckets: dict, rank: int, plan: Plan, trainer_tensors, receiver: _Receiver | None,
           debug_checksums: bool):
    """Round k for this rank: (sends of views of the trainer's tensors, a function that builds the other sends,
    receives, checks). Posting the views before building the rest overlaps the copies with the transfer; each pair's
    messages keep their order (views first, see `_messages`), so both ends still match them."""
    views: list[tuple[int, torch.Tensor]] = []
    to_build: list[tuple[int, list[Message], list[torch.Tensor]]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    checks: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []
    for (src, dst), chunks in buckets.items():
        if k >= len(chunks):
            continue
        if src == rank:
            direct = [m for m in chunks[k] if not _built_by_sender(m)]
            bufs = [b for m in direct for b in _send_buffers(m, trainer_tensors, plan.trainer.dtype_bytes, {})]
            views += [(dst, b) for b in bufs]
            to_build.append((dst, chunks[k][len(direct):], bufs))
        else:
            bufs = [b for m in chunks[k] for b in receiver.buffers(m)]
            recvs += [(src, b) for b in bufs]
            if debug_checksums:
                check = torch.empty(CHECKSUM_BYTES, dtype=torch.uint8, device=receiver.device)
                recvs.append((src, check))
                checks.append((src, bufs, check))

    def build() -> list[tuple[int, torch.Tensor]]:
        staging = plan.buffers.setdefault(("send", rank), {})
        sends = []
        for dst, messages, view_bufs in to_build:
            bufs = [b for m in messages for b in _send_buffers(m, trainer_tensors, plan.trainer.dtype_bytes, staging)]
            sends += [(dst, b) for b in bufs]
            if debug_checksums:
                sends.append((dst, _checksum(view_bufs + bufs)))
        return sends

    return views, build, recvs, checks


def publish(plan: Plan, rank: int, version: int, trainer_tensors: dict[str, torch.Tensor] | None = None,
            engine=None, transport: Transport | None = None, bucket_bytes: int = 256 * 2**20,
            debug_checksums: bool = False, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
            background: bool = False) -> SyncStats | Transfer:
    """Run the plan's transfers that involve `rank`. Trainer ranks give `trainer_tensors` (their Megatron
    parameters by local name, on their device); generator ranks give `engine` (begin/load/end_weight_update),
    and receive into tensors of `dtype` on `device`. The engine takes the received tensors without copying
    them and must not change them.

    `background`: a rank that only sends posts every round at once and returns the `Transfer` instead of
    waiting, so that a trainer goes on (the next batch's forward and backward) while its generators reach a
    step boundary and receive; it must `wait()` before it next changes the parameters."""
    transport = transport or TorchDistTransport()
    start = time.perf_counter()
    buckets, rounds = _schedule(plan, rank, bucket_bytes)
    is_generator = rank in plan.runtime
    if background and not is_generator:
        sends = []
        for k in range(rounds):
            views, build, _, _ = _round(k, buckets, rank, plan, trainer_tensors, None, debug_checksums)
            sends += views + build()
        return transport.start(sends, [])
    pair = receiver = None
    if is_generator and engine.reusable_receive_buffers:
        pair = _ReceiveBuffers.of(plan, rank, dtype, device)
        receiver = pair.free()
    elif is_generator:
        receiver = _Receiver(plan, rank, dtype, device)
    sent0, recv0 = transport.bytes_sent, transport.bytes_received
    checksum_bytes = 0
    if is_generator:
        engine.begin_weight_update()
    try:
        for k in range(rounds):
            views, build, recvs, checks = _round(k, buckets, rank, plan, trainer_tensors, receiver, debug_checksums)
            posted = transport.start(views, recvs)
            built = transport.start(build(), [])
            posted.wait()
            built.wait()
            for src, bufs, check in checks:
                checksum_bytes += CHECKSUM_BYTES
                if not torch.equal(_checksum(bufs), check):
                    raise DDMAError(f"checksum mismatch in a bucket from rank {src} (round {k})")
            if receiver is not None:
                receiver.finish_round()
            failpoints.crash("publish", version)
        got = transport.bytes_received - recv0 - checksum_bytes
        if is_generator and got != plan.bytes_received(rank):
            raise DDMAError(f"rank {rank} received {got} bytes, the plan says {plan.bytes_received(rank)}")
        if is_generator:
            engine.load_weights(receiver.tensors.items(), copy=False)
            engine.end_weight_update(version)
            if pair is not None:
                pair.serving = receiver
    except BaseException:
        if is_generator:
            engine.abort_weight_update()
        raise
    return SyncStats(version, time.perf_counter() - start, transport.bytes_sent - sent0,
                     transport.bytes_received - recv0, rounds)
