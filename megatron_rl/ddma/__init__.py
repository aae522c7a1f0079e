"""DDMA: the plan of which trainer shard goes to which generator shard (`plan`), the transports that move them
(`transport`), and the versioned, atomic publish of new weights (`sync`). The plan is this package's front door: the
run setup validates it and `--dry-run` prints its estimate before any weight exists."""

from megatron_rl.ddma.plan import (
    Plan,
    full_experts_baseline,
    gather_broadcast_baseline,
    make_plan,
    summarize,
)
from megatron_rl.ddma.plan import validate as validate_plan

__all__ = ["Plan", "full_experts_baseline", "gather_broadcast_baseline", "make_plan", "summarize", "validate_plan"]
