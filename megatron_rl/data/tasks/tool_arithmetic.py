"""A tool-use task that the project makes itself (no downloads): arithmetic with three two-digit operands, which the
tiny model cannot do reliably in its head, and a calculator tool that can.

    python -m megatron_rl.data.tasks.tool_arithmetic --out DIR [--train 4000 --eval 200 --seed 0]

writes DIR/train.jsonl and DIR/eval.jsonl (disjoint, distinct problems as chat records), DIR/sft_tool.jsonl (two
demonstrations per training problem: the tool call, then the answer after the tool's result, in the chat format
the multi-turn rollout renders), DIR/sft_direct.jsonl (the answer without the tool, for the baseline without it),
DIR/tools.json (the calculator's declaration) and DIR/tokenizer/: a character tokenizer with the chat tokens
(<|im_start|>, <|im_end|>, <tool_call>, <tool_response> and their ends, the role names and the tool call's
keys as single tokens) and a Qwen-style chat template whose tool turn is
`<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n`.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from megatron_rl.data.tasks.splits import distinct_records, write_jsonl
from megatron_rl.tools import built_in_tools, format_tool_call

CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Whole words for the chat roles and the tool call's JSON keys, as a BPE vocabulary would have them: a tool call
# is then about 30 tokens, not 75.
WORDS = ["system", "user", "assistant", "name", "arguments", "calculator", "expression", "\\boxed"]
CHARS = "0123456789+-*/=().,^ " + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" + "\\{}#:$\"_\n?!'[]"
SYSTEM_PROMPT = "Use the calculator."


def problem(rng: random.Random) -> tuple[str, str]:
    """(expression, its value) with three two-digit operands, + and - and *."""
    a, b, c = (rng.randint(10, 99) for _ in range(3))
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expression = f"{a}{op1}{b}{op2}{c}"
    return expression, str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and + - * only


def records(seed: int, split: str, count: int) -> list[dict]:
    """`count` distinct problems of `split` as chat records: the question, and the value as the answer."""
    return distinct_records(problem, seed, split, count, question=lambda expression: f"{expression}=?")


def answer_text(answer: str) -> str:
    return f"\\boxed{{{answer}}}"


def tool_demonstrations(record: dict) -> list[dict]:
    """The two turns the policy takes with the tool, as conversations ending in the turn to imitate."""
    expression = record["messages"][-1]["content"].removesuffix("=?")
    call = {"role": "assistant", "content": format_tool_call("calculator", {"expression": expression})}
    chat = [{"role": "system", "content": SYSTEM_PROMPT}, *record["messages"]]
    return [{"id": f"{record['id']}-call", "messages": [*chat, call], "answer": record["answer"]},
            {"id": f"{record['id']}-answer", "messages": [*chat, call, {"role": "tool", "content": record["answer"]},
                                                          {"role": "assistant", "content":
                                                           answer_text(record["answer"])}],
             "answer": record["answer"]}]


def build_tokenizer():
    from megatron_rl.data.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(CHARS)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": CHAT_TOKENS})
    tok.add_tokens(TOOL_TOKENS + WORDS)  # not "special": decoding keeps them, so the tool calls can be parsed
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write(out: str, train: int, eval_size: int, seed: int) -> None:
    os.makedirs(out, exist_ok=True)
    splits = {"train": records(seed, "train", train), "eval": records(seed, "eval", eval_size)}
    for name, rows in splits.items():
        write_jsonl(os.path.join(out, f"{name}.jsonl"), rows)
    write_jsonl(os.path.join(out, "sft_tool.jsonl"), [d for r in splits["train"] for d in tool_demonstrations(r)])
    write_jsonl(os.path.join(out, "sft_direct.jsonl"), [
        {"id": r["id"], "messages": [{"role": "system", "content": "Answer."}, *r["messages"],
                                     {"role": "assistant", "content": answer_text(r["answer"])}], "answer": r["answer"]}
        for r in splits["train"]])
    with open(os.path.join(out, "tools.json"), "w") as f:
        json.dump(built_in_tools(["calculator"]), f, indent=1)
    build_tokenizer().save_pretrained(os.path.join(out, "tokenizer"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--eval", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write(args.out, args.train, args.eval, args.seed)
    print(f"wrote {args.train} training and {args.eval} held-out problems, demonstrations, tools.json and a "
          f"tokenizer to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
