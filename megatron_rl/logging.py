"""Per-step metrics: always a JSONL file; wandb (offline unless WANDB_MODE says otherwise) and tensorboard
when asked, with Megatron-LM's flag names (--wandb-project, --wandb-exp-name, --wandb-save-dir,
--tensorboard-dir). Nested dicts are flattened to "a/b" keys for wandb and tensorboard."""

from __future__ import annotations

import json
import os


def flatten(metrics: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


class MetricsLogger:
    def __init__(self, output_dir: str, wandb_project: str | None = None, wandb_exp_name: str | None = None,
                 wandb_save_dir: str | None = None, tensorboard_dir: str | None = None, config: dict | None = None,
                 append: bool = False):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = open(self.path, "a" if append else "w")
        self._wandb = self._tb = None
        if wandb_project:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=wandb_project, name=wandb_exp_name, config=config or {},
                                     dir=wandb_save_dir or output_dir)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard_dir)

    def log(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        flat = flatten(metrics)
        if self._wandb is not None:
            self._wandb.log(flat, step=step)
        if self._tb is not None:
            for k, v in flat.items():
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
