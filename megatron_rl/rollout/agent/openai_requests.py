"""The requests the OpenAI-compatible endpoint accepts, checked field by field into typed records before anything
is rendered, tokenized or decoded: a malformed request is an `InvalidInput` naming the field (HTTP 400), never an
exception deeper in (HTTP 500).

What is checked: the body is UTF-8 JSON, an object; `messages` are objects with a known `role`, text content (a
string, or text content parts), assistant `tool_calls` as a list of function calls with a name and JSON
arguments, a tool message's `tool_call_id` a string; `tools` a list of function tools; `prompt` text or token ids
(`boundary.token_ids`, as every policy call's); `max_tokens` a positive int, `n` 1, `stream` false, no `stop`.
Strings must be encodable (no lone surrogates). Sampling fields the run fixes (`temperature`, `top_p`, ...) are
not read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

from megatron_rl.rollout.agent import boundary
from megatron_rl.rollout.agent.boundary import InvalidInput

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class ToolCallMessage:
    """One function call of an assistant message; `arguments` parsed from JSON where it is JSON."""

    id: str | None
    name: str
    arguments: Any


@dataclasses.dataclass(frozen=True)
class Message:
    role: str
    content: str | None  # text; None: an assistant turn of tool calls only
    tool_calls: tuple[ToolCallMessage, ...] = ()
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The message as a chat template renders it (OpenAI's shape, arguments as objects)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                "arguments": c.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def comparable(self) -> tuple:
        """What must be equal for a message to be the one the session already has."""
        return (self.role, (self.content or "").strip(),
                tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in self.tool_calls))


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    tools: list[dict] | None
    max_tokens: int | None


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]  # text (tokenized by the endpoint) or token ids in the vocabulary
    max_tokens: int | None


def body(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"the request body is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"the request body is not JSON ({e.msg} at character {e.pos})") from None
    except RecursionError:
        raise InvalidInput("the request body is nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def chat(request: dict) -> ChatRequest:
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("'messages' must be a non-empty list of message objects")
    tools = request.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
            raise InvalidInput("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}")
        _json_text(tools, "tools")
    return ChatRequest(tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages)), tools or None,
                       _options(request))


def completion(request: dict, vocab_size: int) -> CompletionRequest:
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        prompt = _text(prompt, "prompt")
    elif isinstance(prompt, list):
        prompt = boundary.token_ids(prompt, "prompt", vocab_size)
    else:
        raise InvalidInput("'prompt' must be a string or a list of token ids (one prompt)")
    return CompletionRequest(prompt, _options(request))


def _options(request: dict) -> int | None:
    """The call's `max_tokens` (None: the budget's), after refusing what the endpoint does not do."""
    n = request.get("n")
    if n is not None and (not boundary.is_int(n) or n != 1):
        raise InvalidInput(f"'n' must be 1: each sample of a group is a session of its own, got {n!r}")
    if request.get("stream") not in (None, False):
        raise InvalidInput("'stream' is not supported: each call answers whole")
    if request.get("stop") not in (None, [], ""):
        raise InvalidInput("'stop' strings are not supported: the run's stop tokens end a turn")
    name = "max_completion_tokens" if request.get("max_completion_tokens") is not None else "max_tokens"
    limit = request.get(name)
    if limit is not None and (not boundary.is_int(limit) or limit < 1):
        raise InvalidInput(f"'{name}' must be a positive integer, got {limit!r}")
    return limit


def _message(message: Any, field: str) -> Message:
    if not isinstance(message, dict):
        raise InvalidInput(f"{field} must be a message object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidInput(f"{field}.role must be one of {list(ROLES)}, got {role!r}")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise InvalidInput(f"{field}: only an assistant message has tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise InvalidInput(f"{field}.tool_calls must be a list, got {type(calls).__name__}")
    calls = tuple(_tool_call(c, f"{field}.tool_calls[{k}]") for k, c in enumerate(calls or []))
    content = _content(message.get("content"), f"{field}.content")
    if content is None and not (role == "assistant" and calls):
        content = ""
    call_id = message.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidInput(f"{field}.tool_call_id must be a string, got {type(call_id).__name__}")
    return Message(role, content, calls, call_id)


def _content(content: Any, field: str) -> str | None:
    """A message's content as text: a string, null, or OpenAI text content parts."""
    if content is None or isinstance(content, str):
        return content if content is None else _text(content, field)
    if not isinstance(content, list):
        raise InvalidInput(f"{field} must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidInput(f"{field}[{k}] must be {{\"type\": \"text\", \"text\": \"...\"}} (only text is "
                               "supported)")
        texts.append(_text(part["text"], f"{field}[{k}].text"))
    return "".join(texts)


def _tool_call(call: Any, field: str) -> ToolCallMessage:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidInput(f"{field} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                           "\"arguments\": ...}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: kept as the policy wrote it
            arguments = json.loads(arguments)
    elif not isinstance(arguments, dict):
        raise InvalidInput(f"{field}.function.arguments must be a JSON string or an object, got "
                           f"{type(arguments).__name__}")
    _json_text(arguments, f"{field}.function.arguments")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidInput(f"{field}.id must be a string, got {type(call_id).__name__}")
    return ToolCallMessage(call_id, _text(function["name"], f"{field}.function.name"), arguments)


def _is_function_tool(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type", "function") == "function" and \
        isinstance(tool.get("function"), dict) and isinstance(tool["function"].get("name"), str)


def _text(text: str, field: str) -> str:
    """`text`, if the tokenizer can take it: JSON may carry lone surrogates (\\ud800), which are no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInput(f"{field} is not valid Unicode ({e.reason} at character {e.start})") from None
    return text


def _json_text(value: Any, field: str) -> None:
    """`value`'s strings, if the tokenizer can take them (JSON parsed from a request)."""
    _text(json.dumps(value, ensure_ascii=False), field)
