"""A prompt's token ids, and the token ids that end a response.

With --apply-chat-template a prompt is rendered by the tokenizer's own chat template (a string prompt is one
user message; --system-prompt comes first as a system message unless the prompt has its own), ending with the
template's generation prompt, so the policy sees exactly what the model's chat format expects. Without it a
string prompt is BOS + its text.

A response ends at any of the model's end tokens: the tokenizer's eos_token_id and every eos_token_id of the
checkpoint's generation_config.json (instruct models end a turn with e.g. <|eot_id|> rather than the tokenizer's
EOS).
"""

from __future__ import annotations

import os


def as_messages(prompt: str | list[dict], system_prompt: str | None) -> list[dict]:
    """The chat of `prompt`: a string becomes one user message; `system_prompt` leads unless one is there."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages


def encode_prompt(tokenizer, prompt: str | list[dict], apply_chat_template: bool,
                  system_prompt: str | None = None) -> list[int]:
    """The token ids the generators get for `prompt` (a string or an OpenAI-style message list)."""
    if apply_chat_template:
        return list(tokenizer.apply_chat_template(as_messages(prompt, system_prompt), add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    if not isinstance(prompt, str):
        raise ValueError("a prompt given as a message list needs --apply-chat-template")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(prompt, add_special_tokens=False)


def check_prompt_lengths(records, encode, limit: int, what: str, response_flag: str) -> None:
    """Every prompt of `records` fits in --seq-length with room for `response_flag`'s tokens (`limit` = what is
    left); else an error naming the record and the flags, before any work is lost."""
    for record in records:
        n = len(encode(record["prompt"]))
        if n > limit:
            raise ValueError(f"{what}: record {record['id']!r} has a prompt of {n} tokens, more than the {limit} that "
                             f"--seq-length leaves after {response_flag} (raise --seq-length, or shorten the prompt)")


def stop_token_ids(tokenizer, directories=()) -> tuple[int, ...]:
    """The tokenizer's eos_token_id, then every eos_token_id (an int or a list) of the generation_config.json in
    each of `directories` (None entries and directories without one are skipped), without repeats."""
    from transformers import GenerationConfig

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for directory in directories:
        path = os.path.join(directory, "generation_config.json") if directory else None
        if path is None or not os.path.isfile(path):
            continue
        try:
            eos = GenerationConfig.from_pretrained(directory).eos_token_id
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot be read ({e})") from None
        eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
        if not isinstance(eos, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise ValueError(f"{path}: field 'eos_token_id' must be an integer or a list of integers, got {eos!r}")
        ids += eos
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id and no generation_config.json names one: responses "
                         "could never end")
    return tuple(dict.fromkeys(ids))
