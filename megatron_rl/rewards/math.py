"""Math answer equivalence (the LlamaRL paper's "sympy score"), built on math-verify.

Extraction takes the final answer a response marks: the last \\boxed{...} (or \\fbox{...}), else the text
after the last "####". A response that marks none is read by math-verify's own extraction (its "final answer
is" anchors, then the last LaTeX or expression: inequalities, matrices and decimal commas read as meant, where
the last number in the text would not). math-verify (sympy underneath) then compares the answer with the
reference: fractions vs decimals, sets, intervals, radicals, pi, equivalent algebraic forms. A response with
several boxes is read by math-verify itself, which takes them together as a set ("\\boxed{3}, \\boxed{4}" is
{3, 4}): hedging between candidates is not the last one's answer. A reference that is prose ("Paris", "the red
one") is compared as text, ignoring case, spacing and punctuation: math-verify would read it as a product of
symbols, in which word order does not count.

Statuses (`rewards.types`): "scored" (reward 1.0 or 0.0), "wrong-format" (no final answer could be extracted
or parsed: reward 0.0, the policy's fault), "bad-input" (the label is None or not text: excluded), "timeout" and
"scorer-failure" (infrastructure: excluded from training, never a reward). Pairs decided without sympy (no
answer, integers, prose) are decided in the caller's process; the rest run in worker processes, each under a
whole-second time limit (math-verify's own timeouts are signal-based too and silently return False on a float
timeout), and the pool kills any worker that overruns its deadline, which catches C-level work that no signal
interrupts (9^9^9^9).
"""

from __future__ import annotations

import re
import unicodedata

from megatron_rl.rewards.types import RewardResult, RewardSample
from megatron_rl.rewards.workers import PooledReward, TimeLimitExceeded, time_limit

# ---- extraction --------------------------------------------------------------------------------------------------

_BOX = re.compile(r"\\(?:boxed|fbox)\{")


def boxes(text: str) -> list[str | None]:
    """The contents of every \\boxed{...} / \\fbox{...} in order; None for one whose braces never close."""
    out = []
    for match in _BOX.finditer(text):
        depth = 1
        for i in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                out.append(text[match.end():i].strip())
                break
        else:
            out.append(None)
    return out


def marked_answer(text: str) -> str | None:
    """The answer a response marks: its last box, else the line after its last "####" (GSM8K's marker, which
    math-verify does not know). "" when the marker is there but empty or unbalanced (a malformed answer, not a
    cue to look elsewhere); None when the response marks no answer, and math-verify's own extraction reads it."""
    boxed = boxes(text)
    if boxed:
        return boxed[-1] or ""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        return tail[0].strip() if tail else ""
    return None


def prose_answer(text: str) -> str:
    """The answer of a response to a prose reference: its last box, else what follows its last "answer is" up
    to the end of the sentence, else its last line."""
    boxed = boxes(text)
    if boxed:
        return boxed[-1] or ""
    match = list(re.finditer(r"answer is[:\s]*", text, flags=re.IGNORECASE))
    if not match:
        return text.strip().splitlines()[-1]
    tail = text[match[-1].end():].strip()
    if tail.startswith("$"):
        return tail[1:].split("$", 1)[0].strip()
    return re.split(r"\.(?:\s|$)|\n", tail, maxsplit=1)[0].strip()


# ---- inputs and the verdicts decided without sympy ------------------------------------------------------------------

