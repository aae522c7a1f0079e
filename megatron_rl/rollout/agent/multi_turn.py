"""The built-in tool loop (--rollout-function multi-turn): the policy answers, calling tools on the way.

Each turn the policy writes until an end-of-turn token; the turn's `<tool_call>` blocks run (in order, on the
generator's event loop) and their results come back in the chat template's tool turn, truncated to
--max-observation-len tokens each, followed by the next assistant turn's prompt. A turn without a tool call is
the final answer, which the reward function scores. The trajectory ends there, after --max-turns assistant
turns, or when its response budget (--rollout-max-response-len, every token after the prompt) is spent: a tool
turn that does not fit ends it as truncated ("length"). Tool errors are observations; an `EnvironmentFailure` of a
tool excludes the sample (see `runner`).
"""

from __future__ import annotations

import dataclasses

from megatron_rl.data.prompts import as_messages
from megatron_rl.rollout.agent.chat import ToolTurns
from megatron_rl.rollout.agent.client import AgentSample, GenerationClient
from megatron_rl.rollout.agent.trajectory import Trajectory
from megatron_rl.tools import ToolSet, parse_tool_calls


@dataclasses.dataclass(frozen=True)
class MultiTurn:
    tools: ToolSet
    turns: ToolTurns
    max_turns: int
    max_tokens_per_turn: int | None  # None: what is left of the response budget
    max_observation_tokens: int
    system_prompt: str | None = None

    async def __call__(self, sample: AgentSample, client: GenerationClient) -> Trajectory:
        tokenizer = client.tokenizer
        messages = as_messages(sample.prompt, self.system_prompt)
        trajectory = Trajectory(self.turns.prompt_tokens(messages, self.tools.schemas))
        per_turn = {} if self.max_tokens_per_turn is None else {"max_new_tokens": self.max_tokens_per_turn}
        for turn in range(self.max_turns):
            generation = await client.sample(trajectory, **per_turn)
            text = tokenizer.decode([t for t in generation.token_ids if t not in self.turns.end_of_turn_ids])
            calls = parse_tool_calls(text)
            trajectory.response = text
            if not calls or generation.finish_reason != "stop" or turn == self.max_turns - 1:
                break
            results = []
            for call in calls:
                result = await self.tools.call(call)
                trajectory.tool_calls += 1
                trajectory.tool_errors += result.is_error
                results.append(self._truncated(result.text, tokenizer))
            if not client.observe(trajectory, self.turns.observation_tokens(results)):
                break  # no room for the tool's answer and another turn: truncated ("length")
        return trajectory

    def _truncated(self, text: str, tokenizer) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.max_observation_tokens:
            return text
        return tokenizer.decode(ids[:self.max_observation_tokens]) + f"... ({len(ids) - self.max_observation_tokens} " \
                                                                      "more tokens)"
