"""Tool calls in the Hermes / Qwen format that SGLang's parsers and the Qwen chat templates use:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

A turn may hold several calls. A block that is not valid JSON, or names no tool, is still a call: a malformed
one, reported back to the policy as a tool error (its mistake to learn from), not silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import re

from megatron_rl.tools.types import ToolCall

TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of one assistant turn, in order (none: the turn is a final answer)."""
    calls = []
    for body in TOOL_CALL_BLOCK.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            calls.append(ToolCall("", {}, 'the tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            calls.append(ToolCall(value["name"], {}, "the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(value["name"], arguments))
    return calls


def format_tool_call(name: str, arguments: dict) -> str:
    """One call as the policy writes it (demonstrations, tests)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
