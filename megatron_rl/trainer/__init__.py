"""The trainer executor: the Megatron-Core policy (model, packed micro-batches, log-probs, optimizer step),
the frozen reference of a KL penalty, checkpoints of the trainer's state, weights in and out."""

from megatron_rl.trainer.logprobs import CHUNK_TOKENS  # noqa: F401 - the dry run's memory estimate reads it