def as_text(value, field: str) -> str | RewardResult:
    """A label or response as text (numbers are written out), or the bad-input result that names the field."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return RewardResult(0.0, "bad-input", None, f"{field} is {type(value).__name__} {value!r:.80}: expected text "
                                                "or a number")


_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mbox)\{([^{}]*)\}")
_MATH_SIGN = re.compile(r"[\d\\^_{}=+*/<>|$]")
_WORD = re.compile(r"[^\W\d_]{2,}")
_MATH_WORDS = {"pi", "inf", "infinity", "sqrt", "sin", "cos", "tan", "log", "ln", "exp"}


def is_prose(reference: str) -> bool:
    """A reference of words (\"Paris\", \"\\text{the red one}\"), no digits or math notation."""
    text = _TEXT_COMMAND.sub(r"\1", reference)
    return not _MATH_SIGN.search(text) and any(w not in _MATH_WORDS for w in _WORD.findall(text.casefold()))


def normalize_text(text: str) -> str:
    """Case-, spacing- and punctuation-insensitive form of a prose answer."""
    text = unicodedata.normalize("NFKC", _TEXT_COMMAND.sub(r"\1", text)).casefold()
    return " ".join(re.sub(r"[\W_]+", " ", text).split())


_INTEGER = re.compile(r"-?[0-9]{1,100}")  # ASCII digits only: int() also reads full-width and Arabic-Indic digits


def quick_verdict(response: str, reference: str) -> RewardResult | None:
    """The verdict without a worker when no symbolic check is needed: an empty response or a malformed marked
    answer, a prose reference, or a marked integer answer to an integer reference (exactly what math-verify
    would decide, at no IPC or parsing cost); None when the pair needs math-verify."""
    if not response.strip():
        return RewardResult(0.0, "wrong-format", None, "empty response")
    boxed = boxes(response)
    if is_prose(reference):
        answers = boxed if len(boxed) > 1 else [prose_answer(response)]
        correct = {normalize_text(a or "") for a in answers} == {normalize_text(reference)}
        return RewardResult(float(correct), "scored", answers[-1])
    marked = marked_answer(response)
    if marked == "":
        return RewardResult(0.0, "wrong-format", None, "empty or unbalanced final answer")
    if marked is not None and len(boxed) <= 1 and _INTEGER.fullmatch(marked) and _INTEGER.fullmatch(reference.strip()):
        return RewardResult(1.0 if int(marked) == int(reference) else 0.0, "scored", marked)
    return None


# ---- the symbolic verdict (runs inside a worker process) -------------------------------------------------------------

def _as_math(s: str) -> str:
    s = s.strip()
    return s if s.startswith("$") or s.startswith("\\(") else f"${s}$"


def verdict(response: str, reference: str, timeout_s: int) -> RewardResult:
    """Score one pair with math-verify in the current process (a worker's main thread: the time limit needs it)."""
    from math_verify import parse, verify

    marked = marked_answer(response)
    if marked == "":
        return RewardResult(0.0, "wrong-format", None, "empty or unbalanced final answer")
    try:
        with time_limit(timeout_s):
            gold = parse(_as_math(reference), parsing_timeout=None)
            if not gold:
                return RewardResult(0.0, "scorer-failure", marked, f"reference {reference!r} cannot be parsed")
            if marked is None or len(boxes(response)) > 1:
                # math-verify's own reading of the response: its final LaTeX or expression, or its boxes as a set
                pred = parse(response, parsing_timeout=None)
                extracted = str(pred[-1]) if pred else None
            else:
                pred, extracted = parse(_as_math(marked), parsing_timeout=None), marked
            if not pred:
                return RewardResult(0.0, "wrong-format", extracted, "no final answer found" if extracted is None
                                    else "final answer cannot be parsed")
            ok = verify(gold, pred, timeout_seconds=None)
        return RewardResult(1.0 if ok else 0.0, "scored", extracted)
    except TimeLimitExceeded:
        return RewardResult(0.0, "timeout", marked, f"no verdict within {timeout_s} s")


def _warmup() -> None:
    import logging

    # We enforce timeouts ourselves; math-verify warns about that on every call otherwise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # The first parse, and the first use of each of sympy's comparisons, import and compile a lot: pay that at
    # worker start, not inside the first verdicts' time limit.
    for response, reference in [("\\boxed{1/2}", "0.5"), ("\\boxed{(x-1)(x+1)}", "x^2-1"),
                                ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"), ("\\boxed{(0,1]}", "(0,1]")]:
        verdict(response, reference, 30)


# ---- the pool-backed interface --------------------------------------------------------------------------------------

class MathScorer(PooledReward):
    """Scores batches of samples (their response against their label) on a pool of worker processes. Safe
    against hangs, crashed workers and bad labels: each sample gets its own result."""

    def __init__(self, num_workers: int = 2, timeout_s: int = 5):
        super().__init__(num_workers, timeout_s, warmup=_warmup)

    def __call__(self, samples: list[RewardSample], timeout_s: int | None = None) -> list[RewardResult]:
        timeout = self._timeout(timeout_s)
        results: list[RewardResult | None] = []
        pairs: list[tuple[str, str]] = []
        for sample in samples:
            response, label = as_text(sample.response, "response"), as_text(sample.label, "label")
            bad = next((x for x in (response, label) if isinstance(x, RewardResult)), None)
            results.append(bad or quick_verdict(response, label))
            pairs.append((response, label))
        todo = [i for i, r in enumerate(results) if r is None]
        for i, result in zip(todo, self._score(verdict, [(*pairs[i], timeout) for i in todo], timeout)):
            results[i] = result
        return results  # type: ignore[return-value]
