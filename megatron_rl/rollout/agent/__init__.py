"""Agent rollouts: a rollout is a program that may call the policy any number of times, use tools and return a
trajectory of policy and non-policy segments (`Trajectory`).

The program is --custom-generate-function-path's `async def generate(sample: AgentSample, client:
GenerationClient) -> Trajectory`, or the built-in tool loop of --rollout-function multi-turn (`MultiTurn`);
`AgentRunner` runs them on a generator. `rollout_program` builds the run's program (None: one policy call per
sample, the plain rollout); the run setup calls it too, so a bad flag, file or function fails before any work.
"""

from __future__ import annotations

from megatron_rl.rollout.agent.chat import ToolTurns
from megatron_rl.rollout.agent.client import AgentSample, GenerationClient
from megatron_rl.rollout.agent.multi_turn import MultiTurn
from megatron_rl.rollout.agent.runner import AgentRunner, Program
from megatron_rl.rollout.agent.trajectory import Generation, Segment, Trajectory
from megatron_rl.runtime import plugins
from megatron_rl.tools import EnvironmentFailure, SandboxLimits, ToolSet, built_in_tools, load_tool_config

ROLLOUT_FUNCTIONS = ("single-turn", "multi-turn")
GENERATE_FLAG = "--custom-generate-function-path"

__all__ = ["AgentRunner", "AgentSample", "EnvironmentFailure", "Generation", "GenerationClient", "MultiTurn",
           "Program", "ROLLOUT_FUNCTIONS", "Segment", "ToolTurns", "Trajectory", "rollout_program", "uses_agents"]


def uses_agents(args) -> bool:
    """Whether the run's rollouts are agent programs (`rollout_program` is not None)."""
    return bool(args.custom_generate_function_path) or args.rollout_function == "multi-turn"


def rollout_program(args, tokenizer, stop_token_ids) -> Program | None:
    """The run's agent program, or None for single-turn rollouts."""
    if args.custom_generate_function_path:
        return plugins.load(plugins.resolve(args.custom_generate_function_path, GENERATE_FLAG), GENERATE_FLAG)
    if args.rollout_function != "multi-turn":
        return None
    tools = load_tool_config(args.tool_config) if args.tool_config else built_in_tools(["calculator", "python"])
    limits = SandboxLimits(args.tool_timeout, args.sandbox_memory_mb)
    return MultiTurn(ToolSet(tools, limits, args.tool_config or "built-in"), ToolTurns(tokenizer, stop_token_ids),
                     args.max_turns, args.max_tokens_per_turn, args.max_observation_len, args.system_prompt)
