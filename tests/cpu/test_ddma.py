"""DDMA on real gloo processes: after a sync every generator rank's runtime tensors are bit-equal to the HF
weights sliced the SGLang way (FP8: bit-equal to the block-FP8 quantization of that slice), no rank moves
more bytes than planned, and layouts the generator cannot take fail at planning time.

Trainer ranks hold exactly their Megatron shards (built through `models.weight_map`, which tests/cpu/test_trainer.py
and tests/cpu/test_megatron_cpu.py check against real Megatron-Core parameters); generator ranks are real
LocalEngines receiving through `publish`. One 8-process launch runs every layout combination."""

import itertools

import pytest
import torch
from helpers import ROOT, mismatched_generator_tensors, random_hf_weights

from megatron_rl.ddma.plan import make_plan, summarize
from megatron_rl.ddma.sync import ROUNDS_IN_FLIGHT, message_bytes, schedule
from megatron_rl.models import weight_map
from megatron_rl.models.fp8 import SCALE_SUFFIX, quantize_block_fp8
from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks

TINY = get_model_spec("tiny-llama").replace(name="tiny-v200", vocab_size=200)  # FP8: receiver quantizes
ALIGNED = get_model_spec("tiny-qwen2").replace(name="aligned", hidden_size=256, num_attention_heads=2,
                                               num_key_value_heads=2, ffn_hidden_size=256, vocab_size=256)
TRAINERS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2)]
GENERATORS = [(1, 1), (2, 1), (1, 2), (2, 2)]
CASES = [(TINY, t, g, False) for t, g in itertools.product(TRAINERS, GENERATORS)] + \
        [(spec, (2, 2, 1), g, True) for spec in (TINY, ALIGNED) for g in ((2, 1), (1, 2))]


def _sync_all_cases(cases):
    import torch.distributed as dist

    from megatron_rl.ddma.sync import publish
    from megatron_rl.ddma.transport import TorchDistTransport
    from megatron_rl.rollout.local.decoder import TPDecoder
    from megatron_rl.rollout.local.engine import LocalEngine

    class InFlightTransport(TorchDistTransport):
        """Counts the bytes posted and not yet waited for, and the most there were at once."""

        def __init__(self):
            super().__init__()
            self.posted = self.most = 0

        def start(self, sends, recvs):
            transfer = super().start(sends, recvs)
            nbytes = sum(b.numel() for _, b in sends + recvs)
            self.posted += nbytes
            self.most = max(self.most, self.posted)
            wait = transfer.wait

            def counted_wait():
                wait()
                self.posted -= nbytes

            transfer.wait = counted_wait
            return transfer

    rank = dist.get_rank()
    report = []
    for case, (spec, (tp, pp, dp), (gtp, replicas), fp8) in enumerate(cases):
        trainer = TrainerLayout(tp, pp, dp, dtype_bytes=4)
        generator = GeneratorLayout(gtp, replicas, fp8=fp8, first_rank=trainer.world_size)
        plan = make_plan(spec, trainer, generator)
        hf = random_hf_weights(spec, seed=case)
        transport = InFlightTransport()
        result = {"case": case, "rank": rank}
        if rank < trainer.world_size:
            my_tp, my_pp = rank % tp, rank // (tp * dp)
            shards = weight_map.megatron_shards(spec, trainer, my_tp, my_pp)
            tensors = {n: weight_map.assemble(s, weight_map.slicer(hf)) for n, s in shards.items()}
            # Every other case the trainer posts its sends in the background (as the RL loop does) and waits later.
            done = publish(plan, rank, version=case + 1, trainer_tensors=tensors, transport=transport,
                           bucket_bytes=4096, debug_checksums=True, background=case % 2 == 1)
            if case % 2 == 1:
                done.wait()
        elif rank < trainer.world_size + generator.world_size:
            j = (rank - generator.first_rank) % gtp
            engine = LocalEngine(TPDecoder(spec, gtp, j, None, fp8=fp8))
            publish(plan, rank, version=case + 1, engine=engine, transport=transport, bucket_bytes=4096,
                    debug_checksums=True)
            mismatched = mismatched_generator_tensors(engine, spec, hf, gtp, j)
            result.update(mismatched=mismatched, version=engine.weight_version,
                          fp8_tensors=sum(t.dtype == torch.float8_e4m3fn for t in engine.decoder.params.values()))
        result.update(sent=transport.bytes_sent, received=transport.bytes_received, most_in_flight=transport.most,
                      in_flight_bound=schedule(plan, 4096).in_flight_bound(rank),
                      planned_sent=plan.bytes_sent(rank), planned_received=plan.bytes_received(rank),
                      buckets=sum(1 for p in plan.pieces if rank in (p.src, p.dst)))
        report.append(result)
        dist.barrier()
    return report


