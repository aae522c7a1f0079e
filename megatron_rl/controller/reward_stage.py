"""The reward stage: a thread between the generators and the rollout buffer.

It receives each generator message as it arrives and scores its rollouts (in the reward function's worker
processes), so scoring overlaps generation and training instead of running on the trainer's critical path.
The controller takes scored messages from `get`. The thread ends after every generator said it stopped; an
exception in it is handed to the controller by `get`, never swallowed. The optional `shaping` (the overlong
penalty) adjusts RL rollouts' rewards by their length; evaluation rewards stay as scored.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

from megatron_rl.rewards.custom import as_result
from megatron_rl.rewards.shaping import OverlongPenalty
from megatron_rl.rewards.types import RewardResult, RewardSample
from megatron_rl.rollout.types import RequestMeta, RolloutOutput


@dataclasses.dataclass
class Scored:
    """One generator message after the reward stage: `kind` "rollouts" or "stopped"."""

    kind: str
    source: int  # the generator rank that sent it
    stats: dict  # that generator's cumulative counters
    rollouts: list[tuple[RolloutOutput, RequestMeta]] = dataclasses.field(default_factory=list)
    rewards: list[RewardResult] = dataclasses.field(default_factory=list)
    reward_s: float = 0.0  # time spent scoring


class RewardStage:
    def __init__(self, channel, tokenizer, reward_fn, num_generators: int, stop_token_ids,
                 shaping: OverlongPenalty | None = None):
        """`channel.recv()` gives `((kind, payload), source)` messages of the generators; `stop_token_ids` are
        dropped from a response before it is decoded and scored."""
        self.channel, self.tokenizer, self.reward_fn = channel, tokenizer, reward_fn
        self.stop_token_ids = frozenset(stop_token_ids)
        self.num_generators, self.shaping = num_generators, shaping
        self._scored: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="reward-stage").start()

    def _run(self) -> None:
        stopped = 0
        try:
            while stopped < self.num_generators:
                (kind, payload), source = self.channel.recv()
                if kind == "alive":  # a generator's answer to a keep-alive: nothing to score
                    continue
                if kind == "stopped":
                    stopped += 1
                    self._scored.put(Scored("stopped", source, payload))
                    continue
                rollouts, stats = payload
                start = time.perf_counter()
                rewards = self.score(rollouts)
                if self.shaping is not None:
                    rewards = [r if m.is_eval else self.shaping(r, len(o.token_ids))
                               for r, (o, m) in zip(rewards, rollouts)]
                self._scored.put(Scored("rollouts", source, stats, rollouts, rewards, time.perf_counter() - start))
        except BaseException as e:  # noqa: BLE001 - raised again in the controller's thread by get()
            self._scored.put(e)

    def score(self, rollouts: list[tuple[RolloutOutput, RequestMeta]]) -> list[RewardResult]:
        """One result per rollout. An agent trajectory whose environment failed is excluded with the reason
        ("environment-failure"), one that brings its own reward keeps it; the rest go to the reward function."""
        results: list[RewardResult | None] = [None] * len(rollouts)
        for i, (output, _) in enumerate(rollouts):
            trajectory = output.trajectory or {}
            if trajectory.get("environment_failure"):
                results[i] = RewardResult(0.0, "environment-failure", None, trajectory["environment_failure"])
            elif trajectory.get("reward") is not None:  # checked as a --custom-rm-path function's return value
                results[i] = as_result(trajectory["reward"], "of the rollout program")
        todo = [i for i, r in enumerate(results) if r is None]
        if todo:
            for i, result in zip(todo, self.reward_fn([self.sample(*rollouts[i]) for i in todo])):
                results[i] = result
        return results

    def sample(self, output: RolloutOutput, meta: RequestMeta) -> RewardSample:
        """What the reward function scores: the response decoded without stop tokens, or the text an agent
        trajectory names (its final answer), with the trajectory's metadata beside the record's."""
        trajectory = output.trajectory or {}
        response = trajectory.get("response")
        if response is None:
            response = self.tokenizer.decode([t for t in output.token_ids if t not in self.stop_token_ids])
        metadata = {**meta.metadata, **trajectory.get("metadata", {})}
        return RewardSample(prompt=self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=True),
                            response=response, label=meta.reference, metadata=metadata,
                            finish_reason=output.finish_reason)

    def get(self, timeout: float | None = None) -> Scored:
        """The next scored message; `timeout` 0: only if one is ready. Raises queue.Empty after `timeout`."""
        item = self._scored.get_nowait() if timeout == 0 else self._scored.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item
