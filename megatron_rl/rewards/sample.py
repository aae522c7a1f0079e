"""What a reward function is given for one response."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RewardSample:
    prompt: str  # the prompt as the model saw it, decoded without special tokens
    response: str  # the generated text, without the end-of-sequence token
    label: Any  # the dataset's reference answer ("answer"), as it is
    metadata: dict = dataclasses.field(default_factory=dict)  # the dataset record's "metadata"
    finish_reason: str = "stop"  # "stop" | "length" (truncated) | "abort"
