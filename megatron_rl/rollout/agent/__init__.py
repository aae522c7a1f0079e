"""Agent rollouts: a rollout is a program that may call the policy any number of times, use tools and return a
trajectory of policy and non-policy segments (`Trajectory`).

The program is --custom-generate-function-path's `async def generate(sample: AgentSample, client:
GenerationClient) -> Trajectory`, or the built-in tool loop of --rollout-function multi-turn (`MultiTurn`);
`AgentRunner` runs them on a generator. `rollout_program` builds the run's program (None: one policy call per
sample, the plain rollout); the run setup calls it too, so a bad flag, file or function fails before any work.
The package's names load on first use: runs without agent rollouts import none of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.rollout.agent.runner import Program

ROLLOUT_FUNCTIONS = ("single-turn", "multi-turn")
GENERATE_FLAG = "--custom-generate-function-path"

# What a rollout program imports from here, by the module that defines it: loaded on first use, so that a run without
# agent rollouts never imports the tools, the OpenAI endpoint or their packages (jsonschema, aiohttp).
_EXPORTS = {"AgentRunner": "runner", "Program": "runner", "AgentSample": "client", "GenerationClient": "client",
            "MultiTurn": "multi_turn", "ToolTurns": "chat", "Generation": "trajectory", "Segment": "trajectory",
            "Trajectory": "trajectory", "AgentFailure": "trajectory", "InvalidInput": "boundary",
            "TrajectoryLimits": "boundary"}

__all__ = ["EnvironmentFailure", "GENERATE_FLAG", "ROLLOUT_FUNCTIONS", "rollout_program", "uses_agents", *_EXPORTS]


def __getattr__(name: str):
    if name == "EnvironmentFailure":
        from megatron_rl.tools.types import EnvironmentFailure

        return EnvironmentFailure
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def uses_agents(args) -> bool:
    """Whether the run's rollouts are agent programs (`rollout_program` is not None)."""
    return bool(args.custom_generate_function_path) or args.rollout_function == "multi-turn"


def rollout_program(args, tokenizer, stop_token_ids) -> Program | None:
    """The run's agent program, or None for single-turn rollouts."""
    from megatron_rl.runtime import plugins

    if args.custom_generate_function_path:
        return plugins.load(plugins.resolve(args.custom_generate_function_path, GENERATE_FLAG), GENERATE_FLAG)
    if args.rollout_function != "multi-turn":
        return None
    from megatron_rl.rollout.agent.chat import ToolTurns
    from megatron_rl.rollout.agent.multi_turn import MultiTurn
    from megatron_rl.tools import SandboxLimits, ToolSet, built_in_tools, load_tool_config

    tools = load_tool_config(args.tool_config) if args.tool_config else built_in_tools(["calculator", "python"])
    limits = SandboxLimits(args.tool_timeout, args.sandbox_memory_mb)
    tool_set = ToolSet(tools, limits, args.tool_config or "built-in", args.python_sandbox)
    return MultiTurn(tool_set, ToolTurns(tokenizer, stop_token_ids),
                     args.max_turns, args.max_tokens_per_turn, args.max_observation_len, args.system_prompt)
