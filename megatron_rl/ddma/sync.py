"""Executing a DDMA plan: versioned, atomic publication of new weights to the generators, in bounded rounds.

Every rank in the plan calls `publish` with the same plan and version (trainer ranks pass their Megatron
shards; generator ranks pass their engine). `schedule` cuts the plan into rounds, the same on every rank (a pure
function of the plan): each (sender, receiver) pair's pieces become messages (one piece, or small pieces bound for
adjacent rows of one tensor sent together, `MERGE_MAX_BYTES`), and each message goes to the earliest round in which
neither its sender nor its receiver would move more than `bucket_bytes` (a message larger than that has a round of
its own). A rank posts its rounds in order, each as one `batch_isend_irecv` (one NCCL group), with at most
`ROUNDS_IN_FLIGHT` posted and not finished: so at most that many buckets of a rank's bytes are in flight, and the
buffers a sender built for a round (FP8 quantization, merged pieces, column ranges) are released when it finishes.
Deadlock-free: every rank posts in round order, so the lowest unfinished round always has all its messages posted.
Messages are views of the trainer's tensors where a row range is contiguous, and land in the generator's tensors.

A generator brackets the transfer with begin/end_weight_update and hands the engine each runtime tensor in the
round its last piece arrived (`load_weights`). An engine that installs in buckets (`installs_in_buckets`: SGLang on
GPUs, through CUDA IPC) also gets `commit_bucket()` calls at the same rounds on every rank of its replica
(`Schedule.commits`), after which it no longer needs the tensors it was given: a generator rank then holds at most
about a bucket of new weights besides what its engine serves. Only after the last round, with every byte known to
have arrived (the transport's `wait` synchronizes with the device on NCCL) and the byte count (and, with
`debug_checksums`, a checksum per pair and round) checked, does the engine serve the new version; on any failure
the update is aborted and the version is not bumped.

A generator rank whose engine allows it (`reusable_receive_buffers`: the built-in engine) receives into one of two
sets of runtime tensors allocated once, on its device, and kept with the plan: the engine serves one set while the
next update arrives in the other, and a successful update makes the received set the serving one (a failed one
leaves both roles as they were). Other engines get fresh tensors, made as their first piece arrives.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterable

import torch

from megatron_rl.ddma.plan import Piece, Plan, piece_nbytes
from megatron_rl.ddma.transport import TorchDistTransport, Transfer, Transport
from megatron_rl.models.fp8 import BLOCK, SCALE_SUFFIX, quantize_block_fp8, scale_shape
from megatron_rl.runtime import failpoints

CHECKSUM_BYTES = 8
ROUNDS_IN_FLIGHT = 2  # a rank posts the next round while the previous one moves


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


def _messages(pieces: list[Piece], order: dict[str, int], bucket: int) -> list[Message]:
    """One pair's pieces as messages of at most `bucket` bytes where merged, in the receiver's tensor order
    (`order`: runtime name -> index)."""
    out: list[Message] = []
    for p in sorted(pieces, key=lambda p: (order[p.dst_tensor], p.dst_offset)):
        if out and _mergeable(out[-1][-1], p) and message_bytes(out[-1]) + p.nbytes <= bucket:
            out[-1] += (p,)
        else:
            out.append((p,))
    return out


def message_bytes(m: Message) -> int:
    return sum(p.nbytes for p in m)


@dataclasses.dataclass
class RankRound:
    """One rank's part of a round: its messages to send and to receive, each with its peer, in the order both
    ends of every pair post them."""

    index: int
    sends: list[tuple[int, Message]] = dataclasses.field(default_factory=list)
    recvs: list[tuple[int, Message]] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(message_bytes(m) for _, m in self.sends) + sum(message_bytes(m) for _, m in self.recvs)


class Schedule:
    """The plan in rounds for one bucket size (see the module docstring), computed per rank when first asked (a
    rank needs only its own pairs, and a generator rank those of its replica): `rounds(r)`, rank r's rounds;
    `completes(g)`, round -> generator rank g's runtime tensors whose last piece arrives in it; `commits(g)`, the
    rounds after which g's engine commits a bucket, the same for every rank of a replica (after each round in which
    a rank of the replica has completed `bucket_bytes` since the last commit).

    Each pair's messages are cut into buckets of `pair_bucket(src, dst)` = bucket_bytes / the larger of the two
    ranks' peer counts, and round k moves bucket k of every pair: so no rank moves more than bucket_bytes in a
    round (an FP8 block row larger than a pair's bucket travels whole), and both ends of a pair agree on its rounds
    from the plan alone."""

    def __init__(self, plan: Plan, bucket_bytes: int):
        self.plan, self.bucket_bytes = plan, bucket_bytes
        self._peers = {r: len({p.dst for p in ps["send"]} | {p.src for p in ps["recv"]})
                       for r, ps in plan.by_rank.items()}
        self._orders = {g: {name: i for i, name in enumerate(tensors)} for g, tensors in plan.runtime.items()}
        self._rounds: dict[int, list[RankRound]] = {}
        self._completes: dict[int, dict[int, list[str]]] = {}
        self._commits: dict[int, list[int]] = {}

    def pair_bucket(self, src: int, dst: int) -> int:
        return max(self.bucket_bytes // max(self._peers[src], self._peers[dst]), 1)

    def _pair_buckets(self, src: int, dst: int, pieces: list[Piece]) -> list[list[Message]]:
        limit = self.pair_bucket(src, dst)
        split = [q for p in pieces for q in _split(p, limit, self.plan.trainer.dtype_bytes)]
        out: list[list[Message]] = [[]]
        size = 0
        for m in _messages(split, self._orders[dst], limit):
            n = message_bytes(m)
            if out[-1] and size + n > limit:
                out.append([])
                size = 0
            out[-1].append(m)
            size += n
        return out

    def rounds(self, rank: int) -> list[RankRound]:
        if rank not in self._rounds:
            pairs: dict[tuple[int, int], list[Piece]] = defaultdict(list)
            for p in self.plan.sends(rank) + self.plan.recvs(rank):
                pairs[(p.src, p.dst)].append(p)
            by_round: dict[int, RankRound] = {}
            for (src, dst), pieces in sorted(pairs.items()):
                for k, bucket in enumerate(self._pair_buckets(src, dst, pieces)):
                    rr = by_round.setdefault(k, RankRound(k))
                    if src == rank:
                        rr.sends += [(dst, m) for m in bucket]
                    else:
                        rr.recvs += [(src, m) for m in bucket]
            self._rounds[rank] = [by_round[k] for k in sorted(by_round)]
        return self._rounds[rank]

    def completes(self, g: int) -> dict[int, list[str]]:
        if g not in self._completes:
            last: dict[str, int] = {}
            for rr in self.rounds(g):
                for _, m in rr.recvs:
                    last[m[0].dst_tensor] = rr.index
            out: dict[int, list[str]] = defaultdict(list)
            for name in self.plan.runtime[g]:
                out[last.get(name, 0)].append(name)
            self._completes[g] = dict(out)
        return self._completes[g]

    def commits(self, g: int) -> list[int]:
        if g not in self._commits:
            layout = self.plan.generator
            replica = layout.replica_of(g)
            members = [layout.rank(replica, j) for j in range(layout.tensor_parallel_size)]
            completes = {m: self.completes(m) for m in members}
            last = max((k for c in completes.values() for k in c), default=0)
            pending, commits = dict.fromkeys(members, 0), []
            for k in range(last + 1):
                for m in members:
                    pending[m] += sum(self.plan.tensor_bytes(m, n) for n in completes[m].get(k, []))
                if max(pending.values()) >= self.bucket_bytes:
                    commits.append(k)
                    pending = dict.fromkeys(members, 0)
            for m in members:
                self._commits[m] = commits
        return self._commits[g]

    def receive_peak(self, g: int, bucketed: bool) -> int:
        """The most memory generator rank g holds for one update that it receives into fresh tensors (an engine
        without `reusable_receive_buffers`): a runtime tensor is allocated when the round of its first piece is
        posted and is the engine's until its commit (`bucketed`: the first of `commits(g)` at or after the round
        of its last piece; else the end of the update); besides, staging for column pieces within the rounds in
        flight (`in_flight_bound`, an upper bound)."""
        first: dict[str, int] = {}
        for rr in self.rounds(g):
            for _, m in rr.recvs:
                first.setdefault(m[0].dst_tensor, rr.index)
        commits = self.commits(g) if bucketed else []
        last = {name: k for k, names in self.completes(g).items() for name in names}
        freed = {name: next((c for c in commits if c >= last[name]), math.inf) for name in first}
        held = [sum(self.plan.tensor_bytes(g, n) for n, k0 in first.items() if k0 <= rr.index <= freed[n])
                for rr in self.rounds(g)]
        return max(held, default=0) + self.in_flight_bound(g)

    def in_flight_bound(self, rank: int) -> int:
        """The most bytes `rank` has posted and not finished at any time: its largest ROUNDS_IN_FLIGHT consecutive
        rounds."""
        sizes = [r.nbytes for r in self.rounds(rank)]
        return max((sum(sizes[i:i + ROUNDS_IN_FLIGHT]) for i in range(len(sizes))), default=0)


def schedule(plan: Plan, bucket_bytes: int) -> Schedule:
    """The plan's rounds for this bucket size, kept with the plan (every rank computes the same)."""
    if bucket_bytes < 1:
        raise ValueError(f"--ddma-bucket-mb must be positive, got {bucket_bytes} bytes")
    if bucket_bytes not in plan.schedules:
        plan.schedules[bucket_bytes] = Schedule(plan, bucket_bytes)
    return plan.schedules[bucket_bytes]