class _RecordingStream:
    """Stands in for `ddma.sync.SideStream` on a CPU: records which thread did what, and whether the stream was
    current, so that the test sees the order a GPU would be given."""

    def __init__(self):
        import threading

        self.log: list[tuple[str, str]] = []
        self.is_current = False
        self.marked: set[str] = set()
        self._thread = threading.current_thread

    def record_ready(self):
        self.log.append((self._thread().name, "record ready on the training stream"))

    def current(self, tensors):
        import contextlib

        @contextlib.contextmanager
        def entered():
            self.log.append((self._thread().name, "side stream current, waits for ready"))
            self.marked.update(str(t.data_ptr()) for t in tensors)
            self.is_current = True
            try:
                yield
            finally:
                self.is_current = False
                self.log.append((self._thread().name, "side stream left"))

        return entered()


class _BucketEngine:
    """An engine that installs in buckets and keeps nothing it was given past the next commit, as SGLang on GPUs."""

    reusable_receive_buffers = False
    installs_in_buckets = True

    def __init__(self, record: bool = False):
        self.held, self.commits, self.weight_version = {}, 0, -1
        self.received = {} if record else None  # everything it was given, when asked to keep a record

    def begin_weight_update(self):
        self.held = {}

    def load_weights(self, named_tensors, copy=True):
        named_tensors = list(named_tensors)
        self.held.update(named_tensors)
        if self.received is not None:
            self.received.update(named_tensors)

    def commit_bucket(self):
        self.held, self.commits = {}, self.commits + 1

    def end_weight_update(self, version):
        self.held, self.weight_version = {}, version

    def abort_weight_update(self):
        self.held = {}


