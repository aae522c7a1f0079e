"""The tokens of a tool turn, from the tokenizer's own chat template, without rendering the policy's turns again.

A trajectory's policy tokens are exactly what was sampled; only the tool's output is rendered. Its tokens are the
template's rendering of a fixed conversation with the tool messages appended (and the generation prompt of the
next assistant turn), minus the rendering without them; before that comes whatever the template writes after an
assistant turn's end token (Qwen's newline after <|im_end|>), which the policy did not sample. Where the template
is prefix-stable (rendering a conversation one message longer only appends to it, as Qwen2.5's and Llama 3's do)
a trajectory's tokens are then exactly the template's rendering of the whole conversation. Where it is not (Qwen3
drops the <think> blocks of assistant turns before the last user message), the trajectory still holds exactly what
the policy saw and sampled turn by turn, which is what is trained; it differs from what the template would render
of the finished conversation. A template that does not append for a tool message at all is refused at setup.
"""

from __future__ import annotations

_BASE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class ToolTurns:
    def __init__(self, tokenizer, end_of_turn_ids):
        """`end_of_turn_ids`: the tokens an assistant turn ends with (the run's stop tokens)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--rollout-function multi-turn needs the tokenizer's chat template for tool turns "
                             "(and --apply-chat-template)")
        self.tokenizer, self.end_of_turn_ids = tokenizer, frozenset(end_of_turn_ids)
        base = self._render(_BASE, False)
        ends = [i for i, t in enumerate(base) if t in self.end_of_turn_ids]
        if not ends:
            raise ValueError(f"the chat template ends an assistant turn with none of the stop tokens "
                             f"{sorted(self.end_of_turn_ids)}: tool turns cannot be joined to the policy's")
        self._base, self._after_turn = base, base[ends[-1] + 1:]
        self.observation_tokens(["probe"])  # refuses a template that cannot append a tool turn

    def _render(self, messages: list[dict], generation_prompt: bool, tools=None) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                       tokenize=True, return_dict=False))

    def prompt_tokens(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The first prompt, with the tools declared as the template declares them (its system prompt)."""
        return self._render(messages, True, tools)

    def observation_tokens(self, contents: list[str]) -> list[int]:
        """The tokens after an assistant turn's end token: the tool messages `contents` (one turn of results, in
        call order) and the next assistant turn's generation prompt."""
        return self.turn_tokens([{"role": "tool", "content": c} for c in contents])

    def turn_tokens(self, messages: list[dict]) -> list[int]:
        """The tokens after an assistant turn's end token: `messages` (tool results, a user's turn: none of them
        the policy's) and the next assistant turn's generation prompt."""
        full = self._render(_BASE + messages, True)
        if full[:len(self._base)] != self._base:
            roles = sorted({m.get("role") for m in messages})
            raise ValueError(f"the chat template renders a conversation differently once a {'/'.join(roles)} "
                             "message follows (it is not prefix-stable there): the turn cannot be appended exactly")
        return self._after_turn + full[len(self._base):]
