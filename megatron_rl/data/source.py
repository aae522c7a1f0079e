"""Where the controller's prompts come from: a prompt dataset (--prompt-data) or the synthetic arithmetic task."""

from __future__ import annotations

from megatron_rl.data.arithmetic import ArithmeticTask
from megatron_rl.data.dataset import PromptDataset
from megatron_rl.data.records import RecordFields


class PromptSource:
    """RL prompts (a prompt dataset, or the arithmetic task), held-out eval prompts, and SFT examples."""

    SFT_OFFSET = 10**7  # SFT examples are drawn from a separate index range of the task's train split

    def __init__(self, args):
        self.dataset = None
        if args.prompt_data:
            fields = RecordFields(args.input_key, args.label_key, args.metadata_key)
            self.dataset = PromptDataset(args.prompt_data, seed=args.seed, fields=fields)
            if self.dataset.first_message_prompt and not args.apply_chat_template:
                raise ValueError(f"{self.dataset.first_message_prompt}: field {args.input_key!r} is a message "
                                 "list, which needs --apply-chat-template")
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
            return self.dataset.next(n)
        out = self.task.problems(self.cursor, n)
        self.cursor += n
        return out

    def eval(self, n: int) -> list[dict]:
        return [] if self.dataset is not None else self.task.problems(0, n, "eval")

    def sft(self, n: int) -> list[dict]:
        if self.dataset is not None:
            raise ValueError("--sft-warmup-iters needs the arithmetic task (no --prompt-data)")
        out = self.task.problems(self.SFT_OFFSET + self.sft_cursor, n)
        self.sft_cursor += n
        return out
