"""Packed, token-budgeted micro-batches (`--use-dynamic-batch-size`) against rows padded to their own longest: the
plans, each sequence's log-probs against that sequence run alone, and one optimizer step packed against padded
under TP=2, PP=2 and DP=2, for every loss aggregation and with a KL reference.

fp32 throughout. Tolerances: log-probs 1e-5 (a packed row changes the order of no sum within a sequence but the
matmuls see other shapes); updated weights 2e-6 with adam_eps 1e-4, as in test_trainer (its docstring says why:
float-reordering noise moves weights by < 1e-9, a wrong normalizer or mask by >= 1e-4)."""

import pytest
import torch
from test_trainer import SPEC, TEMPERATURE, _merge, _params

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.runtime.spawn import run_on_ranks
from megatron_rl.trainer import packing, parallel

# (prompt, response) tokens: 77 in all, 4 to 18 per rollout, so a 24-token budget packs 1 to 4 rollouts together
LENGTHS = [(3, 6), (5, 2), (2, 9), (4, 4), (6, 12), (2, 3), (3, 1), (7, 8)]
BUDGET = 24
LAYOUTS = {"tp2": (2, 1, False), "pp2": (1, 2, False), "dp2": (1, 1, False)}
AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-sum-constant"]


def _batch(vocab_size: int = SPEC.vocab_size):
    from megatron_rl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab_size, (p,), generator=g).tolist() for p, _ in LENGTHS]
    responses = [torch.randint(0, vocab_size, (r,), generator=g).tolist() for _, r in LENGTHS]
    behavior = [(-5.3 + 0.8 * torch.randn(r, generator=g)).tolist() for _, r in LENGTHS]
    advantages = [1.0, -0.5, 0.25, -1.0, 0.75, -0.25, 1.5, -1.25]
    masks = [[True] * r for _, r in LENGTHS]
    masks[4][3:7] = [False] * 4  # observation tokens inside a response
    return TrainBatch.from_sequences(prompts, responses, behavior, advantages, masks)


# ---- plans (no processes) ------------------------------------------------------------------------------------------

def test_dynamic_plan_respects_the_budget_balances_ranks_and_agrees_on_counts():
    lengths = [p + r for p, r in LENGTHS]
    for dp in (1, 2, 3):
        plan = packing.plan_dynamic(lengths, dp, BUDGET)
        assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(lengths)))  # each once
        assert len({len(rank) for rank in plan}) == 1  # every rank runs as many micro-batches
        assert all(sum(lengths[i] for i in mb) <= BUDGET for rank in plan for mb in rank)
        loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
        assert max(loads) - min(loads) <= max(lengths)  # LPT: within one rollout of each other
    assert len(packing.plan_dynamic(lengths, 1, BUDGET)[0]) == 4  # ceil(77 / 24): the fewest possible here


def test_fixed_plan_takes_any_batch_size():
    assert packing.plan_fixed(16, 2, 4) == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8, 9, 10, 11], [12, 13, 14, 15]]]
    # a step the gates left short (14 of 16): near-equal parts, at most 8 rows, the same count on each rank
    assert packing.plan_fixed(14, 1, 8) == [[list(range(7)), list(range(7, 14))]]
    assert [[len(mb) for mb in rank] for rank in packing.plan_fixed(7, 2, 2)] == [[1, 2], [2, 2]]
    assert packing.plan_fixed(1, 2, 4) == [[[]], [[0]]]  # an empty micro-batch: `microbatches` runs a filler


def test_a_rollout_longer_than_the_budget_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"rollout 4 has 18 tokens .* more than --max-tokens-per-gpu 17"):
        packing.plan_dynamic([p + r for p, r in LENGTHS], 1, 17)


