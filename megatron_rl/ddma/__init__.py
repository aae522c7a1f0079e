"""DDMA: the plan of which trainer shard goes to which generator shard (`plan`), the transports that move them
(`transport`), and the versioned, atomic publish of new weights in bounded rounds (`sync`). The plan and its rounds
are this package's front door: the run setup validates the plan and `--dry-run` prints its estimate and rounds
before any weight exists."""

from megatron_rl.ddma.plan import (
    Plan,
    full_experts_baseline,
    gather_broadcast_baseline,
    make_plan,
    summarize,
)
from megatron_rl.ddma.plan import validate as validate_plan
from megatron_rl.ddma.sync import ROUNDS_IN_FLIGHT, schedule

__all__ = ["ROUNDS_IN_FLIGHT", "Plan", "full_experts_baseline", "gather_broadcast_baseline", "make_plan", "schedule",
           "summarize", "validate_plan"]
