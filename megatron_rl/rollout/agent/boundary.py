"""The agent boundary: what a rollout program or an agent of the OpenAI endpoint hands over is checked here, before
the engine or the trainer sees it.

A program (or an agent through the endpoint) is user code, so its inputs are untrusted: the token ids of a policy
call (ints inside the model's vocabulary, a non-empty prompt), its sampling overrides, and the trajectory it
returns (every token id an int in the vocabulary, a log-prob and a version per policy token, the documented types
of `response`, `reward`, `metadata` and the counters, the response budget and --seq-length). A violation raises
`InvalidInput`, whose message names the field: the runner excludes the trajectory with it as the reason, the
endpoint answers HTTP 400 with it. Both paths use these functions, so they refuse the same things.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from megatron_rl.rollout.agent.trajectory import Segment, Trajectory
from megatron_rl.rollout.types import SamplingParams

FINISH_REASONS = ("stop", "length")


class InvalidInput(ValueError):
    """An input of a rollout program or an agent that breaks the contract: refused, naming the field."""


@dataclasses.dataclass(frozen=True)
class TrajectoryLimits:
    """What one trajectory may hold."""

    vocab_size: int  # token ids are in [0, vocab_size)
    max_context: int  # tokens in all, prompt included (--seq-length)
    response_budget: int  # tokens after the prompt, policy or not (--rollout-max-response-len, an evaluation's own)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def token_ids(value: Any, field: str, vocab_size: int, allow_empty: bool = False) -> list[int]:
    """`value` as a list of token ids: a list (or tuple) of ints in [0, vocab_size), non-empty unless
    `allow_empty`. A float, a bool or a numpy integer is refused, not converted: it is a bug upstream."""
    if not isinstance(value, (list, tuple)):
        raise InvalidInput(f"{field} must be a list of token ids, got {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidInput(f"{field} is empty: a policy call needs at least one token")
    for i, t in enumerate(value):
        if not is_int(t):
            raise InvalidInput(f"{field}[{i}] is {type(t).__name__} {t!r}: token ids are ints")
        if not 0 <= t < vocab_size:
            raise InvalidInput(f"{field}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return list(value)


def sampling_params(base: SamplingParams, overrides: dict, vocab_size: int) -> SamplingParams:
    """`base` with a program's per-call `overrides`, each a field of `SamplingParams` of its type and range."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, value in overrides.items():
        if name not in fields:
            raise InvalidInput(f"{name!r} is not a sampling parameter (one of {sorted(fields)})")
        if name == "stop_token_ids":
            token_ids(value, name, vocab_size, allow_empty=True)
            continue
        expected = {"temperature": ("a finite number", is_real), "top_p": ("a finite number", is_real),
                    "ignore_eos": ("a bool", lambda v: isinstance(v, bool)),
                    "seed": ("an int or None", lambda v: v is None or is_int(v))}.get(name, ("an int", is_int))
        if not expected[1](value):
            raise InvalidInput(f"sampling parameter {name} must be {expected[0]}, got {value!r}")
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as e:  # out of range: SamplingParams says which
        raise InvalidInput(f"sampling parameters: {e}") from None


def check_trajectory(trajectory: Any, limits: TrajectoryLimits) -> None:
    """Raise `InvalidInput` unless `trajectory` can be trained on as it is."""
    if not isinstance(trajectory, Trajectory):
        raise InvalidInput(f"it is a {type(trajectory).__name__}, not a Trajectory")
    token_ids(trajectory.prompt_token_ids, "prompt_token_ids", limits.vocab_size)
    if not isinstance(trajectory.segments, list):
        raise InvalidInput(f"segments must be a list, got {type(trajectory.segments).__name__}")
    for i, segment in enumerate(trajectory.segments):
        _check_segment(segment, f"segments[{i}]", limits.vocab_size)
    _check_fields(trajectory)
    if trajectory.num_response_tokens > limits.response_budget:
        raise InvalidInput(f"the trajectory has {trajectory.num_response_tokens} tokens after its prompt, more than "
                           f"its response budget {limits.response_budget} (--rollout-max-response-len)")
    if len(trajectory.token_ids) > limits.max_context:
        raise InvalidInput(f"the trajectory has {len(trajectory.token_ids)} tokens, more than --seq-length "
                           f"{limits.max_context}")


def _check_segment(segment: Any, field: str, vocab_size: int) -> None:
    if not isinstance(segment, Segment):
        raise InvalidInput(f"{field} is {type(segment).__name__}, not a Segment")
    n = len(token_ids(segment.token_ids, f"{field}.token_ids", vocab_size, allow_empty=True))
    if segment.logprobs is None:
        if segment.versions is not None:
            raise InvalidInput(f"{field} has versions but no log-probs: a policy segment needs both, an "
                               "observation neither")
        return
    for name, values, ok, kind in (("logprobs", segment.logprobs, is_real, "finite numbers"),
                                   ("versions", segment.versions, lambda v: is_int(v) and v >= 0,
                                    "weight versions (ints >= 0)")):
        if not isinstance(values, list):
            raise InvalidInput(f"{field}.{name} must be a list, got {type(values).__name__}")
        if len(values) != n:
            raise InvalidInput(f"{field} has {n} tokens and {len(values)} {name}: one per token")
        for j, value in enumerate(values):
            if not ok(value):
                raise InvalidInput(f"{field}.{name}[{j}] must be {kind}, got {value!r}")
    if segment.finish_reason not in (None, *FINISH_REASONS):
        raise InvalidInput(f"{field}.finish_reason must be one of {FINISH_REASONS} or None, got "
                           f"{segment.finish_reason!r}")


def _check_fields(trajectory: Trajectory) -> None:
    """The documented types of a trajectory's other fields (they travel to the reward, the logs, checkpoints)."""
    if trajectory.response is not None and not isinstance(trajectory.response, str):
        raise InvalidInput(f"response must be a str or None, got {type(trajectory.response).__name__}")
    if trajectory.reward is not None and not is_real(trajectory.reward):
        raise InvalidInput(f"reward must be a finite number or None, got {trajectory.reward!r}")
    metadata = trajectory.metadata
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise InvalidInput(f"metadata must be a dict with str keys, got {type(metadata).__name__} {metadata!r:.80}")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidInput(f"metadata must be JSON (it goes to the reward function and the ledger): {e}") from None
    for name in ("tool_calls", "tool_errors", "num_retractions"):
        value = getattr(trajectory, name)
        if not is_int(value) or value < 0:
            raise InvalidInput(f"{name} must be an int >= 0, got {value!r}")
    if trajectory.finish_reason not in (None, *FINISH_REASONS):
        raise InvalidInput(f"finish_reason must be one of {FINISH_REASONS} or None, got {trajectory.finish_reason!r}")