def test_packed_microbatch_keeps_each_sequence_to_itself():
    batch = _batch()
    mb = packing.packed_microbatch(batch, [0, 1, 3], multiple=4)  # 9 + 7 + 8 = 24 tokens: no tail padding
    assert mb["tokens"].shape == (1, 24)
    assert mb["position_ids"][0].tolist() == list(range(9)) + list(range(7)) + list(range(8))
    for k, row in enumerate([0, 1, 3]):  # `unpack` reads each row's next-token predictions back
        n = int(batch.seq_lengths[row])
        assert torch.equal(mb["tokens"][0, 1:][mb["unpack"][k, :n - 1]], batch.tokens[row, 1:n])
    tail = packing.packed_microbatch(batch, [6, 5], multiple=4)  # 4 + 5 = 9 tokens, padded to 12
    assert tail["segments"][0].tolist() == [0] * 4 + [1] * 5 + [2] * 3  # the padding is a sequence of its own
    mask = packing.block_causal_mask(tail["segments"])[0, 0]
    assert not mask[5, 4] and mask[5, 3] and mask[4, 5]  # sees its own past only, nothing across sequences


# ---- against the real trainer (one launch of 2 ranks: every layout in turn) ---------------------------------------

def _trainer(tp, pp, sp, batching, aggregation="token-mean", kl_coef=0.0):
    import torch.distributed as dist
    from helpers import random_hf_weights

    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.reference import ReferenceModel
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    layout = TrainerLayout(tp, pp, dist.get_world_size() // (tp * pp), dtype_bytes=4, sequence_parallel=sp)
    policy = build_policy(SPEC, layout, lr=1e-3, clip_grad=1.0, adam_eps=1e-4,
                          init_weights=lambda m: load_hf_weights(m, SPEC, layout, random_hf_weights(SPEC, seed=0)))
    algo = AlgorithmConfig(loss="aipo", loss_params={"rho": 2.0}, temperature=TEMPERATURE, aggregation=aggregation,
                           kl_coef=kl_coef, seq_sum_constant=12.0 if aggregation == "seq-sum-constant" else None)
    reference = None
    if kl_coef:
        reference = ReferenceModel(policy)
        load_hf_weights(reference.module, SPEC, layout, random_hf_weights(SPEC, seed=1))
        reference.source = "random weights of seed 1"
    return PolicyTrainer(policy, algo, batching=batching, reference=reference)


class HostSyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the calls that make the host wait for the device (a read of a value, a boolean index, a copy to the
    host) on tensors that live on the device in a GPU run: the ones `track`ed (what the step moved there, and the
    model's parameters) and every tensor computed from them. On a CPU these are ordinary tensors: the counter knows
    them by identity. Each call is attributed to the first caller outside torch: this project, or Megatron-Core."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.numpy,
             torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.bincount,
             torch.Tensor.bincount, torch.equal, torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self._device: dict[int, object] = {}  # id -> weak reference of the tensors on the device
        self.calls: list[tuple[str, str]] = []  # (whose, what)

    def track(self, *tensors) -> None:
        import weakref

        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._device[id(t)] = weakref.ref(t)

    def _on_device(self, t) -> bool:
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys

        kwargs = kwargs or {}
        inputs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        inputs += [a for arg in args if isinstance(arg, (tuple, list)) for a in arg if isinstance(a, torch.Tensor)]
        on_device = any(self._on_device(t) for t in inputs)
        to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(
            str(a) == "cpu" for a in list(args[1:]) + [kwargs.get("device")]))
        boolean_index = func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if on_device and (func in self.READS or to_host or boolean_index):
            frame = sys._getframe(1)
            while frame and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
                frame = frame.f_back
            where = frame.f_code.co_filename if frame else "?"
            whose = "megatron_rl" if "/megatron_rl/" in where else "megatron-core" if "/megatron/" in where else where
            self.calls.append((whose, f"{getattr(func, '__name__', func)} at {where}:{frame.f_lineno if frame else 0}"))
        out = func(*args, **kwargs)
        if to_host and isinstance(out, torch.Tensor):
            return out.clone()  # a host copy (on a CPU `.cpu()` returns the tensor itself)
        if on_device:
            self.track(*(out if isinstance(out, (tuple, list)) else (out,)))
        return out


def _count_host_syncs(batch, budget):
    """Our host synchronizations in one packed training step (DP=2) of `budget` tokens per micro-batch."""
    from megatron_rl.trainer.train_step import PolicyTrainer

    counter = HostSyncCounter()

    class Tracked(PolicyTrainer):
        def _microbatches(self, share):
            microbatches = super()._microbatches(share)
            for mb in microbatches:
                counter.track(*mb.values())
            return microbatches

    trainer = _trainer(1, 1, False, packing.MicroBatching(max_tokens=budget))
    trainer.__class__ = Tracked
    counter.track(*trainer.policy.module.parameters(), *(b.grad_data for b in trainer.policy.model.buffers))
    with counter:
        trainer.train_step(batch)
    return {"ours": [what for whose, what in counter.calls if whose == "megatron_rl"],
            "micro_batches": len(trainer.share(batch).plan)}


def _equivalence_rank():
    padded, packed = packing.MicroBatching(micro_batch_size=2), packing.MicroBatching(max_tokens=BUDGET)
    batch, out = _batch(), {}
    for name, (tp, pp, sp) in LAYOUTS.items():
        parallel.initialize(TrainerLayout(tp, pp, 2 // (tp * pp), dtype_bytes=4, sequence_parallel=sp), SPEC)
        trainer = _trainer(tp, pp, sp, packed)
        logprobs = {"packed": trainer.compute_logprobs(batch)}
        trainer.batching = padded
        logprobs["padded"] = trainer.compute_logprobs(batch)
        logprobs["alone"] = [trainer.compute_logprobs(batch.rows(torch.tensor([i]))) for i in range(len(batch))]
        steps = {}
        for aggregation in AGGREGATIONS + ["kl"]:
            for way, batching in (("padded", padded), ("packed", packed)):
                trainer = _trainer(tp, pp, sp, batching, "token-mean" if aggregation == "kl" else aggregation,
                                   kl_coef=0.1 if aggregation == "kl" else 0.0)
                metrics = trainer.train_step(batch)
                steps[aggregation, way] = {**_params(trainer), "metrics": metrics}
        out[name] = {"logprobs": logprobs, "steps": steps}
        if name == "dp2":
            out["host_syncs"] = [_count_host_syncs(batch, budget) for budget in (BUDGET, 2 * BUDGET)]
            bad = _batch()
            bad.advantages[2] = float("nan")  # on the first DP rank's share only
            trainer = _trainer(1, 1, False, packed)
            before = _params(trainer)["params"]
            try:
                trainer.train_step(bad)
            except ValueError as e:
                out["nonfinite"] = {"error": str(e), "unchanged": all(
                    torch.equal(before[k], v) for k, v in _params(trainer)["params"].items())}
        parallel.destroy()
    return out


@pytest.fixture(scope="module")
def equivalence():
    return run_on_ranks(_equivalence_rank, 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_and_padded_logprobs_equal_each_sequence_alone(equivalence, layout):
    batch = _batch()
    for rank in equivalence:
        lp = rank[layout]["logprobs"]
        for i, alone in enumerate(lp["alone"]):
            n = int(batch.seq_lengths[i]) - 1  # prediction positions of rollout i
            for way in ("packed", "padded"):
                torch.testing.assert_close(lp[way][i, :n], alone[0, :n], atol=1e-5, rtol=0, msg=f"{way} row {i}")


@pytest.mark.parametrize("aggregation", AGGREGATIONS + ["kl"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_packed_equals_padded(equivalence, layout, aggregation):
    tp, pp, _ = LAYOUTS[layout]
    steps = {way: [rank[layout]["steps"][aggregation, way] for rank in equivalence] for way in ("padded", "packed")}
    padded, packed = _merge(steps["padded"], tp, pp), _merge(steps["packed"], tp, pp)
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], atol=2e-6, rtol=0, msg=name)
    ref, got = steps["padded"][0]["metrics"], steps["packed"][0]["metrics"]
    # The loss sums per-token terms of magnitude ~1 that nearly cancel (a loss of ~0.03): packed and padded sum them
    # in different fp32 orders, so its error is absolute, a few eps x the terms' size.
    for key in ("loss", "grad_norm", "kl_behavior_current", "tokens") + (("kl_ref",) if aggregation == "kl" else ()):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=2e-6), key
    assert got["model_tokens"] < ref["model_tokens"]  # packing ran the model on fewer padded positions


def test_a_packed_step_reads_from_the_device_once_whatever_its_micro_batches(equivalence):
    """The step's only host synchronization in this project's code is the read of its metrics (Megatron-Core's
    optimizer reads the gradient norm besides); none per micro-batch."""
    for rank in equivalence:
        counts = rank["host_syncs"]
        assert counts[0]["micro_batches"] != counts[1]["micro_batches"]
        for count in counts:
            assert len(count["ours"]) == 1 and "cpu at " in count["ours"][0], count["ours"]


def test_a_nonfinite_loss_input_on_one_rank_stops_the_step_on_every_rank_before_the_update(equivalence):
    for rank in equivalence:
        # row 2's advantage is NaN: its 9 response tokens (on the first rank's share), counted over DP
        assert rank["nonfinite"]["error"] == "advantages has 9 non-finite value(s) where it is used"
        assert rank["nonfinite"]["unchanged"]


# ---- a mixture of experts: EP=2, routing replay, the load-balancing loss --------------------------------------------

MOE_SPEC = get_model_spec("tiny-qwen3-moe")
MOE_LENGTHS = [(6, 12), (2, 2), (7, 8), (3, 4)]  # 18, 4, 15, 7 tokens: LPT gives each DP rank the rows of a fixed share


def _moe_rank(hf_dir):
    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.trainer.batch import TrainBatch
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    spec = MOE_SPEC
    g = torch.Generator().manual_seed(5)
    batch = TrainBatch.from_sequences(
        [torch.randint(0, spec.vocab_size, (p,), generator=g).tolist() for p, _ in MOE_LENGTHS],
        [torch.randint(0, spec.vocab_size, (r,), generator=g).tolist() for _, r in MOE_LENGTHS],
        [(-4.0 + torch.randn(r, generator=g)).tolist() for _, r in MOE_LENGTHS], [1.0, -0.5, 0.75, -1.0])
    scores = torch.rand(*batch.tokens.shape, spec.num_layers, spec.num_experts, generator=g)
    routes = scores.argsort(-1)[..., :spec.moe_router_topk].to(torch.int16)
    lengths = batch.seq_lengths.tolist()
    batch = batch.with_routes([r[:n] for r, n in zip(routes, lengths)], lengths)
    layout = TrainerLayout(1, 1, 2, dtype_bytes=4, expert_model_parallel_size=2)
    parallel.initialize(layout, spec)
    out = {}
    # one micro-batch per rank either way: rows 0-1 and 2-3, the shorter row padded by 14 and 8 tokens, or packed
    for way, batching in (("padded", packing.MicroBatching(micro_batch_size=2)),
                          ("packed", packing.MicroBatching(max_tokens=24))):
        policy = build_policy(spec, layout, lr=1e-3, adam_eps=1e-4, routing_replay=True, moe_aux_loss_coeff=0.1,
                              init_weights=lambda m: load_hf_weights(m, spec, layout, HFCheckpoint(hf_dir).get_slice))
        trainer = PolicyTrainer(policy, AlgorithmConfig(loss="aipo", temperature=TEMPERATURE), batching=batching)
        logprobs = trainer.compute_logprobs(batch)
        metrics = trainer.train_step(batch)
        out[way] = {"logprobs": logprobs, "metrics": metrics,
                    "params": {n: p.detach().clone() for n, p in policy.module.named_parameters()}}
    parallel.destroy()
    return out


def test_moe_step_with_routing_replay_packed_equals_padded_and_its_balancing_loss_skips_padding(tmp_path):
    from megatron_rl.models.hf import save_random_hf_model

    save_random_hf_model(MOE_SPEC, str(tmp_path), seed=5)
    positions = torch.tensor([p + r - 1 for p, r in MOE_LENGTHS])[:, None] > torch.arange(17)  # predictions per row
    for rank in run_on_ranks(_moe_rank, 2, str(tmp_path)):
        padded, packed = rank["padded"], rank["packed"]
        torch.testing.assert_close(packed["logprobs"][positions], padded["logprobs"][positions], atol=1e-5, rtol=0)
        # the load-balancing loss of the same real tokens: padding (22 positions here) counts in neither
        assert packed["metrics"]["moe_aux_loss"] == pytest.approx(padded["metrics"]["moe_aux_loss"], rel=1e-5)
        for name, value in padded["params"].items():  # each rank's experts and the shared weights
            torch.testing.assert_close(packed["params"][name], value, atol=2e-6, rtol=0, msg=name)


# ---- the trainer executor sends each DP rank only its share --------------------------------------------------------

def _executor_rank(timeout_minutes: float = 30, idle_keep_alives: int = 0):
    """DP=2 trainer ranks through the executor's commands, then a generator that idles. `idle_keep_alives`: rank 0
    sends no command between two steps (an evaluation, say) until its keep-alive has gone out that many times."""
    import pickle

    import torch.distributed as dist

    from megatron_rl.config.arguments import parse_args
    from megatron_rl.config.setup import build_run_setup
    from megatron_rl.runtime.roles import init_roles

    flags = ["--model", "tiny-llama", "--seq-length", str(BUDGET), "--rollout-tensor-parallel-size", "1",
             "--global-batch-size", "8", "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(BUDGET),
             "--lr", "1e-2", "--output-dir", "unused"]
    setup = build_run_setup(parse_args(flags), 3)
    roles = init_roles(setup.trainer.world_size, 1, 1, timeout_minutes=timeout_minutes)
    out = {}
    if roles.is_trainer:
        from megatron_rl.trainer.executor import TrainerExecutor

        trainer = TrainerExecutor(setup, roles)
        step = trainer.trainer.train_step
        trainer.trainer.train_step = lambda share, **kw: (out.update(received=share), step(share, **kw))[1]
        batch = _batch(setup.spec.vocab_size)
        if roles.is_controller:
            out["metrics"] = trainer.command("train", batch)
            if idle_keep_alives:
                out["idled"] = trainer.keep_alive.wait_sent(idle_keep_alives, timeout_s=300)
                out["metrics_after_idle"] = trainer.command("train", batch)
            trainer.stop()
        else:
            trainer.serve()
        out["expected"] = trainer.trainer.share(batch)  # what this rank would cut from the whole batch
        out["bytes"] = len(pickle.dumps(out["received"])), len(pickle.dumps(batch))
    dist.destroy_process_group()
    return out


def test_the_executor_sends_each_data_parallel_rank_only_its_share():
    ranks = run_on_ranks(_executor_rank, 3, backend=None, timeout_s=600)[:2]
    assert ranks[0]["metrics"]["update_successful"]
    assert ranks[0]["metrics"]["trained_tokens"] == int(_batch().loss_mask.sum())  # the step's, not a share's
    shares = [r["received"] for r in ranks]
    assert sorted(shares[0].rows + shares[1].rows) == list(range(len(LENGTHS)))  # a partition of the step
    for rank in ranks:
        got, want = rank["received"], rank["expected"]
        assert got.rows == want.rows and got.plan == want.plan and len(got.batch) == len(got.rows) < len(LENGTHS)
        assert (got.size, got.width, got.valid_tokens) == (want.size, want.width, want.valid_tokens)
        for name in ("tokens", "loss_mask", "behavior_logprobs", "advantages", "lengths"):
            assert torch.equal(getattr(got.batch, name), getattr(want.batch, name)), name
        sent, whole = rank["bytes"]
        assert sent < whole  # only its rows, trimmed to their own longest


@pytest.mark.slow  # an 18 s idle phase: the slow tier keeps the default suite short
def test_idle_trainer_ranks_outlast_the_process_group_timeout():
    # 12 s timeouts for every group; between two steps rank 0 sends nothing but 6 keep-alives (one per 3 s: 18 s,
    # 1.5 timeouts). The other trainer rank waits for its next command on the command group and trains again.
    rank0 = run_on_ranks(_executor_rank, 3, 0.2, 6, backend=None, timeout_s=600)[0]
    assert rank0["idled"] and rank0["metrics"]["update_successful"]
    assert rank0["metrics_after_idle"]["update_successful"]
