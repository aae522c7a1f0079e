"""Checkpoints on disk: the RL checkpoint directory, the Megatron weights format, HF conversion, checksums,
and loading that runs no code from a file."""
