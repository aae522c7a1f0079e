"""The controller's loop and the rollout buffer at their seams, in one process: the real `Controller` and
`RolloutBuffer` with in-process channels, a scripted generator thread and a recording trainer (no model, no
process group). Fast checks of batching by groups, the staleness gate, dynamic sampling, async dispatch ahead,
and the resend of lost samples after a resume; the end-to-end runs (test_controller.py) cover the real
executors."""

import json
import os
import queue
import threading
import time
from collections import Counter

import pytest

from megatron_rl.config.arguments import parse_args
from megatron_rl.config.setup import RunSetup, model_spec
from megatron_rl.controller.buffer import Rollout, RolloutBuffer
from megatron_rl.controller.loop import Controller
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
from megatron_rl.observability.accounting import account
from megatron_rl.rewards.types import RewardResult
from megatron_rl.rollout.types import RequestMeta, RolloutOutput

TOKENIZER = build_char_tokenizer()
LEADER = 1


REWARDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loop_rewards.py")  # for --custom-rm-path


class LocalChannel:
    """A channel in one process: `send(message, dst)` to a queue, `recv()` from it."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.last_sent = 0.0

    def send(self, message, dst):
        self.queue.put((message, dst))
        self.last_sent = time.monotonic()

    def recv(self, src=None):
        return self.queue.get(timeout=30)

    def flush(self):
        pass


class ScriptedGenerator(threading.Thread):
    """Answers each "requests" message at once, one message per group (as the real worker does): odd samples get
    the right answer and even ones a wrong one; every token carries the current weight version, except that the
    first `stale_prompts` RL prompts get tokens 2 versions old. Records every request id it served.
    `version_logprobs`: each token's behavior log-prob is -1 - its version (else -1), so that a trained batch
    shows which version generated each of its rows. `slow_after`: the first RL prompt is a long generation, its group
    sent only after that many other groups (tokens of the version it was requested under)."""

    def __init__(self, control: LocalChannel, rollouts: LocalChannel, stale_prompts: int = 0,
                 version_logprobs: bool = False, slow_after: int | None = None):
        super().__init__(daemon=True)
        self.control, self.rollouts, self.stale_prompts = control, rollouts, stale_prompts
        self.version_logprobs, self.slow_after, self.held = version_logprobs, slow_after, None
        self.version, self.served, self.syncs, self.prompts = -1, [], [], []

    def run(self):
        while True:
            (kind, payload), _ = self.control.queue.get(timeout=30)
            if kind == "sync":
                self.version = payload
                self.syncs.append(payload)
            elif kind == "stop":
                self.rollouts.queue.put((("stopped", {}), LEADER))
                return
            else:
                groups = {}
                for rid, prompt, _params, meta in payload:
                    self.served.append(rid)
                    if not meta.is_eval and meta.prompt_id not in self.prompts:
                        self.prompts.append(meta.prompt_id)
                    text = meta.reference if meta.sample_index % 2 else meta.reference + "0"
                    tokens = TOKENIZER.encode(text, add_special_tokens=False)
                    stale = meta.prompt_id in self.prompts[:self.stale_prompts]
                    version = max(self.version - 2, 0) if stale else self.version
                    logprob = -1.0 - version if self.version_logprobs else -1.0
                    out = RolloutOutput(rid, prompt, tokens, [logprob] * len(tokens), [version] * len(tokens), "stop")
                    groups.setdefault(meta.group, []).append((out, meta))
                for group in groups.values():
                    if self.slow_after is not None and group[0][1].prompt_id == self.prompts[0] and self.held is None:
                        self.held = group
                        continue
                    self.rollouts.queue.put((("rollouts", (group, {"tokens": 1})), LEADER))
                    if self.held and not group[0][1].is_eval:
                        self.slow_after -= 1
                        if self.slow_after == 0:
                            self.rollouts.queue.put((("rollouts", (self.held, {"tokens": 1})), LEADER))
                            self.held = []


class RecordingTrainer:
    """Takes the trainer executor's commands and records them; every update succeeds but those of the "train"
    commands numbered in `skipped` (from 1: a NaN/Inf gradient). A save writes only the checkpoint's directory and
    the dist checkpoint's metadata.json."""

    def __init__(self, skipped=()):
        self.commands, self.skipped = [], set(skipped)

    def command(self, name, payload=None):
        self.commands.append((name, payload))
        if name in ("train", "sft"):
            successful = name == "sft" or len(self.trained()) not in self.skipped
            return {"update_successful": successful, "tokens_per_s": 1.0, "loss": 0.0}
        if name == "save":
            os.makedirs(payload)
            with open(os.path.join(payload, "metadata.json"), "w") as f:
                f.write("{}")
        return None

    def trained(self):
        return [p for n, p in self.commands if n == "train"]


