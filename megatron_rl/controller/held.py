"""--controlled-lag K's held batches: each step's groups, collected under one weight version, wait in a FIFO of
K + 1 and are trained K versions later (`controller.loop` says how the FIFO fills and drains). A held batch is part
of the RL checkpoint."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict

from megatron_rl.controller.buffer import Rollout


@dataclasses.dataclass
class HeldBatch:
    """One step's groups, collected at trainer `version` and held until trained (--controlled-lag); `seen`: what
    `Controller.collect` popped for them (discards, lags at `version`, rewards, ages, outcomes)."""

    version: int
    groups: list[list[Rollout]]
    seen: dict

    def released_at(self, version: int) -> tuple[list, dict]:
        """The groups and their figures as trained at `version`: lags measured from it, ages up to now."""
        shift, now = version - self.version, time.time()
        lags = Counter({lag + shift: n for lag, n in self.seen["lags"].items()})
        ages = [now - r.meta.dispatched_at for g in self.groups for r in g]
        return self.groups, {**self.seen, "lags": lags, "ages": ages}

    def to_dict(self) -> dict:
        """JSON-ready (the RL checkpoint). The groups are the trained outcomes, by prompt: not stored twice."""
        seen = self.seen
        return {"version": self.version, "discards": dict(seen["discards"]),
                "lags": {str(k): v for k, v in seen["lags"].items()}, "sampled_rewards": seen["sampled_rewards"],
                "outcomes": [[r.to_dict(), reason] for r, reason in seen["outcomes"]]}

    @classmethod
    def from_dict(cls, d: dict) -> HeldBatch:
        outcomes = [(Rollout.from_dict(r), reason) for r, reason in d["outcomes"]]
        groups = defaultdict(list)
        for r, reason in outcomes:
            if reason is None:
                groups[r.prompt_id].append(r)
        seen = {"discards": Counter(d["discards"]), "lags": Counter({int(k): v for k, v in d["lags"].items()}),
                "sampled_rewards": d["sampled_rewards"], "ages": [], "outcomes": outcomes}  # ages: at release
        return cls(d["version"], list(groups.values()), seen)
