"""The verdict of an LLM judge (--judge-*): the prompt it is given and how its answer becomes a reward.

The prompt is --judge-prompt-template with {prompt}, {response} and {label} filled in. The verdict is the last
match of --judge-verdict-pattern in the judge's answer: its first group, a number (the reward itself) or a word
(yes / correct / true / pass: 1.0; no / incorrect / false / fail: 0.0, in any case). The judge's server is
`rollout.sglang.judge`.
"""

from __future__ import annotations

import math
import re

DEFAULT_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {label}\n\nResponse:\n{response}\n\n"
                    "Is the response's final answer correct? Answer YES or NO.")
DEFAULT_VERDICT = r"\b(YES|NO)\b"
WORDS = {"yes": 1.0, "correct": 1.0, "true": 1.0, "pass": 1.0, "no": 0.0, "incorrect": 0.0, "false": 0.0,
         "fail": 0.0}


def check_template(template: str) -> str:
    """The template when it formats with {prompt}, {response} and {label}; a ValueError naming the flag else."""
    try:
        template.format(prompt="", response="", label="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"--judge-prompt-template: {e!r}: it may name only {{prompt}}, {{response}} and {{label}} "
                         "(write literal braces as {{ and }})") from None
    if "{response}" not in template:
        raise ValueError("--judge-prompt-template must contain {response}: the judge would not see what it grades")
    return template


def check_verdict_pattern(pattern: str) -> re.Pattern:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--judge-verdict-pattern {pattern!r}: not a regular expression ({e})") from None
    if compiled.groups < 1:
        raise ValueError(f"--judge-verdict-pattern {pattern!r} needs a group: the verdict is its first group")
    return compiled


def parse_verdict(answer: str, pattern: re.Pattern) -> float | None:
    """The reward the judge's answer gives, or None when it gives none."""
    matches = list(pattern.finditer(answer))
    if not matches:
        return None
    verdict = (matches[-1].group(1) or "").strip()
    if verdict.casefold() in WORDS:
        return WORDS[verdict.casefold()]
    try:
        value = float(verdict)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
