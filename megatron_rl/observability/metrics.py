"""Per-step metrics: what one RL step reports (`step_metrics`), grouped the way slime and verl users read them
(`rollout/*`: what was sampled and trained on, `train/*`: the optimizer step, `perf/*`: time and throughput, and
`eval/<set>/*` from evaluations), written always to a JSONL file (nested groups) and to wandb and tensorboard
when asked, with Megatron-LM's flag names (--wandb-project, --wandb-exp-name, --wandb-save-dir,
--tensorboard-dir; groups become "rollout/reward_mean" keys there); the console progress (`Progress`); and the
ledger of rollouts (rollouts.jsonl)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter

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


def run_config(args) -> dict:
    """The run's flags as logged to wandb: the scalar ones (str, int, float, bool). A credential
    (--sglang-api-key, a `rollout.sglang.arguments.Secret`) is no scalar, so it is never logged."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}


def wandb_mode(flag: str | None = None) -> str:
    """--wandb-mode, else WANDB_MODE, else online when an API key is set, else offline (never a silent upload
    attempt from a machine that has no key)."""
    return flag or os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


class MetricsLogger:
    def __init__(self, output_dir: str, wandb_project: str | None = None, wandb_exp_name: str | None = None,
                 wandb_save_dir: str | None = None, tensorboard_dir: str | None = None, config: dict | None = None,
                 append: bool = False, wandb_mode_flag: str | None = None):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = open(self.path, "a" if append else "w")
        self._wandb = self._tb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=wandb_exp_name, config=config or {},
                                     dir=wandb_save_dir or output_dir, mode=wandb_mode(wandb_mode_flag))
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
    """rollouts.jsonl, the run's ledger (always written): every RL prompt dispatched, every sample trained on or
    discarded (with the reason and its contract fields), every sample generated again after a resume. Each row
    has the step it belongs to (a resume drops the rows of lost steps) and an `event`: "dispatched", "trained",
    "discarded" or "resent". `megatron_rl.observability.accounting` reads it back."""

    def __init__(self, output_dir: str, append: bool):
        self._file = open(os.path.join(output_dir, "rollouts.jsonl"), "a" if append else "w")

    def _write(self, rows) -> None:
        self._file.writelines(json.dumps(row) + "\n" for row in rows)
        self._file.flush()

    def dispatched(self, step: int, prompt_ids: list[str], samples: int) -> None:
        self._write({"step": step, "event": "dispatched", "prompt_id": pid, "samples": samples} for pid in prompt_ids)

    def outcomes(self, step: int, version: int, outcomes) -> None:
        """(rollout, None if trained else the reason) pairs consumed at trainer `version`."""
        self._write({
            "step": step, "event": "discarded" if reason else "trained", "prompt_id": r.prompt_id,
            "sample_index": r.sample_index, "versions": r.output.versions, "consumed_at_version": version,
            "lag": version - r.oldest_version, "outcome": reason or "trained", "reward": r.reward.reward,
            "reward_status": r.reward.status, "finish_reason": r.output.finish_reason,
            "num_retractions": r.output.num_retractions, "logprob_convention": r.output.logprob_convention,
            "response_tokens": len(r.output.token_ids),
            **({} if r.output.trajectory is None else {"trajectory": _ledger_trajectory(r)})} for r, reason in outcomes)

    def resent(self, step: int, prompt_id: str, samples: list[int]) -> None:
        self._write({"step": step, "event": "resent", "prompt_id": prompt_id, "sample_index": k,
                     "outcome": "in flight at the checkpoint: generated again"} for k in samples)

    def close(self) -> None:
        self._file.close()


def _ledger_trajectory(rollout) -> dict:
    """An agent trajectory's row fields: turns, tool calls and errors, policy tokens, why it failed (the reason and
    its kind: `rollout.agent.AgentFailure`)."""
    t = rollout.output.trajectory
    return {"turns": t["turns"], "tool_calls": t["tool_calls"], "tool_errors": t["tool_errors"],
            "policy_tokens": len(rollout.output.policy_versions), "environment_failure": t["environment_failure"],
            "failure_kind": t.get("failure_kind")}


def agent_metrics(outcomes) -> dict:
    """Agent trajectories among what the step popped: turns and tool calls per trajectory and tool errors per call,
    over the trajectories that did not fail (None if all did); the failed ones (excluded) counted, in all and by
    kind. Empty for plain rollouts."""
    trajectories = [r.output.trajectory for r, _ in outcomes if r.output.trajectory is not None]
    if not trajectories:
        return {}
    ok = [t for t in trajectories if not t["environment_failure"]]
    n, calls = len(ok), sum(t["tool_calls"] for t in ok)
    return {"turns_mean": sum(t["turns"] for t in ok) / n if n else None,
            "tool_calls_mean": calls / n if n else None,
            "tool_call_rate": sum(t["tool_calls"] > 0 for t in ok) / n if n else None,
            "tool_error_rate": sum(t["tool_errors"] for t in ok) / calls if calls else 0.0,
            "environment_failures": len(trajectories) - n,
            "failures": dict(Counter(t.get("failure_kind") or "environment" for t in trajectories
                                     if t["environment_failure"]))}


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


