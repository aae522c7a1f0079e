"""What a run reports: per-step metrics (JSONL, wandb, tensorboard), the console progress line, the rollout
ledger and its accounting, and plots."""
