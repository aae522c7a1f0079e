"""The tools a run offers the policy: declared in a JSON file (--tool-config) of OpenAI function tools, as
verl's `tool_config_path`, and dispatched by name.

    [{"type": "function", "function": {"name": "calculator", "description": ..., "parameters": {...}}},
     {"type": "function", "function": {"name": "search", ...}, "implementation": "my_tools.py:search"}]

A tool's implementation is a built-in of that name (`calculator`, `python`) or `implementation`, a
`path/to/file.py:function` or `package.module:function` (an async or plain function taking the arguments by
keyword and returning a string or a `ToolResult`). Arguments are checked against the tool's JSON schema
before the call: a call that does not fit is a tool error the policy reads, as is an unknown tool's name.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

from megatron_rl.runtime import plugins
from megatron_rl.tools import calculator, sandbox
from megatron_rl.tools.types import EnvironmentFailure, ToolCall, ToolResult

BUILT_IN = {"calculator": (calculator.SCHEMA, lambda limits, kind: calculator.calculator),
            "python": (sandbox.SCHEMA, sandbox.python_tool)}
NO_PARAMETERS = {"type": "object", "properties": {}}


def load_tool_config(path: str) -> list[dict]:
    """The tools of --tool-config `path`, checked: a list of OpenAI function tools with unique names."""
    import jsonschema  # here, not at the top: only runs that offer tools need the package

    where = f"--tool-config {path!r}"
    try:
        with open(path) as f:
            tools = json.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if isinstance(tools, dict) and "tools" in tools:
        tools = tools["tools"]
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where}: expected a non-empty list of tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'{where}: tool {i} is not {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: tool {i} has no function name")
        if name in names:
            raise ValueError(f"{where}: two tools are named {name!r}")
        names.add(name)
        parameters = function.get("parameters", NO_PARAMETERS)
        try:
            jsonschema.Draft202012Validator.check_schema(parameters)
        except jsonschema.SchemaError as e:
            raise ValueError(f"{where}: tool {name!r} has an invalid parameters schema ({e.message})") from None
        if "implementation" not in tool and name not in BUILT_IN:
            raise ValueError(f"{where}: tool {name!r} is not a built-in ({sorted(BUILT_IN)}); give its "
                             '"implementation": "path/to/file.py:function"')
    return tools


def built_in_tools(names) -> list[dict]:
    """The built-in tools' declarations (what a tool file for them holds)."""
    return [BUILT_IN[n][0] for n in names]


@dataclasses.dataclass(frozen=True)
class _Tool:
    schema: dict
    validator: object  # a jsonschema validator of its parameters
    fn: object


class ToolSet:
    """The tools of a run, built once: a bad implementation fails here, and so does a Python sandbox that cannot
    run on this machine (`SandboxUnavailable`, for --python-sandbox `python_sandbox`)."""

    def __init__(self, tools: list[dict], limits: sandbox.SandboxLimits = sandbox.SandboxLimits(),
                 config_path: str = "--tool-config", python_sandbox: str = "bwrap"):
        import jsonschema

        self._tools = {}
        for tool in tools:
            name = tool["function"]["name"]
            if "implementation" in tool:
                fn = plugins.load(plugins.resolve(tool["implementation"], f"--tool-config {config_path!r} tool "
                                                                          f"{name!r}"), "--tool-config")
            else:
                fn = BUILT_IN[name][1](limits, python_sandbox)
            parameters = tool["function"].get("parameters", NO_PARAMETERS)
            self._tools[name] = _Tool(tool, jsonschema.Draft202012Validator(parameters), fn)

    @property
    def schemas(self) -> list[dict]:
        """The declarations, for the chat template's `tools=` (the policy's system prompt)."""
        return [{k: v for k, v in t.schema.items() if k != "implementation"} for t in self._tools.values()]

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call. The tool's and the policy's errors come back as an error result; `EnvironmentFailure`
        (the environment itself failed) propagates."""
        if call.error is not None:
            return ToolResult(f"error: {call.error}", is_error=True)
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(f"error: no tool named {call.name!r} (tools: {', '.join(self._tools)})", is_error=True)
        problems = sorted(tool.validator.iter_errors(call.arguments), key=lambda e: list(e.path))
        if problems:
            return ToolResult(f"error: bad arguments for {call.name}: {problems[0].message}", is_error=True)
        try:
            value = tool.fn(**call.arguments)
            if inspect.isawaitable(value):
                value = await value
        except EnvironmentFailure:
            raise
        except Exception as e:  # noqa: BLE001 - a tool's exception is reported to the policy
            return ToolResult(f"error: {type(e).__name__}: {e}", is_error=True)
        return value if isinstance(value, ToolResult) else ToolResult(str(value))
