"""A synthetic arithmetic task that a tiny model learns in minutes on a CPU (no downloads).

Problem i of a split is a pure function of (seed, split, i), so a run can resume from a cursor and two runs
with the same seed see the same problems. Train and eval are disjoint by construction: each problem's
text is hashed, and 1 in `eval_every` hashes belongs to eval.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    seed: int = 0
    min_digits: int = 1
    max_digits: int = 2
    num_operands: int = 2
    operators: str = "+-"
    eval_every: int = 10

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"digits must satisfy 1 <= min ({self.min_digits}) <= max ({self.max_digits})")
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {self.operators!r}")

    def _split_of(self, text: str) -> str:
        h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        return "eval" if h % self.eval_every == 0 else "train"

    def problem(self, index: int, split: str = "train") -> dict:
        """{"id", "prompt", "answer"} of problem `index` of `split` ("train" or "eval")."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.seed}:{split}:{index}")
        while True:
            numbers = [rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)
                       for d in (rng.randint(self.min_digits, self.max_digits) for _ in range(self.num_operands))]
            ops = [rng.choice(self.operators) for _ in range(self.num_operands - 1)]
            expression = str(numbers[0]) + "".join(f"{o}{n}" for o, n in zip(ops, numbers[1:]))
            if self._split_of(expression) == split:
                break
        return {"id": f"{split}-{index}", "prompt": expression + "=", "answer": str(eval(expression))}  # noqa: S307

    def problems(self, start: int, count: int, split: str = "train") -> list[dict]:
        return [self.problem(i, split) for i in range(start, start + count)]
