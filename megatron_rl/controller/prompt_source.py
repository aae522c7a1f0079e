"""Where the controller's prompts come from: a prompt dataset (--prompt-data) or the synthetic arithmetic task."""

from __future__ import annotations

import os

from megatron_rl.data.dataset import PromptDataset
from megatron_rl.data.records import RecordFields
from megatron_rl.data.tasks.arithmetic import ArithmeticTask


def open_prompt_data(path: str, args, flag: str = "--prompt-data", shuffle: bool = True) -> PromptDataset:
    """A prompt file read with the run's --input-key/--label-key/--metadata-key; message-list prompts need
    --apply-chat-template. `flag` names the file in errors."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r}: no such file")
    fields = RecordFields(args.input_key, args.label_key, args.metadata_key)
    dataset = PromptDataset(path, seed=args.seed, shuffle=shuffle, fields=fields)
    if dataset.first_message_prompt and not args.apply_chat_template:
        raise ValueError(f"{dataset.first_message_prompt}: field {args.input_key!r} is a message list, which needs "
                         "--apply-chat-template")
    return dataset


def open_sft_data(path: str, args) -> PromptDataset:
    """--sft-data: conversations (read like --prompt-data) whose last message is the assistant's, the target."""
    dataset = open_prompt_data(path, args, flag="--sft-data")
    for index in range(len(dataset)):
        prompt = dataset.record(index)["prompt"]
        if isinstance(prompt, str) or len(prompt) < 2 or prompt[-1]["role"] != "assistant":
            raise ValueError(f"--sft-data {path!r}: record {index} (line or row {index + 1}) must be a message list "
                             f"ending with an assistant message, the text to imitate")
    return dataset


class PromptSource:
    """RL prompts (a prompt dataset, or the arithmetic task), held-out eval prompts, and SFT examples."""

    SFT_OFFSET = 10**7  # SFT examples are drawn from a separate index range of the task's train split

    def __init__(self, args):
        self.dataset = open_prompt_data(args.prompt_data, args) if args.prompt_data else None
        self.sft_dataset = open_sft_data(args.sft_data, args) if getattr(args, "sft_data", None) else None
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
        """`n` distinct held-out problems of the task (none with --prompt-data)."""
        return [] if self.dataset is not None else self.task.distinct_problems(n, "eval")

    def sft(self, n: int) -> list[dict]:
        """`n` supervised examples: {"prompt", "answer"} where the answer is the text to imitate (--sft-data: a
        conversation's last, assistant message; the task: the problem's answer)."""
        if self.sft_dataset is not None:
            return [dict(r, prompt=r["prompt"][:-1], answer=r["prompt"][-1]["content"])
                    for r in self.sft_dataset.next(n)]
        if self.dataset is not None:
            raise ValueError("--sft-warmup-iters with --prompt-data needs --sft-data (conversations to imitate)")
        out = self.task.problems(self.SFT_OFFSET + self.sft_cursor, n)
        self.sft_cursor += n
        return out