def _stats(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    return {"mean": mean, "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)),
            "min": min(values), "max": max(values)}


def discards_by_length(outcomes) -> dict[str, dict[str, int]]:
    """What the step popped, by response-length bucket ("<=N" tokens, N a power of two): how many rollouts and how
    many of them each reason discarded. The staleness gate drops the long responses first (their oldest token is
    the oldest): a length bias this makes visible."""
    buckets: dict[int, Counter] = {}
    for rollout, reason in outcomes:
        n = len(rollout.output.token_ids)
        bucket = buckets.setdefault(1 << (n - 1).bit_length() if n else 0, Counter())
        bucket["popped"] += 1
        if reason:
            bucket[reason.split(":")[0]] += 1
    return {f"<={n}": dict(counts) for n, counts in sorted(buckets.items())}


def step_metrics(rollouts: list, seen: dict, train: dict, times: StepTimes, totals: dict, previous: dict,
                 step_s: float, *, weight_version: int, consumed_samples: int, time_s: float, skipped_steps: int,
                 reward_failures: dict, is_async: bool) -> dict:
    """One RL step's metrics row, in groups. `rollouts`: those trained on; `seen`: what the step popped from the
    buffer (discards, lag histogram, rewards of every sampled rollout, ages); `totals` and `previous`: the
    generators' counters now and at the previous step (`generator_totals`)."""
    delta = {k: totals[k] - previous.get(k, 0) for k in totals}
    sampled = seen["sampled_rewards"]
    lengths = [len(r.output.token_ids) for r in rollouts]
    reward = _stats(sampled)  # over every rollout sampled for this step: the policy's performance
    return {
        "rollout": {
            **{f"reward_{k}": v for k, v in reward.items()},
            "accuracy": sum(r == 1.0 for r in sampled) / len(sampled),
            # over those trained on (groups whose rewards are all equal carry no signal and are dropped)
            "reward_mean_trained": sum(r.reward.reward for r in rollouts) / len(rollouts),
            "response_length_mean": sum(lengths) / len(lengths),
            "response_length_max": max(lengths),
            "truncated_fraction": sum(r.output.finish_reason == "length" for r in rollouts) / len(rollouts),
            "retracted_fraction": sum(r.output.num_retractions > 0 for r in rollouts) / len(rollouts),
            "staleness_histogram": {str(k): v for k, v in sorted(seen["lags"].items())},
            **lag_summary(dict(seen["lags"])),
            "age_s": sum(seen["ages"]) / max(len(seen["ages"]), 1),  # wall time from dispatch to consumption
            "discards": dict(seen["discards"]),
            "due_groups": seen.get("due_groups", 0),  # --staleness-control admission: trained before too old
            "discards_by_length": discards_by_length(seen["outcomes"]),
            "reward_failures": reward_failures,
            **{f"agent_{k}": v for k, v in agent_metrics(seen["outcomes"]).items()},
            "generator_restarts": totals["engine_restarts"],
            "rerun_requests": totals["rerun_requests"],
        },
        "train": {**{k: v for k, v in train.items() if isinstance(v, (int, float))},
                  "weight_version": weight_version, "consumed_samples": consumed_samples,
                  "skipped_steps": skipped_steps},
        "perf": {
            "async": is_async,
            "step_time_s": step_s,
            "time_s": time_s,  # wall time of RL so far
            "wait_for_rollouts_s": times.wait_s, "reward_s": times.reward_s, "train_s": times.train_s,
            "sync_s": times.sync_s,
            "generator_generate_s": delta["busy_s"], "generator_idle_s": delta["idle_s"],
            "generator_sync_s": delta["sync_s"],
            "generation_tokens_per_s": delta["tokens"] / step_s,
            "train_tokens_per_s": train["tokens_per_s"],
        },
    }


def console_fields(metrics: dict) -> dict[str, str]:
    """What the console shows of an RL step's metrics."""
    rollout, train = metrics["rollout"], metrics["train"]
    fields = {"reward": f"{rollout['reward_mean']:.3f}", "acc": f"{rollout['accuracy']:.2f}",
              "loss": f"{train.get('loss', math.nan):.4g}", "lag": f"{rollout['lag_max']:.0f}"}
    if "kl_ref" in train:
        fields["kl_ref"] = f"{train['kl_ref']:.3g}"
    return fields


class Progress:
    """The RL loop's progress on the console: a tqdm bar on a terminal; elsewhere (a log file, a batch job) one
    plain line every `interval` steps with the step rate and ETA, since a bar's carriage returns make the whole
    run one unreadable line there."""

    def __init__(self, start: int, total: int, desc: str, interval: int, stream=None):
        self.stream = stream or sys.stderr
        self.start, self.total, self.desc, self.interval = start, total, desc, interval
        self.started = time.perf_counter()
        self._bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(initial=start, total=total, desc=desc, dynamic_ncols=True, file=self.stream)

    def update(self, step: int, fields: dict[str, str]) -> None:
        """Step `step` is done; `fields`: what to show of it."""
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(fields)
            return
        if step % self.interval and step != self.total:
            return
        from tqdm import tqdm

        elapsed = time.perf_counter() - self.started
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        eta = tqdm.format_interval((self.total - step) / rate) if rate else "?"
        line = " | ".join(f"{k} {v}" for k, v in fields.items())
        print(f"{self.desc} step {step}/{self.total} | {line} | {1 / rate if rate else float('nan'):.2f} s/step | "
              f"elapsed {tqdm.format_interval(elapsed)} | eta {eta}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