class _LiveAllocations(torch.overrides.TorchFunctionMode):
    """The bytes of the tensors made by torch.zeros / torch.empty while it is on and still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        if func in (torch.zeros, torch.empty):
            nbytes = out.numel() * out.element_size()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(out, self._freed, nbytes)
        return out

    def _freed(self, nbytes):
        self.live -= nbytes


def _background_publish():
    """Trainer rank 0 posts a publication; generator rank 1 starts receiving only after rank 0 says it got
    control back from `publish`. A publish that waited for its receiver would never say so (rank 1 would time
    out waiting for the word). Rank 0's publish gets a recording stand-in for its CUDA stream: what it recorded,
    on which thread, and whether every transfer was posted (its buffers built) with that stream current."""
    import datetime
    import threading

    import torch.distributed as dist

    from megatron_rl.ddma.sync import publish
    from megatron_rl.ddma.transport import TorchDistTransport
    from megatron_rl.rollout.local.decoder import TPDecoder
    from megatron_rl.rollout.local.engine import LocalEngine

    plan = make_plan(TINY, TrainerLayout(1, 1, 1, dtype_bytes=4), GeneratorLayout(1, 1, first_rank=1))
    fp8_plan = make_plan(TINY, TrainerLayout(1, 1, 1, dtype_bytes=4), GeneratorLayout(1, 1, fp8=True, first_rank=1))
    hf = random_hf_weights(TINY, seed=3)
    posted = torch.zeros(1)
    if dist.get_rank() == 0:
        shards = weight_map.megatron_shards(TINY, plan.trainer, 0, 0)
        tensors = {n: weight_map.assemble(s, weight_map.slicer(hf)) for n, s in shards.items()}
        stream = _RecordingStream()

        class StreamCheckingTransport(TorchDistTransport):
            def start(self, sends, recvs):
                stream.log.append((threading.current_thread().name,
                                   "post with the side stream current" if stream.is_current else "post elsewhere"))
                return super().start(sends, recvs)

        transport = StreamCheckingTransport()
        pending = publish(plan, 0, version=1, trainer_tensors=tensors, transport=transport, background=True,
                          stream=stream, bucket_bytes=2**14)
        dist.send(posted + 1, 1, tag=99)
        pending.wait()
        publish(plan, 0, version=2, trainer_tensors=tensors, bucket_bytes=2**12)
        publish(fp8_plan, 0, version=3, trainer_tensors=tensors, bucket_bytes=2**12)
        return {"sent": transport.bytes_sent, "planned": plan.bytes_sent(0), "log": stream.log,
                "main_thread": threading.main_thread().name,
                "all_marked": stream.marked == {str(t.data_ptr()) for t in tensors.values()}}
    engine = LocalEngine(TPDecoder(TINY, 1, 0, None))
    dist.irecv(posted, 0, tag=99).wait(datetime.timedelta(seconds=60))
    publish(plan, 1, version=1, engine=engine, bucket_bytes=2**14)
    bucketed, allocations = _BucketEngine(), _LiveAllocations()
    with allocations:  # a second update into an engine that installs in buckets: what the receiver allocates
        publish(plan, 1, version=2, engine=bucketed, bucket_bytes=2**12)
    rounds = schedule(plan, 2**12)
    # FP8 generators: this tiny model's weights are not 128-row aligned, so the plan sends them dense; the engine
    # (which, like SGLang, installs what it is given) must still get block-FP8 values and their scales.
    recorder = _BucketEngine(record=True)
    publish(fp8_plan, 1, version=3, engine=recorder, bucket_bytes=2**12)
    fp8_weights = [n for n in fp8_plan.runtime[1] if fp8_plan.quantized_on_receipt(n)]
    expected = {n: quantize_block_fp8(weight_map.assemble(s, weight_map.slicer(hf)))
                for n, s in weight_map.sglang_shards(TINY, 1, 0).items() if n in fp8_weights}
    got = recorder.received
    return {"fp8_weights": len(fp8_weights), "sent_dense": not fp8_plan.quantized_tensors,
            "fp8_equal": all(torch.equal(got[n].view(torch.uint8), q.view(torch.uint8))
                             and torch.equal(got[n + SCALE_SUFFIX], s) for n, (q, s) in expected.items()),
            "receive_peak": allocations.peak, "commits": bucketed.commits, "shard_bytes": plan.shard_bytes(1),
            "receive_peak_bound": rounds.receive_peak(1, bucketed=True), "staging_bound": rounds.in_flight_bound(1),
            "posted_first": posted.item() == 1,
            "equal": all(torch.equal(engine.decoder.params[n], weight_map.assemble(s, weight_map.slicer(hf)))
                         for n, s in weight_map.sglang_shards(TINY, 1, 0).items())}


@pytest.fixture(scope="module")
def background_publish():
    return run_on_ranks(_background_publish, 2)


def test_a_background_publish_returns_before_the_generator_receives_and_runs_on_its_own_stream(background_publish):
    trainer, generator = background_publish
    assert generator["posted_first"]
    assert trainer["sent"] == trainer["planned"] and generator["equal"]
    # The training thread only records the event; the sending thread does everything else on the side stream, after
    # waiting for it, and marks every trainer tensor it reads as used there.
    main = trainer["main_thread"]
    assert [what for who, what in trainer["log"] if who == main] == ["record ready on the training stream"]
    assert trainer["log"][0] == (main, "record ready on the training stream")
    side = [what for who, what in trainer["log"] if who != main]
    assert side[0] == "side stream current, waits for ready" and side[-1] == "side stream left"
    assert set(side[1:-1]) == {"post with the side stream current"} and len(side) > 3  # several rounds
    assert trainer["all_marked"]


def test_the_receive_peak_the_sglang_memory_plan_leaves_room_for_is_what_a_bucketed_update_allocates(
        background_publish):
    """`Schedule.receive_peak` (what `rollout.sglang.memory` keeps outside SGLang's --mem-fraction-static) against the
    bytes the receiving rank really allocated during an update into an engine that installs in 4 KiB buckets: at
    least that, and no more than the staging of the rounds in flight above it."""
    _, generator = background_publish
    assert generator["commits"] > 3
    assert generator["receive_peak"] <= generator["receive_peak_bound"]
    assert generator["receive_peak"] >= generator["receive_peak_bound"] - generator["staging_bound"]
    assert generator["receive_peak_bound"] < generator["shard_bytes"] / 2


def test_fp8_weights_the_plan_sends_dense_reach_the_engine_quantized_by_the_receiver(background_publish):
    """An engine that installs what it is given (SGLang) gets block-FP8 values and scales, bit-equal to the project's
    block quantizer applied to the weight, also where the plan sent the weight dense (pieces not 128-row aligned)."""
    _, generator = background_publish
    assert generator["sent_dense"] and generator["fp8_weights"] == 4 * TINY.num_layers
    assert generator["fp8_equal"]


@pytest.fixture(scope="module")
def reports():
    return run_on_ranks(_sync_all_cases, 8, CASES, timeout_s=600)


def _case_id(i):
    spec, t, g, fp8 = CASES[i]
    return f"{spec.name}-trainer-tp{t[0]}pp{t[1]}dp{t[2]}-gen-tp{g[0]}x{g[1]}{'-fp8' if fp8 else ''}"


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(i) for i in range(len(CASES))])
def test_generator_weights_equal_sglang_slices_and_bytes_match_plan(reports, case):
    spec, (tp, pp, dp), (gtp, replicas), fp8 = CASES[case]
    rows = [r[case] for r in reports]
    generators = [r for r in rows if "mismatched" in r]
    assert len(generators) == gtp * replicas
    for r in generators:
        assert r["mismatched"] == [] and r["version"] == case + 1
        if fp8:
            assert r["fp8_tensors"] == 4 * spec.num_layers
    checksum_bytes = 8
    for r in rows:  # every rank moved exactly its planned bytes (plus one 8-byte checksum per pair and round)
        assert r["sent"] - r["planned_sent"] in range(0, checksum_bytes * 1000, checksum_bytes), r
        assert r["received"] - r["planned_received"] in range(0, checksum_bytes * 1000, checksum_bytes), r
        # at most two rounds in flight, and their checksums: a bucket (4096 bytes) each, but for FP8 block rows
        # (128 x 256 elements here), which travel whole
        assert r["most_in_flight"] <= r["in_flight_bound"] + ROUNDS_IN_FLIGHT * 8 * 8, r
        assert fp8 or r["in_flight_bound"] <= ROUNDS_IN_FLIGHT * 4096


def test_fp8_sender_quantizes_aligned_models_and_halves_bytes():
    trainer = TrainerLayout(2, 2, 1, dtype_bytes=2)
    dense = make_plan(ALIGNED, trainer, GeneratorLayout(2, 1, first_rank=4))
    fp8 = make_plan(ALIGNED, trainer, GeneratorLayout(2, 1, fp8=True, first_rank=4))
    assert len(fp8.quantized_tensors) == 4 * ALIGNED.num_layers
    linear = lambda plan: sum(p.nbytes for p in plan.pieces if p.dst_tensor.endswith("proj.weight"))  # noqa: E731
    assert linear(fp8) / linear(dense) == pytest.approx(0.5, abs=0.01)
    assert not make_plan(TINY, TrainerLayout(2, 2, 1), GeneratorLayout(2, 1, fp8=True, first_rank=4)).quantized_tensors


def test_dp_replicas_share_the_sending():
    plan = make_plan(TINY, TrainerLayout(1, 1, 4, dtype_bytes=4), GeneratorLayout(1, 4, first_rank=4))
    sent = [plan.bytes_sent(r) for r in range(4)]
    assert min(sent) > 0 and max(sent) / min(sent) < 1.2
    stats = summarize(plan)
    assert stats["max_recv_bytes"] == max(plan.bytes_received(r) for r in range(4, 8))


@pytest.mark.parametrize("trainer,generator,message", [
    (TrainerLayout(1, 1, 1), GeneratorLayout(3, 1, first_rank=1), r"generator TP=3 \(--rollout-tensor-parallel-size"),
    (TrainerLayout(4, 1, 1), GeneratorLayout(1, 1, first_rank=4), r"trainer TP=4 \(--tensor-model-parallel-size"),
    (TrainerLayout(2, 1, 1), GeneratorLayout(1, 1, first_rank=1), "generator ranks start at 1, inside"),
])
def test_impossible_layouts_fail_at_planning_naming_both(trainer, generator, message):
    with pytest.raises(ValueError, match=message) as info:
        make_plan(TINY, trainer, generator)
    assert "trainer TP=" in str(info.value) and "generator TP=" in str(info.value)


def test_mismatched_generator_model_fails_naming_the_field():
    from megatron_rl.ddma.plan import validate

    with pytest.raises(ValueError, match=r"vocab_size: 200 vs 256"):
        validate(TINY, TrainerLayout(), GeneratorLayout(first_rank=1), TINY.replace(vocab_size=256))


def test_plan_tool_for_405b_meets_the_papers_claims():
    import json
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_ddma.py"), "--model", "llama3-405b",
                        "--trainer-tp", "8", "--trainer-pp", "16", "--trainer-dp", "8", "--rollout-tp", "8",
                        "--rollout-replicas", "64", "--rollout-fp8", "--inter-node-gbps", "400"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("total_bytes", "max_send_bytes", "max_recv_bytes", "num_transfers", "estimated_seconds"):
        assert key in out and key in out["baseline"]
    assert out["estimated_seconds"] < 2.0
    assert out["busiest_sender_vs_mean"] <= 2.0
    assert out["busiest_receiver_vs_own_shard"] <= 1.1
    assert out["baseline"]["estimated_seconds"] > 10 * out["estimated_seconds"]
    assert out["pipeline_stage_layers"] == [7] + [8] * 14 + [7]


def _plan_tool(*args):
    import json
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_ddma.py"), *args], capture_output=True,
                       text=True, timeout=300)
    return r, (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None)


def test_plan_tool_for_qwen3_235b_sends_each_generator_rank_only_its_experts():
    from megatron_rl.ddma.plan import piece_nbytes
    from megatron_rl.models.spec import get_model_spec

    # configs/qwen3-235b-a22b.json's layouts, 2 generator replicas (what a generator rank receives does not
    # depend on how many there are).
    tp, ep = 8, 8
    r, out = _plan_tool("--model", "qwen3-235b-a22b", "--trainer-tp", "4", "--trainer-pp", "8", "--trainer-dp", "8",
                        "--trainer-ep", "16", "--trainer-etp", "1", "--rollout-tp", str(tp), "--rollout-ep", str(ep),
                        "--rollout-replicas", "2", "--rollout-fp8", "--report")
    assert r.returncode == 0, r.stderr
    assert "every expert whole would be" in r.stdout and "gather-and-broadcast" in r.stdout
    assert out["pipeline_stage_layers"] == [11] + [12] * 6 + [11]
    assert out["baseline"]["estimated_seconds"] > 10 * out["estimated_seconds"]
    full = out["experts"]["full"]
    # Rollout EP=8 at TP=8: each generator rank holds 128 / 8 = 16 whole experts of each of the 94 layers
    # (1536 rows: FP8 blocks fit), sent as FP8 with their scales.
    spec = get_model_spec("qwen3-235b-a22b")
    h, fe = spec.hidden_size, spec.moe_ffn_hidden_size
    per_expert = piece_nbytes(2 * fe, h, True, 2) + piece_nbytes(fe, h, True, 2)
    own = spec.num_experts // ep
    assert full["sharded_expert_recv_bytes"] == spec.num_layers * own * per_expert
    assert full["full_expert_bytes"] == spec.num_layers * spec.num_experts * per_expert
    # Every expert whole against a rank's own: num_experts / (own experts, each split TP / EP ways) = the TP size.
    assert full["expert_recv_ratio"] == pytest.approx(spec.num_experts / (own / (tp // ep))) == tp
    assert 1 < full["recv_ratio"] < tp and full["sharded_recv_bytes"] == out["max_recv_bytes"]
    assert out["experts"]["full_vs_sharded_seconds"] > 5
    # Without rollout EP each rank holds 192 rows of every expert's gate and up: not whole FP8 blocks, so those
    # travel in bf16 and a rank receives more.
    assert out["experts"]["without_rollout_ep"]["max_recv_bytes"] > out["max_recv_bytes"]


@pytest.mark.parametrize("flags,message", [
    (["--rollout-tp", "8", "--rollout-ep", "3"], "--rollout-expert-parallel-size 3 does not divide model "
                                                  "'qwen3-30b-a3b' num_experts 128"),
    (["--trainer-tp", "4", "--trainer-dp", "4", "--trainer-ep", "12"],
     "--expert-model-parallel-size 12 does not divide model 'qwen3-30b-a3b' num_experts 128"),
])
def test_plan_tool_names_the_expert_flag_that_does_not_divide_the_experts(flags, message):
    r, _ = _plan_tool("--model", "qwen3-30b-a3b", *flags)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


SCHEDULED = [(TINY, (2, 2, 1), (2, 2), False, 4096), (ALIGNED, (2, 1, 2), (1, 2), True, 2**18),
             (get_model_spec("llama3-8b"), (4, 2, 2), (2, 4), True, 64 * 2**20)]


@pytest.mark.parametrize("spec,trainer,generator,fp8,bucket", SCHEDULED,
                         ids=[f"{c[0].name}-{c[4]}" for c in SCHEDULED])
def test_rounds_bound_what_each_rank_moves_and_both_ends_agree(spec, trainer, generator, fp8, bucket):
    """The schedule alone (no processes), for two tiny layouts and Llama-3-8B (trainer TP4 PP2 DP2 -> 4 generator
    replicas at TP2, FP8): every planned byte is in exactly one round; no rank moves more than a bucket in a round;
    the two ends of every pair list the same messages in the same rounds and order; every runtime tensor completes
    once, in the round of its last piece; a replica's ranks commit at the same rounds."""
    t = TrainerLayout(*trainer, dtype_bytes=2)
    g = GeneratorLayout(*generator, fp8=fp8, first_rank=t.world_size)
    plan = make_plan(spec, t, g)
    rounds = schedule(plan, bucket)
    ranks = sorted(plan.by_rank)
    per_pair: dict = {}
    for rank in ranks:
        for rr in rounds.rounds(rank):
            assert rr.nbytes <= bucket, (rank, rr.index, rr.nbytes)
            for peer, m in rr.sends:
                per_pair.setdefault(("send", rank, peer, rr.index), []).append(m)
            for peer, m in rr.recvs:
                per_pair.setdefault(("recv", peer, rank, rr.index), []).append(m)
        assert rounds.in_flight_bound(rank) <= ROUNDS_IN_FLIGHT * bucket
    sends = {k[1:]: v for k, v in per_pair.items() if k[0] == "send"}
    recvs = {k[1:]: v for k, v in per_pair.items() if k[0] == "recv"}
    assert sends == recvs
    moved = {}
    for (src, dst, _), messages in sends.items():
        moved[(src, dst)] = moved.get((src, dst), 0) + sum(message_bytes(m) for m in messages)
    planned = {}
    for p in plan.pieces:
        planned[(p.src, p.dst)] = planned.get((p.src, p.dst), 0) + p.nbytes
    assert moved == planned
    for dst in plan.runtime:
        completes = rounds.completes(dst)
        assert sorted(n for names in completes.values() for n in names) == sorted(plan.runtime[dst])
        last = {}
        for rr in rounds.rounds(dst):
            for _, m in rr.recvs:
                last[m[0].dst_tensor] = rr.index
        assert all(last[n] == k for k, names in completes.items() for n in names)
    for replica in range(g.num_replicas):
        members = [g.rank(replica, j) for j in range(g.tensor_parallel_size)]
        assert len({tuple(rounds.commits(m)) for m in members}) == 1
    if bucket >= 2**20:
        assert rounds.commits(g.rank(0, 0))  # a real model's update is installed in several buckets
