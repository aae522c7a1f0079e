"""What a tool call is, what it returns, and the errors that are not the policy's: the environment failing, and a
sandbox that cannot be had at all."""

from __future__ import annotations

import dataclasses


class EnvironmentFailure(Exception):
    """The environment itself failed (a sandbox worker crashed, a tool server is unreachable, a judge does not
    answer): the trajectory is excluded with this reason, never scored. A tool's own error (bad arguments, an
    exception or a timeout in the policy's code) is not this: it is an observation the policy reads."""


class SandboxUnavailable(RuntimeError):
    """The Python tool's sandbox cannot run on this machine (bubblewrap missing, user namespaces blocked): the run
    refuses to start, naming the cause and the flag that accepts a weaker sandbox."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # the call could not be parsed (bad JSON, no name): reported to the policy as is


@dataclasses.dataclass(frozen=True)
class ToolResult:
    text: str  # what the policy reads, in the tool turn
    is_error: bool = False  # the tool reported an error (the policy's to handle)
