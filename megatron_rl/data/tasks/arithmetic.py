"""A synthetic arithmetic task that a tiny model learns in minutes on a CPU (no downloads).

Problem i of a split is a pure function of (seed, split, i), so a run can resume from a cursor and two runs
with the same seed see the same problems. Train and eval are disjoint by construction: each problem's
text is hashed, and 1 in `eval_every` hashes belongs to eval. Training draws may repeat an expression; a held-out
set (`distinct_problems`) never does, so its accuracy counts distinct problems the model never trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random

from megatron_rl.data.tasks.splits import split_of


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
        return split_of(text, self.eval_every)

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

    ENUMERATE_LIMIT = 200_000  # spaces up to this many expressions are listed whole to split them exactly

    def space_size(self) -> int:
        """How many distinct expressions the task can write (both splits)."""
        numbers = sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in range(self.min_digits, self.max_digits + 1))
        return numbers ** self.num_operands * len(set(self.operators)) ** (self.num_operands - 1)

    def _expressions(self):
        numbers = [str(n) for d in range(self.min_digits, self.max_digits + 1)
                   for n in range(0 if d == 1 else 10 ** (d - 1), 10 ** d)]
        for operands in itertools.product(numbers, repeat=self.num_operands):
            for ops in itertools.product(sorted(set(self.operators)), repeat=self.num_operands - 1):
                yield operands[0] + "".join(o + n for o, n in zip(ops, operands[1:]))

    @functools.cache  # noqa: B019 (a frozen dataclass: tasks equal by value share one count)
    def split_size(self, split: str = "eval") -> int | None:
        """The exact number of distinct expressions in `split`, or None for a space too large to list."""
        if self.space_size() > self.ENUMERATE_LIMIT:
            return None
        return sum(self._split_of(e) == split for e in self._expressions())

    def check_distinct_count(self, count: int, split: str = "eval") -> int | None:
        """The split's size (None: too large to list), after refusing a `count` of distinct problems it lacks."""
        available = self.split_size(split)
        if available is not None and count > available:
            raise ValueError(f"--eval-size {count}: the task's {split} split has only {available} distinct problems "
                             f"({self.space_size()} expressions in all); lower it or widen the task "
                             "(--task-max-digits, --task-operands)")
        return available

    def distinct_problems(self, count: int, split: str = "eval") -> list[dict]:
        """`count` different problems of `split`, a pure function of (seed, split, count): drawn like `problems`
        (the same distribution), repeats skipped; in a small space, once draws mostly repeat, the rest comes from
        the split's unseen expressions in a seeded order."""
        available = self.check_distinct_count(count, split)
        out, seen, index = [], set(), 0
        while len(out) < count and (available is None or index < 20 * count):
            problem = self.problem(index, split)
            index += 1
            if problem["prompt"] not in seen:
                seen.add(problem["prompt"])
                out.append(dict(problem, id=f"{split}-{len(out)}"))
        if len(out) < count:
            rest = [e for e in self._expressions() if self._split_of(e) == split and e + "=" not in seen]
            random.Random(f"{self.seed}:{split}:rest").shuffle(rest)
            out += [{"id": f"{split}-{len(out) + i}", "prompt": e + "=", "answer": str(eval(e))}  # noqa: S307
                    for i, e in enumerate(rest[:count - len(out)])]
        return out

    def describe(self, split: str = "eval") -> dict:
        """The space a held-out set is drawn from, for eval.json."""
        return {"expressions": self.space_size(), f"{split}_split": self.split_size(split),
                "digits": [self.min_digits, self.max_digits], "operands": self.num_operands,
                "operators": self.operators}