def _split(p: Piece, bucket: int, dtype_bytes: int) -> list[Piece]:
    """`p` as pieces of at most `bucket` bytes where it can be cut: along its dim, at whole FP8 blocks when it is
    quantized (a piece whose unit is larger than a bucket stays whole)."""
    unit = BLOCK if p.quantize else 1
    step = max(unit, bucket // max(p.row_numel * (1 if p.quantize else dtype_bytes), 1) // unit * unit)
    while step > unit and piece_nbytes(step, p.row_numel, p.quantize, dtype_bytes) > bucket:
        step -= unit  # FP8 scales
    if p.nbytes <= bucket or step >= p.length:
        return [p]
    return [dataclasses.replace(p, src_offset=p.src_offset + a, dst_offset=p.dst_offset + a, length=n,
                                nbytes=piece_nbytes(n, p.row_numel, p.quantize, dtype_bytes))
            for a in range(0, p.length, step) for n in [min(step, p.length - a)]]


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


def _send_buffers(message: Message, tensors: dict[str, torch.Tensor], dtype_bytes: int) -> list[torch.Tensor]:
    """The buffers that carry `message`: a view of the trainer's tensor (a row range of a contiguous tensor is
    contiguous), or a buffer built for this round: merged small pieces, a column range, an FP8 quantization."""
    if len(message) > 1:
        return [_as_bytes(torch.cat([_source_piece(p, tensors, dtype_bytes) for p in message]))]
    p, = message
    piece = _source_piece(p, tensors, dtype_bytes)
    if p.quantize:
        q, scale_inv = quantize_block_fp8(piece)
        return [_as_bytes(q), _as_bytes(scale_inv)]
    return [_as_bytes(piece.contiguous())]


class _Receiver:
    """One set of this generator rank's runtime tensors, filled in place by the pieces as they arrive. `keep`:
    every tensor is allocated now and kept, with the byte views of each message, for the next update (the built-in
    engine's two sets); otherwise each tensor is allocated when its first piece arrives and handed over by `take`.
    Padding rows stay zero: no piece writes them."""

    def __init__(self, plan: Plan, rank: int, dtype: torch.dtype, device: torch.device, keep: bool):
        self.plan, self.rank, self.dtype, self.device, self.keep = plan, rank, dtype, device, keep
        self.tensors: dict[str, torch.Tensor] = {}
        self._views: dict[Message, tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        if keep:
            for name in plan.runtime[rank]:
                self._allocate(name)

    def _allocate(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            shard = self.plan.runtime[self.rank][name]
            if name in self.plan.quantized_tensors:
                self.tensors[name] = torch.zeros(shard.shape, dtype=torch.float8_e4m3fn, device=self.device)
                self.tensors[name + SCALE_SUFFIX] = torch.zeros(scale_shape(shard.shape), dtype=torch.float32,
                                                                device=self.device)
            else:
                self.tensors[name] = torch.zeros(shard.shape, dtype=self.dtype, device=self.device)
        return self.tensors[name]

    def _views_of(self, message: Message) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        p = message[0]
        target = self._allocate(p.dst_tensor)
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

    def buffers(self, message: Message, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """The buffers `message` lands in; adds the (view, staging buffer) pairs to copy once it arrived to
        `staged`."""
        views = self._views.get(message) or self._views_of(message)
        if self.keep:
            self._views[message] = views
        buffers, copies = views
        staged += copies
        return buffers

    def take(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """The complete tensors `names` (with their FP8 scales), to give to the engine; a set that is not kept
        forgets them. An FP8 weight that arrived in the trainer's dtype is quantized here (block FP8, as the
        sender quantizes aligned ones), so that no engine installs dense values into an FP8 parameter."""
        out = []
        for name in names:
            for n in (name, name + SCALE_SUFFIX):
                if n in self.tensors:
                    out.append((n, self.tensors[n] if self.keep else self.tensors.pop(n)))
            if self.plan.quantized_on_receipt(name):
                values, scale_inv = quantize_block_fp8(out.pop()[1])
                out += [(name, values), (name + SCALE_SUFFIX, scale_inv)]
        return out


class _ReceiveBuffers:
    """The two receive sets of a generator rank: the engine serves one (`serving`), updates arrive in the other."""

    def __init__(self, plan: Plan, rank: int, dtype: torch.dtype, device: torch.device):
        self.sets = [_Receiver(plan, rank, dtype, device, True), _Receiver(plan, rank, dtype, device, True)]
        self.serving: _Receiver | None = None

    def free(self) -> _Receiver:
        return self.sets[1] if self.serving is self.sets[0] else self.sets[0]

    @classmethod
    def of(cls, plan: Plan, rank: int, dtype: torch.dtype, device: torch.device) -> _ReceiveBuffers:
        key = ("receive", rank, dtype, torch.device(device))
        if key not in plan.buffers:
            plan.buffers[key] = cls(plan, rank, dtype, device)
        return plan.buffers[key]


@dataclasses.dataclass
class _Posted:
    round: RankRound
    transfer: Transfer
    checks: list[tuple[int, list[torch.Tensor], torch.Tensor]]
    staged: list[tuple[torch.Tensor, torch.Tensor]]  # column ranges: (the view, its staging buffer)


def _post(rr: RankRound, plan: Plan, transport: Transport, trainer_tensors, receiver: _Receiver | None,
          debug_checksums: bool) -> _Posted:
    """Build this rank's buffers of one round and post them at once."""
    sends: list[tuple[int, torch.Tensor]] = []
    recvs: list[tuple[int, torch.Tensor]] = []
    checks: list[tuple[int, list[torch.Tensor], torch.Tensor]] = []
    by_peer: dict[int, list[torch.Tensor]] = defaultdict(list)
    for dst, m in rr.sends:
        bufs = _send_buffers(m, trainer_tensors, plan.trainer.dtype_bytes)
        sends += [(dst, b) for b in bufs]
        by_peer[dst] += bufs
    if debug_checksums:  # after the pair's messages of this round, on both ends
        sends += [(dst, _checksum(bufs)) for dst, bufs in by_peer.items()]
    by_peer, staged = defaultdict(list), []
    for src, m in rr.recvs:
        bufs = receiver.buffers(m, staged)
        recvs += [(src, b) for b in bufs]
        by_peer[src] += bufs
    if debug_checksums:
        for src, bufs in by_peer.items():
            check = torch.empty(CHECKSUM_BYTES, dtype=torch.uint8, device=receiver.device)
            recvs.append((src, check))
            checks.append((src, bufs, check))
    return _Posted(rr, transport.start(sends, recvs), checks, staged)


def _finish(posted: _Posted) -> int:
    """Wait for a posted round and check it; returns the checksum bytes it received."""
    posted.transfer.wait()
    for src, bufs, check in posted.checks:
        if not torch.equal(_checksum(bufs), check):
            raise DDMAError(f"checksum mismatch in the bytes from rank {src} (round {posted.round.index})")
    for view, staging in posted.staged:
        view.copy_(staging)
    return CHECKSUM_BYTES * len(posted.checks)


def _send_all(rounds: list[RankRound], plan: Plan, transport: Transport, trainer_tensors,
              debug_checksums: bool) -> None:
    in_flight: collections.deque[_Posted] = collections.deque()
    for rr in rounds:
        if len(in_flight) == ROUNDS_IN_FLIGHT:
            _finish(in_flight.popleft())
        in_flight.append(_post(rr, plan, transport, trainer_tensors, None, debug_checksums))
    while in_flight:
        _finish(in_flight.popleft())


class SideStream:
    """The CUDA stream of a trainer rank's background publishes. The training stream records `ready` once the
    parameters hold the weights to publish (after the optimizer step); the publish's thread makes this stream
    current, has it wait for `ready`, and builds its send buffers (FP8 quantization, merged pieces) and posts its
    transfers there, so NCCL's waits for the generators land on this stream. The host waits for this stream alone
    (`Transfer.wait`): the training stream, with the next forward and backward and their TP and DP collectives,
    never waits for a generator."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.ready = torch.cuda.Event()

    def record_ready(self) -> None:
        """On the training thread: the publish reads the parameters as the training stream's work so far left them."""
        self.ready.record(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def current(self, tensors: Iterable[torch.Tensor]):
        """On the publishing thread: this stream is current and ordered after `ready`. The trainer's `tensors`,
        allocated on the training stream, are marked as used on this one (`record_stream`), so that the caching
        allocator does not give their memory to another tensor while this stream may still read them."""
        torch.cuda.set_device(self.device)  # the current device is per thread
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.ready)
            for tensor in tensors:
                tensor.record_stream(self.stream)
            yield


class BackgroundSend:
    """A trainer rank's sends of one publish, run by a thread (rounds in order, bounded as in the foreground), so
    that the trainer goes on; `wait` joins it and raises what it raised. On a GPU the sends run on `stream`
    (`SideStream`), ordered after the training stream's work at the time of the call."""

    def __init__(self, rounds, plan, transport, trainer_tensors, debug_checksums, stream: SideStream | None):
        self.error: BaseException | None = None
        if stream is not None:
            stream.record_ready()

        def run():
            try:
                with stream.current(trainer_tensors.values()) if stream is not None else contextlib.nullcontext():
                    _send_all(rounds, plan, transport, trainer_tensors, debug_checksums)
            except BaseException as e:  # noqa: BLE001 - raised by wait()
                self.error = e

        self.thread = threading.Thread(target=run, name="ddma-send", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def publish(plan: Plan, rank: int, version: int, trainer_tensors: dict[str, torch.Tensor] | None = None,
            engine=None, transport: Transport | None = None, bucket_bytes: int = 256 * 2**20,
            debug_checksums: bool = False, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
            background: bool = False, stream: SideStream | None = None) -> SyncStats | BackgroundSend:
    """Run the plan's transfers that involve `rank`. Trainer ranks give `trainer_tensors` (their Megatron
    parameters by local name, on their device); generator ranks give `engine` (begin/load/end_weight_update),
    and receive into tensors of `dtype` on `device`. The engine takes the received tensors without copying
    them and must not change them.

    `background`: a rank that only sends runs its rounds on a thread and returns at once (a `BackgroundSend`), so
    that a trainer goes on (the next batch's forward and backward) while its generators reach a step boundary and
    receive; it must `wait()` before it next changes the parameters. A trainer on a GPU gives its `SideStream`."""
    transport = transport or TorchDistTransport()
    start = time.perf_counter()
    plan_rounds = schedule(plan, bucket_bytes)
    rounds = plan_rounds.rounds(rank)
    is_generator = rank in plan.runtime
    if not is_generator:
        sent0 = transport.bytes_sent
        if background:
            return BackgroundSend(rounds, plan, transport, trainer_tensors, debug_checksums, stream)
        _send_all(rounds, plan, transport, trainer_tensors, debug_checksums)
        return SyncStats(version, time.perf_counter() - start, transport.bytes_sent - sent0, 0, len(rounds))
    pair = None
    if engine.reusable_receive_buffers:
        pair = _ReceiveBuffers.of(plan, rank, dtype, device)
        receiver = pair.free()
    else:
        receiver = _Receiver(plan, rank, dtype, device, keep=False)
    sent0, recv0 = transport.bytes_sent, transport.bytes_received
    completes, checksum_bytes = plan_rounds.completes(rank), 0
    commits = collections.deque(plan_rounds.commits(rank) if getattr(engine, "installs_in_buckets", False) else [])
    engine.begin_weight_update()
    try:
        in_flight: collections.deque[_Posted] = collections.deque()
        loaded = 0  # the engine has the tensors completed in rounds [0, loaded)

        def load_through(upto: int) -> None:
            nonlocal loaded
            names = [n for k in range(loaded, upto) for n in completes.get(k, [])]
            loaded = max(loaded, upto)
            if names:
                engine.load_weights(receiver.take(names), copy=False)

        def finish_next() -> None:
            nonlocal checksum_bytes
            posted = in_flight.popleft()
            checksum_bytes += _finish(posted)
            load_through(posted.round.index + 1)  # this rank's rounds finish in order
            failpoints.crash("publish", version)

        def commit_before(k: int) -> None:
            while commits and commits[0] < k:
                last = commits.popleft()
                while in_flight and in_flight[0].round.index <= last:
                    finish_next()
                load_through(last + 1)
                engine.commit_bucket()

        for rr in rounds:
            commit_before(rr.index)
            if len(in_flight) == ROUNDS_IN_FLIGHT:
                finish_next()
            in_flight.append(_post(rr, plan, transport, None, receiver, debug_checksums))
        commit_before(float("inf"))  # the replica's later commits too: its engines commit together
        while in_flight:
            finish_next()
        load_through(max(completes, default=0) + 1)
        got = transport.bytes_received - recv0 - checksum_bytes
        if got != plan.bytes_received(rank):
            raise DDMAError(f"rank {rank} received {got} bytes, the plan says {plan.bytes_received(rank)}")
        engine.end_weight_update(version)
        if pair is not None:
            pair.serving = receiver
    except BaseException:
        engine.abort_weight_update()
        raise
    return SyncStats(version, time.perf_counter() - start, transport.bytes_sent - sent0,
                     transport.bytes_received - recv0, len(rounds))
