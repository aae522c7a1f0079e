"""Tools an agent trajectory calls: the Hermes / Qwen `<tool_call>` format, the tool file (--tool-config), and the
tools that ship: an exact calculator and a sandboxed Python executor."""

from megatron_rl.tools.calls import format_tool_call, parse_tool_calls
from megatron_rl.tools.registry import BUILT_IN, ToolSet, built_in_tools, load_tool_config
from megatron_rl.tools.sandbox import SANDBOXES, SandboxLimits, run_python
from megatron_rl.tools.types import EnvironmentFailure, SandboxUnavailable, ToolCall, ToolResult

__all__ = ["BUILT_IN", "EnvironmentFailure", "SANDBOXES", "SandboxLimits", "SandboxUnavailable", "ToolCall",
           "ToolResult", "ToolSet", "built_in_tools", "format_tool_call", "load_tool_config", "parse_tool_calls",
           "run_python"]