def _consumed_rows(out_dir) -> list[dict]:
    """The ledger's rows of samples trained on or discarded."""
    rows = [json.loads(line) for line in (out_dir / "rollouts.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] in ("trained", "discarded")]


def _controller(tmp_path, *flags, stale_prompts=0, reward="reward_exact", version_logprobs=False, slow_after=None):
    args = parse_args(["--global-batch-size", "8", "--n-samples-per-prompt", "4", "--custom-rm-path",
                       f"{REWARDS}:{reward}", "--reward-num-workers", "1", "--reward-timeout", "60",  # a busy machine
                       "--output-dir", str(tmp_path), "--eval-size", "4", *flags])
    setup = RunSetup(args, TOKENIZER, model_spec(args, TOKENIZER), TrainerLayout(), GeneratorLayout(first_rank=1))
    control, rollouts = LocalChannel(), LocalChannel()
    generator = ScriptedGenerator(control, rollouts, stale_prompts, version_logprobs, slow_after)
    generator.start()
    trainer = RecordingTrainer()
    # The controller sends to the generator through `control`; the generator answers through `rollouts`.
    return Controller(setup, trainer, control, rollouts, [LEADER]), generator, trainer


def _finish(controller, generator):
    controller.shutdown()
    generator.join(timeout=30)


def test_synchronous_steps_train_on_complete_groups_of_the_current_version(tmp_path):
    controller, generator, trainer = _controller(tmp_path, "--async-mode", "off")
    controller.publish()
    metrics = [controller.rl_step(step, 0.0) for step in (1, 2, 3)]
    _finish(controller, generator)
    assert generator.syncs == [0, 1, 2, 3] and [m["train"]["weight_version"] for m in metrics] == [1, 2, 3]
    assert all(m["rollout"]["staleness_histogram"] == {"0": 8} for m in metrics)  # on-policy: lag 0 only
    batches = trainer.trained()
    assert [len(b) for b in batches] == [8, 8, 8]
    # every request served once; after each update the next step's prompts go out (4 steps' worth by now)
    served = [rid for rid in generator.served if not rid.startswith("eval:")]
    assert len(served) == len(set(served)) == 32 and controller.dispatched.most_common(1)[0][1] == 1
    # each group holds two right and two wrong answers: advantages of +-0.5 around the group mean
    assert [b.advantages.tolist() for b in batches][0] == [-0.5, 0.5, -0.5, 0.5] * 2


def test_async_steps_dispatch_ahead_and_train_one_version_behind(tmp_path):
    controller, generator, trainer = _controller(tmp_path, "--async-mode", "on", "--max-staleness", "1")
    controller.publish()
    metrics = [controller.rl_step(step, 0.0) for step in (1, 2, 3)]
    _finish(controller, generator)
    # Step 1's prompts and the next step's went out at version 0; step 2 trains on the latter at version 1.
    assert metrics[0]["rollout"]["staleness_histogram"] == {"0": 8}
    assert [m["rollout"]["staleness_histogram"] for m in metrics[1:]] == [{"1": 8}, {"1": 8}]
    assert metrics[0]["perf"]["async"] and len(controller.inflight) == 2  # the next step's prompts are in flight


def test_stale_groups_are_discarded_with_their_reason_and_replaced(tmp_path):
    controller, generator, trainer = _controller(tmp_path, "--async-mode", "on", "--max-staleness", "1",
                                                 stale_prompts=2)
    for _ in range(3):
        controller.publish()  # the trainer is at version 2: the stale prompts' tokens (version 0) lag by 2
    metrics = controller.rl_step(1, 0.0)
    _finish(controller, generator)
    rollout = metrics["rollout"]
    assert rollout["discards"] == {"stale": 8} and rollout["staleness_histogram"] == {"0": 8, "2": 8}
    rows = _consumed_rows(tmp_path)
    assert {r["prompt_id"] for r in rows if r["outcome"].startswith("stale")} == set(generator.prompts[:2])
    assert {r["prompt_id"] for r in rows if r["outcome"] == "trained"} == set(generator.prompts[2:4])
    assert len(trainer.trained()[0]) == 8  # the batch was filled by the groups that replaced them


def test_discards_are_counted_by_reason_in_the_metrics(tmp_path):
    controller, generator, _ = _controller(tmp_path, "--async-mode", "on", "--max-staleness", "1",
                                           "--max-oversample", "2", stale_prompts=2, reward="reward_one")
    for _ in range(3):
        controller.publish()
    metrics = controller.rl_step(1, 0.0)
    _finish(controller, generator)
    # 2 groups of stale samples, then 2 uniform groups dropped before the oversampling limit; counted per sample
    assert metrics["rollout"]["discards"] == {"stale": 8, "group rewards all equal": 8}


@pytest.mark.parametrize("control", ["discard", "admission"])
def test_admission_control_trains_a_long_generation_that_the_gate_would_discard(tmp_path, control):
    # Prompt 0's group comes back after 4 others: after the step-2 dispatch (prompts 4 and 5, under version 1).
    controller, generator, trainer = _controller(tmp_path, "--async-mode", "on", "--max-staleness", "1",
                                                 "--staleness-control", control, slow_after=4)
    metrics = [controller.rl_step(step, 0.0) for step in (1, 2, 3)]
    _finish(controller, generator)
    slow = generator.prompts[0]
    outcome = {r["prompt_id"]: r["outcome"] for r in _consumed_rows(tmp_path)}
    if control == "discard":  # step 2 takes the groups that came back first; at step 3 prompt 0 is 2 versions old
        assert outcome[slow].startswith("stale") and metrics[2]["rollout"]["discards"] == {"stale": 4}
    else:  # step 2 (version 1) waits for it: at step 3 it would be too old
        assert outcome[slow] == "trained" and metrics[1]["rollout"]["due_groups"] == 2
        assert all(not m["rollout"]["discards"] for m in metrics)
        assert metrics[1]["rollout"]["staleness_histogram"] == {"1": 8}  # both version-0 groups, at lag 1
    assert all(len(batch) == 8 for batch in trainer.trained())


def test_groups_without_signal_are_replaced_up_to_the_oversampling_limit(tmp_path):
    controller, generator, trainer = _controller(tmp_path, "--async-mode", "off", "--max-oversample", "2",
                                                 reward="reward_one")
    controller.publish()
    metrics = controller.rl_step(1, 0.0)
    _finish(controller, generator)
    # Every group is uniform: 2 x 2 groups are dropped for no signal, then uniform groups fill the batch.
    assert metrics["rollout"]["discards"] == {"group rewards all equal": 16}
    assert len(trainer.trained()[0]) == 8 and trainer.trained()[0].advantages.abs().sum() == 0


def test_a_resume_sends_exactly_the_lost_samples_again_with_their_request_ids(tmp_path):
    first, generator, _ = _controller(tmp_path / "a", "--async-mode", "on")
    first.publish()
    first.rl_step(1, 0.0)
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint holds it
    _finish(first, generator)
    pending = sorted(state["inflight"])
    assert len(pending) == 2  # async: the next step's prompts were in flight at the "checkpoint"
    # The checkpoint's buffer holds sample 0 of the first of them; the other samples died with the generators.
    buffer = RolloutBuffer(4, 1)
    buffer.add(_rollout(pending[0], 0, 0))
    state["buffer"] = buffer.state_dict()
    second, generator, _ = _controller(tmp_path / "b", "--async-mode", "on")
    second.load_state_dict(state)
    second.resend_lost_samples(1)
    _finish(second, generator)
    expected = {f"{p}#{k}" for p in pending for k in range(4)} - {f"{pending[0]}#0"}
    assert sorted(generator.served) == sorted(expected)
    assert second.dispatched == Counter(state["dispatched"])  # a resend is not a new dispatch


def _exports(trainer) -> list[str]:
    return [os.path.basename(p) for n, p in trainer.commands if n == "save_hf"]


def test_a_run_without_rl_steps_exports_the_warmed_up_policy(tmp_path):
    controller, generator, trainer = _controller(tmp_path, "--train-iters", "0", "--sft-warmup-iters", "2",
                                                 "--save-hf", str(tmp_path / "hf"))
    controller.run()
    _finish(controller, generator)
    names = [n for n, _ in trainer.commands]
    assert _exports(trainer) == ["iter_0000000"] and "train" not in names
    assert names.index("save_hf") > max(i for i, n in enumerate(names) if n in ("sft", "publish"))  # after warm-up
    assert json.loads((tmp_path / "eval.json").read_text())["train_iters"] == 0


def test_a_run_with_rl_steps_exports_only_at_its_last_step(tmp_path):
    controller, generator, trainer = _controller(tmp_path, "--train-iters", "2", "--async-mode", "off",
                                                 "--save-hf", str(tmp_path / "hf"))
    controller.run()
    _finish(controller, generator)
    assert _exports(trainer) == ["iter_0000002"]


# ---- --controlled-lag --------------------------------------------------------------------------------------------

def _trained_lags(trainer) -> list[dict[int, int]]:
    """Per "train" command, how many rows have each lag: the trainer's version then (the last one published) minus
    the version that generated the row (`ScriptedGenerator` with `version_logprobs`)."""
    version, lags = None, []
    for name, payload in trainer.commands:
        if name == "publish":
            version = payload
        elif name == "train":
            rows = [(-1.0 - lp[mask]).unique().tolist() for lp, mask in zip(payload.behavior_logprobs,
                                                                           payload.loss_mask)]
            assert all(len(r) == 1 for r in rows)  # one version per row
            lags.append(dict(Counter(version - int(r[0]) for r in rows)))
    return lags


def _trained_prompts_by_step(out_dir) -> list[list[str]]:
    rows = _consumed_rows(out_dir)
    trained = [r for r in rows if r["outcome"] == "trained"]
    assert len({(r["prompt_id"], r["sample_index"]) for r in trained}) == len(trained)  # each sample once
    steps = sorted({r["step"] for r in trained})
    return [list(dict.fromkeys(r["prompt_id"] for r in trained if r["step"] == s)) for s in steps]


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_controlled_lag_trains_every_batch_exactly_k_versions_behind_after_a_ramp(tmp_path, lag):
    controller, generator, trainer = _controller(tmp_path, "--controlled-lag", str(lag), version_logprobs=True)
    controller.publish()
    metrics = [controller.rl_step(step, 0.0) for step in range(1, 7)]
    _finish(controller, generator)
    # The first step generates lag + 1 batches under version 0: steps 1..lag train at lags 0..lag-1, then lag.
    expected = [min(step - 1, lag) for step in range(1, 7)]
    assert _trained_lags(trainer) == [{e: 8} for e in expected]
    assert [m["rollout"]["staleness_histogram"] for m in metrics] == [{str(e): 8} for e in expected]
    assert [m["rollout"]["lag_max"] for m in metrics] == [m["rollout"]["lag_mean"] for m in metrics] == expected
    rows = _consumed_rows(tmp_path)
    assert [r["lag"] for r in rows] == [e for e in expected for _ in range(8)]  # the log says the lag at training
    # every prompt trained once, in the order dispatched; the next lag batches wait, the next step's prompts fly
    dispatched = list(controller.dispatched)
    assert _trained_prompts_by_step(tmp_path) == [dispatched[i:i + 2] for i in range(0, 12, 2)]
    assert controller.dispatched.most_common(1)[0][1] == 1 and len(dispatched) == 12 + 2 * lag + 2
    assert len(controller.held) == lag and len(controller.inflight) == 2
    assert not any(m["perf"]["async"] for m in metrics)


def test_a_resume_keeps_the_held_batches_and_the_lag(tmp_path):
    from megatron_rl.checkpoint.rl_checkpoint import check_checkpoint

    ckpt = tmp_path / "ckpt"
    flags = ("--controlled-lag", "3", "--save", str(ckpt), "--save-interval", "3")
    first, generator, first_trainer = _controller(tmp_path, *flags, "--train-iters", "3", version_logprobs=True)
    first.run()
    _finish(first, generator)
    second, generator, second_trainer = _controller(tmp_path, *flags, "--train-iters", "6", "--load", str(ckpt),
                                                    version_logprobs=True)
    second.run()
    _finish(second, generator)
    # without the 3 held batches in the checkpoint, step 4 would start a new ramp at lag 0
    lags = _trained_lags(first_trainer) + _trained_lags(second_trainer)
    assert lags == [{0: 8}, {1: 8}, {2: 8}, {3: 8}, {3: 8}, {3: 8}]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout"]["lag_max"] for m in metrics if "rollout" in m] == [0, 1, 2, 3, 3, 3]
    dispatched = list(second.dispatched)
    assert _trained_prompts_by_step(tmp_path) == [dispatched[i:i + 2] for i in range(0, 12, 2)]
    assert second.dispatched.most_common(1)[0][1] == 1
    report = json.loads((tmp_path / "eval.json").read_text())
    assert (report["controlled_lag"], report["prompts_held_at_end"]) == (3, 6)
    assert account(str(tmp_path))["problems"] == []  # the held batches' prompts are open at the end, not lost
    # a resume with another lag is refused before any work
    assert check_checkpoint(str(ckpt), second.spec, second.layout.transformer_impl, controlled_lag=3) == 6
    for lag, saying in ((1, "this run has --controlled-lag 1"), (None, "this run has no --controlled-lag")):
        with pytest.raises(ValueError, match=f"saved with --controlled-lag 3, {saying}; resume with the saved"):
            check_checkpoint(str(ckpt), second.spec, second.layout.transformer_impl, controlled_lag=lag)


def test_a_skipped_update_shortens_the_lag_of_the_next_k_batches(tmp_path):
    controller, generator, trainer = _controller(tmp_path, "--controlled-lag", "2", version_logprobs=True)
    controller.trainer = trainer = RecordingTrainer(skipped={3})
    controller.publish()
    metrics = [controller.rl_step(step, 0.0) for step in range(1, 8)]
    _finish(controller, generator)
    # step 3's update is skipped: no version 3 until step 4, so the batches of steps 4 and 5 lag by 1
    assert _trained_lags(trainer) == [{0: 8}, {1: 8}, {2: 8}, {1: 8}, {1: 8}, {2: 8}, {2: 8}]
    assert [m["rollout"]["lag_max"] for m in metrics] == [0, 1, 2, 1, 1, 2, 2]


# ---- the buffer alone ----------------------------------------------------------------------------------------------

def _rollout(pid, k, version, reward=1.0, status="scored"):
    out = RolloutOutput(f"{pid}#{k}", [1], [2, 3], [-1.0, -1.0], [version, version], "stop")
    return Rollout(out, RequestMeta(pid, k, "x", False, 0.0), RewardResult(reward, status))


def test_buffer_releases_complete_groups_oldest_first_and_names_every_drop():
    buffer = RolloutBuffer(group_size=2, max_staleness=1)
    for r in (_rollout("a", 0, 3, 1.0), _rollout("b", 0, 3, 0.0), _rollout("b", 1, 3, 1.0), _rollout("c", 0, 1),
              _rollout("c", 1, 3, 0.0), _rollout("d", 0, 3, 0.0, "timeout"), _rollout("d", 1, 3, 1.0),
              _rollout("e", 0, 3, 1.0), _rollout("e", 1, 3, 1.0)):
        buffer.add(r)
    with pytest.raises(ValueError, match="duplicate rollout b#1"):
        buffer.add(_rollout("b", 1, 3))
    batch = buffer.take(10, trainer_version=3)
    assert [[r.sample_index for r in g] for g in batch.groups] == [[0, 1]]  # b only; a is incomplete
    assert [g[0].prompt_id for g in batch.groups] == ["b"] and buffer.pending() == 1
    reasons = {(r.prompt_id, r.sample_index): reason for r, reason in batch.outcomes}
    assert reasons[("c", 0)] == "stale: lag 2 > max staleness 1"
    assert reasons[("c", 1)] == reasons[("d", 1)] == "group too small after gates"
    assert reasons[("d", 0)] == "infrastructure failure: timeout"
    assert reasons[("e", 0)] == reasons[("e", 1)] == "group rewards all equal"
    assert batch.popped == 4 and batch.lag_histogram == {0: 7, 2: 1}


def test_discards_are_reported_by_response_length():
    from megatron_rl.observability.metrics import discards_by_length

    def rollout(pid, k, length, version):
        out = RolloutOutput(f"{pid}#{k}", [1], [2] * length, [-1.0] * length, [version] * length, "stop")
        return Rollout(out, RequestMeta(pid, k, "x", False, 0.0), RewardResult(float(k), "scored"))

    buffer = RolloutBuffer(group_size=2, max_staleness=1)
    for r in (rollout("a", 0, 3, 3), rollout("a", 1, 4, 3), rollout("b", 0, 100, 1), rollout("b", 1, 64, 3)):
        buffer.add(r)  # b#0, the long one, began two versions ago
    assert discards_by_length(buffer.take(2, trainer_version=3).outcomes) == {
        "<=4": {"popped": 2}, "<=64": {"popped": 1, "group too small after gates": 1},
        "<=128": {"popped": 1, "stale": 1}}


def test_a_take_drops_no_more_uniform_groups_than_the_oversampling_left():
    buffer = RolloutBuffer(group_size=2, max_staleness=1)
    for prompt in "abc":  # three complete groups without signal, all there at once
        for i in range(2):
            buffer.add(_rollout(prompt, i, 0, 1.0))
    batch = buffer.take(3, trainer_version=0, oversample_left=1)
    assert batch.discards == {"group rewards all equal": 2} and batch.popped == 3
    assert [g[0].prompt_id for g in batch.groups] == ["b", "c"]  # kept: the oversampling is used up


def test_buffer_state_round_trips_through_json():
    import json

    buffer = RolloutBuffer(group_size=2, max_staleness=1)
    buffer.add(_rollout("a", 1, 0, 0.5))
    restored = RolloutBuffer(group_size=2, max_staleness=1)
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert restored._groups == buffer._groups


def test_the_supervised_learning_rate_warms_up_linearly(tmp_path):
    controller, generator, trainer = _controller(tmp_path, "--sft-warmup-iters", "5", "--sft-lr", "1e-3",
                                                 "--sft-lr-warmup-iters", "4")
    controller.sft_warmup()
    _finish(controller, generator)
    lrs = [lr for name, (_, lr) in trainer.commands if name == "sft"]
    assert lrs == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3], rel=1e-12)
