"""Prompt data: file readers, record validation, the prompt dataset, prompt encoding and stop tokens, tokenizers,
and the built-in synthetic tasks (`tasks/`)."""
