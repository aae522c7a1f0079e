"""The controller's loop and the rollout buffer at their seams, in one process: the real `Controller` and
`RolloutBuffer` with in-process channels, a scripted generator thread and a recording trainer (no model, no
process group). Fast checks of batching by groups, the staleness gate, dynamic sampling, async dispatch ahead,
and the resend of lost samples after a resume; the end-to-end runs (test_controller.py) cover the real
executors."""

import json
import os
import queue
import threading
from collections import Counter

import pytest

from megatron_rl.arguments import parse_args
from megatron_rl.buffer import Rollout, RolloutBuffer
from megatron_rl.controller import Controller
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.models.layout import GeneratorLayout, TrainerLayout
from megatron_rl.rewards.result import RewardResult
from megatron_rl.rollout.types import RequestMeta, RolloutOutput
from megatron_rl.run_setup import RunSetup, model_spec

TOKENIZER = build_char_tokenizer()
LEADER = 1


REWARDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loop_rewards.py")  # for --custom-rm-path


class LocalChannel:
    """A channel in one process: `send(message, dst)` to a queue, `recv()` from it."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()

    def send(self, message, dst):
        self.queue.put((message, dst))

    def recv(self, src=None):
        return self.queue.get(timeout=30)

    def flush(self):
        pass


class ScriptedGenerator(threading.Thread):
    """Answers each "requests" message at once, one message per group (as the real worker does): odd samples get
    the right answer and even ones a wrong one; every token carries the current weight version, except that the
    first `stale_prompts` RL prompts get tokens 2 versions old. Records every request id it served."""

    def __init__(self, control: LocalChannel, rollouts: LocalChannel, stale_prompts: int = 0):
        super().__init__(daemon=True)
        self.control, self.rollouts, self.stale_prompts = control, rollouts, stale_prompts
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
                    out = RolloutOutput(rid, prompt, tokens, [-1.0] * len(tokens), [version] * len(tokens), "stop")
                    groups.setdefault(meta.group, []).append((out, meta))
                for group in groups.values():
                    self.rollouts.queue.put((("rollouts", (group, {"tokens": 1})), LEADER))


class RecordingTrainer:
    """Takes the trainer executor's commands and records them; every update succeeds."""

    def __init__(self):
        self.commands = []

    def command(self, name, payload=None):
        self.commands.append((name, payload))
        if name in ("train", "sft"):
            return {"update_successful": True, "tokens_per_s": 1.0, "loss": 0.0}
        return None

    def trained(self):
        return [p for n, p in self.commands if n == "train"]


def _controller(tmp_path, *flags, stale_prompts=0, reward="reward_exact"):
    args = parse_args(["--global-batch-size", "8", "--n-samples-per-prompt", "4", "--custom-rm-path",
                       f"{REWARDS}:{reward}", "--reward-num-workers", "1", "--reward-timeout", "60",  # a busy machine
                       "--output-dir", str(tmp_path), "--eval-size", "4", "--log-rollouts", *flags])
    setup = RunSetup(args, TOKENIZER, model_spec(args, TOKENIZER), TrainerLayout(), GeneratorLayout(first_rank=1))
    control, rollouts = LocalChannel(), LocalChannel()
    generator = ScriptedGenerator(control, rollouts, stale_prompts)
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
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert {r["prompt_id"] for r in rows if r["outcome"].startswith("stale")} == set(generator.prompts[:2])
    assert {r["prompt_id"] for r in rows if r["outcome"] == "trained"} == set(generator.prompts[2:4])
    assert len(trainer.trained()[0]) == 8  # the batch was filled by the groups that replaced them


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
    assert reasons[("d", 0)] == "infrastructure failure: failure"
    assert reasons[("e", 0)] == reasons[("e", 1)] == "group rewards all equal"
    assert batch.popped == 4 and batch.lag_histogram == {0: 7, 2: 1}


def test_buffer_state_round_trips_through_json():
    import json

    buffer = RolloutBuffer(group_size=2, max_staleness=1)
    buffer.add(_rollout("a", 1, 0, 0.5))
    restored = RolloutBuffer(group_size=2, max_staleness=1)
    restored.load_state_dict(json.loads(json.dumps(buffer.state_dict())))
    assert restored._groups == buffer._groups
