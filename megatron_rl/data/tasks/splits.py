"""The tasks' train / held-out split and their distinct chat records, shared by every task.

A problem's split is a pure function of its text (a hash), so that no held-out problem is ever trained on, however
many are drawn; records are drawn from a seeded stream of problems, keeping the distinct ones of the split.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable


def split_of(text: str, eval_every: int = 20) -> str:
    """"eval" for about one text in `eval_every`, else "train"."""
    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    return "eval" if h % eval_every == 0 else "train"


def distinct_records(problem: Callable[[random.Random], tuple[str, str]], seed: int, split: str, count: int,
                     question: Callable[[str], str] = str) -> list[dict]:
    """`count` distinct problems of `split` as chat records ({"id", "messages", "answer"}): `problem(rng)` gives
    (text, answer), and the user's message is `question(text)`."""
    out, seen, index = [], set(), 0
    while len(out) < count:
        text, answer = problem(random.Random(f"{seed}:{split}:{index}"))
        index += 1
        if index > 1000 * count:
            raise ValueError(f"only {len(out)} distinct {split} problems exist; asked for {count}")
        if split_of(text) != split or text in seen:
            continue
        seen.add(text)
        out.append({"id": f"{split}-{len(out)}", "messages": [{"role": "user", "content": question(text)}],
                    "answer": answer})
    return out


def write_jsonl(path: str, rows) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
