"""The rollout buffer: scored rollouts wait here, grouped per prompt, until the trainer consumes them.

Every rollout carries the trajectory contract: prompt id, sampled ids, the behavior log-prob of each token and
its convention, the weight version of each token, loss mask, finish reason, reward and its status, and the
times needed for age. A group (all samples of one prompt) is released to
the trainer whole; on release the gates of `megatron_rl.algorithms.gates` run, and every dropped sample
keeps its reason:
- stale: the oldest token version lags the trainer by more than `max_staleness` versions;
- infrastructure failure: the reward could not be computed (excluded, never a reward of 0);
- a group left with fewer than two valid samples, or whose rewards are all equal (no signal under a
  group baseline), is dropped whole.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch

from megatron_rl.algorithms import lag_histogram
from megatron_rl.algorithms.gates import failure_gate, version_gate
from megatron_rl.rewards.types import EXCLUDED_STATUSES, RewardResult
from megatron_rl.rollout.types import RequestMeta, RolloutOutput


@dataclasses.dataclass
class Rollout:
    """One scored sample: the engine's output, the request it answers, and its reward, composed (not copied)."""

    output: RolloutOutput
    meta: RequestMeta
    reward: RewardResult
    finished_at: float = dataclasses.field(default_factory=time.time)

    @property
    def prompt_id(self) -> str:
        return self.meta.prompt_id

    @property
    def sample_index(self) -> int:
        return self.meta.sample_index

    @property
    def oldest_version(self) -> int:
        versions = self.output.policy_versions
        return min(versions) if versions else -1

    @property
    def failed(self) -> bool:
        return self.reward.is_failure or self.output.finish_reason == "failure"

    def to_dict(self) -> dict:
        """JSON-ready (the RL checkpoint's buffered rollouts); recorded routes as base64 of their int16 bytes."""
        routes = self.output.routed_experts
        d = dataclasses.asdict(dataclasses.replace(self, output=dataclasses.replace(self.output, routed_experts=None)))
        if routes is not None:
            d["output"]["routed_experts"] = {"shape": list(routes.shape),
                                             "int16": base64.b64encode(routes.numpy().tobytes()).decode("ascii")}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Rollout:
        output = dict(d["output"])
        routes = output.get("routed_experts")
        if routes is not None:
            raw = bytearray(base64.b64decode(routes["int16"]))
            output["routed_experts"] = torch.frombuffer(raw, dtype=torch.int16).view(*routes["shape"]) if raw else \
                torch.empty(routes["shape"], dtype=torch.int16)
        return cls(RolloutOutput(**output), RequestMeta(**d["meta"]), RewardResult(**d["reward"]), d["finished_at"])


@dataclasses.dataclass
class Batch:
    groups: list[list[Rollout]]
    discards: Counter
    lag_histogram: dict[int, int]
    age_seconds_mean: float
    popped: int = 0  # complete groups taken out of the buffer, released or dropped
    sampled_rewards: list = dataclasses.field(default_factory=list)  # of every popped rollout with a reward
    outcomes: list = dataclasses.field(default_factory=list)  # (rollout, None if trained else the reason)


class RolloutBuffer:
    def __init__(self, group_size: int, max_staleness: int, drop_uniform_groups: bool = True):
        if group_size < 2:
            raise ValueError(f"--n-samples-per-prompt must be >= 2 for a group baseline, got {group_size}")
        if max_staleness < 0:
            raise ValueError(f"--max-staleness must be >= 0, got {max_staleness}")
        self.group_size, self.max_staleness = group_size, max_staleness
        self.drop_uniform_groups = drop_uniform_groups
        self._groups: OrderedDict[str, list[Rollout]] = OrderedDict()
        self.discards: Counter = Counter()  # cumulative, by reason

    def add(self, rollout: Rollout) -> None:
        group = self._groups.setdefault(rollout.prompt_id, [])
        if any(r.sample_index == rollout.sample_index for r in group):
            raise ValueError(f"duplicate rollout {rollout.prompt_id}#{rollout.sample_index}")
        group.append(rollout)

    def sample_indices(self, prompt_id: str) -> set[int]:
        return {r.sample_index for r in self._groups.get(prompt_id, [])}

    def complete_groups(self) -> int:
        return sum(len(g) == self.group_size for g in self._groups.values())

    def pending(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def is_complete(self, prompt_id: str) -> bool:
        return len(self._groups.get(prompt_id, ())) == self.group_size

    def take(self, num_groups: int, trainer_version: int, drop_uniform: bool | None = None,
             oversample_left: int | None = None, first: Sequence[str] = ()) -> Batch:
        """Release up to `num_groups` complete groups after the gates: those of `first` that are complete, then
        the others in the order they completed. `drop_uniform=False` keeps groups whose rewards are all equal
        (zero advantage) for this call; `oversample_left`: a group popped after that many others in this call is
        kept even so (the step's --max-oversample is used up)."""
        drop_uniform = self.drop_uniform_groups if drop_uniform is None else drop_uniform
        now = time.time()
        released, discards, lags, ages, rewards, outcomes = [], Counter(), [], [], [], []
        popped = 0
        leading = set(first)
        complete = [p for p in first if self.is_complete(p)]
        complete += [p for p in self._groups if self.is_complete(p) and p not in leading]
        ready = complete[:num_groups]
        for earlier, prompt_id in enumerate(ready):
            group = sorted(self._groups.pop(prompt_id), key=lambda r: r.sample_index)
            popped += 1
            lags += [r.oldest_version for r in group if r.output.policy_versions]  # (a failed trajectory: none)
            rewards += [r.reward.reward for r in group if not r.failed]
            # a failure is the reason before staleness: a trajectory that failed has no policy token to be stale
            gate = failure_gate([r.reward.status if r.reward.is_failure else "failure" if r.failed else "ok"
                                 for r in group], EXCLUDED_STATUSES + ("failure",)) & \
                version_gate(trainer_version, [r.oldest_version for r in group], self.max_staleness)
            kept = [r for r, keep in zip(group, gate.keep.tolist()) if keep]
            discards.update(r.split(":")[0] for r in gate.reasons if r)
            outcomes += [(r, reason) for r, reason in zip(group, gate.reasons) if reason]
            group_reason = None
            if len(kept) < 2:
                group_reason = "group too small after gates"
            elif drop_uniform and (oversample_left is None or earlier < oversample_left) and \
                    len({r.reward.reward for r in kept}) == 1:
                group_reason = "group rewards all equal"
            outcomes += [(r, group_reason) for r in kept]
            if group_reason:
                if kept:
                    discards[group_reason] += len(kept)
                continue
            ages += [now - r.meta.dispatched_at for r in kept]
            released.append(kept)
        self.discards.update(discards)
        return Batch(released, discards, lag_histogram(trainer_version, lags), sum(ages) / max(len(ages), 1), popped,
                     rewards, outcomes)

    def state_dict(self) -> dict:
        return {"groups": {p: [r.to_dict() for r in g] for p, g in self._groups.items()},
                "discards": dict(self.discards)}

    def load_state_dict(self, state: dict) -> None:
        self._groups = OrderedDict((p, [Rollout.from_dict(r) for r in g]) for p, g in state["groups"].items())
        self.discards = Counter(state["discards"])
