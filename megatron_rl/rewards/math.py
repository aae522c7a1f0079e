"""Math answer equivalence (the LlamaRL paper's "sympy score"), built on math-verify.

Extraction takes the final answer of a response, in this order: the last \\boxed{...} (or \\fbox{...}), the
text after the last "####", the text after the last "answer is", and the last number. math-verify (sympy
underneath) then compares it with the reference: fractions vs decimals, sets, intervals, radicals, pi,
equivalent algebraic forms.

Statuses (`rewards.result`): "scored" (reward 1.0 or 0.0), "wrong-format" (no final answer could be extracted
or parsed: reward 0.0, the policy's fault), "timeout" and "scorer-failure" (infrastructure: excluded from
training, never a reward). Verdicts run in worker processes, each under a whole-second SIGALRM (math-verify's own
timeouts are signal-based too and silently return False on a float timeout), and the pool kills any worker
that overruns its deadline by 0.5 s, which catches C-level work that no signal interrupts (9^9^9^9).
"""

from __future__ import annotations

import re
import signal
import threading

from megatron_rl.rewards.pool import WorkerPool
from megatron_rl.rewards.result import RewardResult

# ---- extraction --------------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_braced(text: str, commands: tuple[str, ...]) -> str | None:
    best = -1
    for cmd in commands:
        best = max(best, text.rfind(cmd + "{"))
    if best < 0:
        return None
    start = text.index("{", best) + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None  # unbalanced braces: malformed


def extract_answer(text: str | None) -> str | None:
    """The final answer of a response, or None if it has none."""
    if not text or not text.strip():
        return None
    if "\\boxed" in text or "\\fbox" in text:
        # A box is the answer; an empty or unbalanced box is a malformed answer, not a cue to look elsewhere.
        return _last_braced(text, ("\\boxed", "\\fbox")) or None
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        return tail[0].strip() if tail and tail[0].strip() else None
    match = list(re.finditer(r"answer is[:\s]*", text, flags=re.IGNORECASE))
    if match:
        tail = text[match[-1].end():].strip()
        if tail.startswith("$"):
            answer = tail[1:].split("$", 1)[0]
        else:  # up to the end of the sentence: a period followed by a space or the end, or a new line
            answer = re.split(r"\.(?:\s|$)|\n", tail, maxsplit=1)[0]
        return answer.strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


_INTEGER = re.compile(r"-?\d{1,100}")


def integer_verdict(response: str, reference: str) -> RewardResult | None:
    """The verdict without a worker when it is plain integer equality (a response with no final answer, or an
    integer answer to an integer reference: exactly what math-verify would decide, at no IPC or parsing
    cost); None when the pair needs the full symbolic check."""
    extracted = extract_answer(response)
    if extracted is None:
        return RewardResult(0.0, "wrong-format", None, "no final answer found")
    if _INTEGER.fullmatch(extracted) and _INTEGER.fullmatch(reference.strip()):
        return RewardResult(1.0 if int(extracted) == int(reference) else 0.0, "scored", extracted)
    return None


# ---- the verdict (runs inside a worker process) ---------------------------------------------------------------------

class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _as_math(s: str) -> str:
    s = s.strip()
    return s if s.startswith("$") or s.startswith("\\(") else f"${s}$"


def verdict(response: str, reference: str, timeout_s: int) -> RewardResult:
    """Score one pair in the current process (main thread). Used by the pool's workers."""
    from math_verify import parse, verify

    extracted = extract_answer(response)
    if extracted is None:
        return RewardResult(0.0, "wrong-format", None, "no final answer found")
    use_alarm = threading.current_thread() is threading.main_thread()
    if use_alarm:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(timeout_s)
    try:
        gold = parse(_as_math(reference), parsing_timeout=None)
        if not gold:
            return RewardResult(0.0, "scorer-failure", extracted, f"reference {reference!r} cannot be parsed")
        pred = parse(_as_math(extracted), parsing_timeout=None)
        if not pred:
            return RewardResult(0.0, "wrong-format", extracted, "final answer cannot be parsed")
        ok = verify(gold, pred, timeout_seconds=None)
        return RewardResult(1.0 if ok else 0.0, "scored", extracted)
    except _Timeout:
        return RewardResult(0.0, "timeout", extracted, f"no verdict within {timeout_s} s")
    finally:
        if use_alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _warmup() -> None:
    import logging

    # We enforce timeouts ourselves; math-verify warns about that on every call otherwise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verdict("\\boxed{1/2}", "0.5", 10)  # first sympy/latex parse is slow; pay it at worker start


# ---- the pool-backed interface --------------------------------------------------------------------------------------

class MathScorer:
    """Scores batches on a pool of worker processes. Safe against hangs and crashed workers."""

    def __init__(self, num_workers: int = 2, timeout_s: int = 5):
        self.timeout_s = _whole_seconds(timeout_s)
        self.pool = WorkerPool(num_workers, warmup=_warmup)

    def __call__(self, responses: list[str], references: list[str], timeout_s: int | None = None) -> list[RewardResult]:
        if len(responses) != len(references):
            raise ValueError(f"responses has {len(responses)} items, references has {len(references)}")
        timeout = self.timeout_s if timeout_s is None else _whole_seconds(timeout_s)
        results: list[RewardResult | None] = [integer_verdict(r, g) for r, g in zip(responses, references)]
        todo = [i for i, r in enumerate(results) if r is None]
        # The parent deadline sits 0.5 s after the in-worker alarm: every verdict returns within timeout + 1 s.
        outcomes = self.pool.map(verdict, [(responses[i], references[i], timeout) for i in todo], timeout + 0.5)
        for i, o in zip(todo, outcomes):
            if o.status == "ok":
                results[i] = o.value
            elif o.status == "timeout":
                results[i] = RewardResult(0.0, "timeout", None, o.error)
            else:
                results[i] = RewardResult(0.0, "scorer-failure", None, f"{o.status}: {o.error.strip()[-500:]}")
        return results

    def close(self) -> None:
        self.pool.close()


def _whole_seconds(timeout_s) -> int:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s != int(timeout_s) \
            or timeout_s < 1:
        raise ValueError(f"timeout_s must be a whole number of seconds >= 1 (SIGALRM), got {timeout_s!r}")
    return int(timeout_s)
