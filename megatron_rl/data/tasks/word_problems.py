"""A chat-format math dataset that the project makes itself (no downloads): arithmetic and fraction word
problems in OpenAI message form, reference answers (fractions in LaTeX), and a byte-level BPE tokenizer trained
on the problems with the `tokenizers` library and saved in HF form with a chat template.

    python -m megatron_rl.data.tasks.word_problems --out DIR [--train 4000 --eval 200 --seed 0] [--no-tokenizer]

writes DIR/train.jsonl and DIR/eval.jsonl ({"messages": [...], "answer": ...}: RL prompts and held-out prompts,
disjoint), DIR/sft.jsonl (the training problems' conversations with a worked answer "\\boxed{...}" as the assistant
turn, for the supervised warm-up) and DIR/tokenizer/ (unless --no-tokenizer: a pretrained model brings its own).
Problems are pure functions of (seed, split, index).
"""

from __future__ import annotations

import argparse
import os
import random
from fractions import Fraction

from megatron_rl.data.tasks.splits import distinct_records, write_jsonl

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL_TOKENS = ["<pad>", "<bos>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana"]
ITEMS = ["apples", "marbles", "books", "stamps", "coins", "shells"]


def latex(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def problem(rng: random.Random) -> tuple[str, str]:
    """(question, reference answer) of one random problem."""
    kind = rng.choice(["sum", "difference", "product", "fraction"])
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 19), rng.randint(2, 9)
    if kind == "sum":
        return f"{name} has {a} {item} and finds {b} more. How many {item} does {name} have now?", str(a + b)
    if kind == "difference":
        return f"{name} has {a + b} {item} and gives away {b}. How many {item} are left?", str(a)
    if kind == "product":
        return f"{name} buys {b} bags with {a} {item} each. How many {item} is that?", str(a * b)
    d = rng.randint(2, 6)
    x, y = Fraction(rng.randint(1, d - 1), d), Fraction(1, rng.randint(2, 6))
    return (f"{name} eats {x} of a pie and then {y} of it. How much of the pie did {name} eat? Give the answer as "
            "a fraction."), latex(x + y)


def records(seed: int, split: str, count: int) -> list[dict]:
    """`count` distinct problems of `split`, as message-list records."""
    return distinct_records(problem, seed, split, count)


def train_tokenizer(texts: list[str], vocab_size: int = 600):
    """A byte-level BPE (digits kept one per token) trained on `texts`, as an HF fast tokenizer with the chat
    template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<|end|>",
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def solution(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


def write(out: str, train: int, eval_size: int, seed: int, tokenizer: bool = True) -> None:
    os.makedirs(out, exist_ok=True)
    splits = {"train": records(seed, "train", train), "eval": records(seed, "eval", eval_size)}
    for name, rows in splits.items():
        write_jsonl(os.path.join(out, f"{name}.jsonl"), rows)
    write_jsonl(os.path.join(out, "sft.jsonl"), [
        {"id": r["id"], "messages": [*r["messages"], {"role": "assistant", "content": solution(r["answer"])}],
         "answer": r["answer"]} for r in splits["train"]])
    if tokenizer:
        texts = [SYSTEM_PROMPT] + [m["content"] for r in splits["train"] for m in r["messages"]] + \
            [solution(r["answer"]) for r in splits["train"]]
        train_tokenizer(texts).save_pretrained(os.path.join(out, "tokenizer"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--eval", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="also train a BPE tokenizer on the problems (--no-tokenizer: for a pretrained model's own)")
    args = p.parse_args(argv)
    write(args.out, args.train, args.eval, args.seed, args.tokenizer)
    print(f"wrote {args.train} training and {args.eval} held-out problems{' and a tokenizer' * args.tokenizer} to "
          f"{args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
