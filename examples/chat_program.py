"""A rollout program of your own on chat data (a recipe for --custom-generate-function-path): the policy answers
the record's conversation, is asked to check its answer, and answers again; the reward scores the last answer.

    bash examples/run_chat_program.sh          # the word-problem chat data, with this program
    --custom-generate-function-path examples/chat_program.py:generate   # in your own launch

The program speaks OpenAI messages to the generator's OpenAI-compatible endpoint with the `openai` client
(`pip install openai`): the endpoint renders the chat template, so the program never handles token ids, and the
trajectory is exactly what the policy sampled (the user's check request is in it, never trained on). Each answer
is at most ANSWER_TOKENS tokens; the run's --rollout-max-response-len bounds the whole trajectory after the
prompt. A turn that no longer fits comes back with finish_reason "length" and no text, and the trajectory is
kept, truncated (the reward then scores the last answer that fit). A refused request (HTTP 400) or an exception
excludes the sample with the reason; it is never scored 0.
"""

import openai

ANSWER_TOKENS = 16
CHECK = "Check it."


def conversation(prompt) -> list[dict]:
    """The record's prompt as OpenAI messages (a text prompt is one user message)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


async def generate(sample, client):
    session = await client.openai_session()
    async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as api:
        messages = conversation(sample.prompt)
        first = await api.chat.completions.create(model="policy", messages=messages, max_tokens=ANSWER_TOKENS)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": CHECK}]
        await api.chat.completions.create(model="policy", messages=messages, max_tokens=ANSWER_TOKENS)
    trajectory = session.trajectory  # the reward scores its `response`: the last answer
    trajectory.metadata = {"checked": trajectory.turns == 2}  # given to the reward beside the record's metadata
    return trajectory
