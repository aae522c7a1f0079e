"""Per-step metrics: what one RL step reports (`step_metrics`), written always to a JSONL file and to wandb
(offline unless WANDB_MODE says otherwise) and tensorboard when asked, with Megatron-LM's flag names
(--wandb-project, --wandb-exp-name, --wandb-save-dir, --tensorboard-dir; nested dicts become "a/b" keys there);
and the per-rollout log (--log-rollouts)."""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_rl.algorithms.diagnostics import lag_summary


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


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


class RolloutLog:
    """rollouts.jsonl (--log-rollouts): the trajectory contract of every consumed or discarded rollout, and why."""

    def __init__(self, output_dir: str, append: bool):
        self._file = open(os.path.join(output_dir, "rollouts.jsonl"), "a" if append else "w")

    def outcomes(self, step: int, version: int, outcomes) -> None:
        """(rollout, None if trained else the reason) pairs consumed at trainer `version`."""
        for r, reason in outcomes:
            o = r.output
            self._file.write(json.dumps({
                "step": step, "prompt_id": r.prompt_id, "sample_index": r.sample_index, "versions": o.versions,
                "consumed_at_version": version, "lag": version - r.oldest_version, "outcome": reason or "trained",
                "reward": r.reward.reward, "reward_status": r.reward.status, "finish_reason": o.finish_reason,
                "num_retractions": o.num_retractions, "logprob_convention": o.logprob_convention,
                "response_tokens": len(o.token_ids)}) + "\n")
        self._file.flush()

    def resent(self, step: int, prompt_id: str, sample_index: int) -> None:
        self._file.write(json.dumps({"step": step, "prompt_id": prompt_id, "sample_index": sample_index,
                                     "outcome": "in flight at the checkpoint: generated again"}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclasses.dataclass
class StepTimes:
    wait_s: float = 0.0  # trainer idle: waiting for rollouts
    reward_s: float = 0.0  # scoring this step's rollouts in the reward stage (overlapped, not the trainer's time)
    train_s: float = 0.0  # includes waiting, before the optimizer step, for the previous step's DDMA sends
    sync_s: float = 0.0  # announcing the new version and posting this rank's DDMA sends


def generator_totals(generators: dict[int, dict]) -> dict[str, float]:
    """The generators' cumulative counters, summed over generators."""
    keys = ("busy_s", "idle_s", "sync_s", "tokens", "engine_restarts", "rerun_requests")
    return {k: sum(s.get(k, 0) for s in generators.values()) for k in keys}


def step_metrics(rollouts: list, seen: dict, train: dict, times: StepTimes, totals: dict, previous: dict,
                 step_s: float, **fields) -> dict:
    """One RL step's metrics row. `rollouts`: those trained on; `seen`: what the step popped from the buffer
    (discards, lag histogram, rewards of every sampled rollout, ages); `totals` and `previous`: the generators'
    counters now and at the previous step (`generator_totals`); `fields` go in as they are."""
    delta = {k: totals[k] - previous.get(k, 0) for k in totals}
    sampled = seen["sampled_rewards"]
    return {
        **fields,
        # over every rollout sampled for this step (the policy's performance), and over those trained on
        # (uniform-reward groups carry no signal and are dropped)
        "reward_mean": sum(sampled) / len(sampled),
        "accuracy": sum(r == 1.0 for r in sampled) / len(sampled),
        "reward_mean_trained": sum(r.reward.reward for r in rollouts) / len(rollouts),
        "response_length_mean": sum(len(r.output.token_ids) for r in rollouts) / len(rollouts),
        "retracted_fraction": sum(r.output.num_retractions > 0 for r in rollouts) / len(rollouts),
        "step_time_s": step_s,
        "trainer_time": {"wait_for_rollouts_s": times.wait_s, "reward_s": times.reward_s, "train_s": times.train_s,
                         "sync_s": times.sync_s},
        "generator_time": {"generate_s": delta["busy_s"], "idle_s": delta["idle_s"], "sync_s": delta["sync_s"]},
        "generation_tokens_per_s": delta["tokens"] / step_s,
        "train_tokens_per_s": train["tokens_per_s"],
        "staleness_histogram": {str(k): v for k, v in sorted(seen["lags"].items())},
        **lag_summary(dict(seen["lags"])),
        "rollout_age_s": sum(seen["ages"]) / max(len(seen["ages"]), 1),  # wall time from dispatch to consumption
        "discards": dict(seen["discards"]),
        "generator_restarts": totals["engine_restarts"],
        "rerun_requests": totals["rerun_requests"],
        "train": {k: v for k, v in train.items() if isinstance(v, (int, float))},
    }
