"""Where the controller's prompts come from: a JSONL dataset (--data-path) or the synthetic arithmetic task."""

from __future__ import annotations

from megatron_rl.data.arithmetic import ArithmeticTask
from megatron_rl.data.jsonl import JsonlDataset


class PromptSource:
    """RL prompts (a JSONL dataset, or the arithmetic task), held-out eval prompts, and SFT examples."""

    SFT_OFFSET = 10**7  # SFT examples are drawn from a separate index range of the task's train split

    def __init__(self, args):
        self.dataset = JsonlDataset(args.data_path, seed=args.seed) if args.data_path else None
        self.task = ArithmeticTask(seed=args.seed, min_digits=args.task_min_digits, max_digits=args.task_max_digits,
                                   num_operands=args.task_operands)
        self.cursor = 0
        self.sft_cursor = 0

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "sft_cursor": self.sft_cursor,
                "dataset": self.dataset.state_dict() if self.dataset is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.sft_cursor = state["cursor"], state["sft_cursor"]
        if self.dataset is not None:
            self.dataset.load_state_dict(state["dataset"])

    def next(self, n: int) -> list[dict]:
        if self.dataset is not None:
            return [dict(r, id=str(r["id"])) for r in self.dataset.next(n)]
        out = self.task.problems(self.cursor, n)
        self.cursor += n
        return out

    def eval(self, n: int) -> list[dict]:
        return [] if self.dataset is not None else self.task.problems(0, n, "eval")

    def sft(self, n: int) -> list[dict]:
        if self.dataset is not None:
            raise ValueError("--sft-warmup-iters needs the arithmetic task (no --data-path)")
        out = self.task.problems(self.SFT_OFFSET + self.sft_cursor, n)
        self.sft_cursor += n
        return out
