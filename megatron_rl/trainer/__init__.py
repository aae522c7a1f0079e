"""The trainer executor: the Megatron-Core policy (model, packed micro-batches, log-probs, optimizer step),
the frozen reference of a KL penalty, checkpoints of the trainer's state, weights in and out."""
