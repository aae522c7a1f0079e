"""One policy-gradient step of the Megatron-Core policy on a batch of scored rollouts.

The whole global batch is given to every trainer rank (it is small: token ids and floats); each rank takes
its data-parallel share, cuts it into micro-batches of equal shape, and runs Megatron's schedule. The loss
is normalized by the global count of the chosen aggregation (valid tokens, or sequences), so gradients are
the same for any TP / PP / DP layout and any micro-batch size.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_rl import algorithms
from megatron_rl.trainer.logprobs import token_logprobs_and_entropy
from megatron_rl.trainer.policy import Policy, optimizer_step, run_microbatches

LOSSES = ("aipo", "aipo-clamp", "ppo", "sft")


def _ragged_index(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every element of ragged rows of these lengths, each row starting at column 0."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return rows, torch.arange(int(lengths.sum())) - starts[rows]


@dataclasses.dataclass
class TrainBatch:
    """Rollouts as padded tensors. Position t of the [N, L-1] tensors is the prediction of tokens[:, t+1]."""

    tokens: torch.Tensor  # [N, L] long: prompt + response, right-padded
    loss_mask: torch.Tensor  # [N, L-1] bool: True where tokens[:, t+1] is a policy action to train on
    behavior_logprobs: torch.Tensor  # [N, L-1] float: mu's log-prob of tokens[:, t+1] (0 where masked)
    advantages: torch.Tensor  # [N] float
    ref_logprobs: torch.Tensor | None = None  # [N, L-1] for the KL penalty

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       behavior_logprobs: Sequence[Sequence[float]], advantages: Sequence[float],
                       response_masks: Sequence[Sequence[bool]] | None = None, pad_id: int = 0,
                       pad_to_multiple_of: int = 1) -> "TrainBatch":
        """Pack prompt/response pairs. `response_masks[i][j]` False excludes response token j (observation
        tokens of a tool call, say) from the loss."""
        n = len(prompts)
        for name, seq in (("responses", responses), ("behavior_logprobs", behavior_logprobs),
                          ("advantages", advantages)):
            if len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} entries, prompts has {n}")
        for i, (p, r, lp) in enumerate(zip(prompts, responses, behavior_logprobs)):
            if len(lp) != len(r):
                raise ValueError(f"behavior_logprobs[{i}] has {len(lp)} values for {len(r)} response tokens")
            if not p:
                raise ValueError(f"prompts[{i}] is empty: the first response token needs a context")
            if response_masks is not None and len(response_masks[i]) != len(r):
                raise ValueError(f"response_masks[{i}] has {len(response_masks[i])} values for {len(r)} "
                                 "response tokens")
        # One scatter per tensor, not three small copies per row: this runs on the controller's critical path.
        prompt_len = torch.tensor([len(p) for p in prompts])
        response_len = torch.tensor([len(r) for r in responses])
        length = int((prompt_len + response_len).max())
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        seq_rows, seq_cols = _ragged_index(prompt_len + response_len)
        resp_rows, resp_cols = _ragged_index(response_len)
        resp_cols += (prompt_len - 1)[resp_rows]  # position t predicts token t + 1
        tokens = torch.full((n, length), pad_id, dtype=torch.long)
        tokens[seq_rows, seq_cols] = torch.tensor([t for p, r in zip(prompts, responses) for t in (*p, *r)],
                                                  dtype=torch.long)
        mask = torch.zeros((n, length - 1), dtype=torch.bool)
        mask[resp_rows, resp_cols] = True if response_masks is None else \
            torch.tensor([m for ms in response_masks for m in ms], dtype=torch.bool)
        blp = torch.zeros((n, length - 1), dtype=torch.float32)
        blp[resp_rows, resp_cols] = torch.tensor([v for lp in behavior_logprobs for v in lp], dtype=torch.float32)
        return cls(tokens, mask, blp, torch.tensor(advantages, dtype=torch.float32))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice) -> "TrainBatch":
        return TrainBatch(self.tokens[index], self.loss_mask[index], self.behavior_logprobs[index],
                          self.advantages[index], None if self.ref_logprobs is None else self.ref_logprobs[index])


@dataclasses.dataclass
class AlgorithmConfig:
    loss: str = "aipo"
    rho: float = 4.0  # AIPO's one-sided clip
    clip_eps: float = 0.2  # PPO
    clip_eps_high: float | None = None
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    temperature: float = 1.0

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ValueError(f"--loss {self.loss!r} is unknown; choose one of {LOSSES}")
        if self.aggregation not in algorithms.AGGREGATIONS:
            raise ValueError(f"--loss-aggregation {self.aggregation!r} is unknown; choose one of "
                             f"{algorithms.AGGREGATIONS}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 for training, got {self.temperature}")


def _normalizer(batch: TrainBatch, aggregation: str) -> float:
    if aggregation == "token-mean":
        return float(max(int(batch.loss_mask.sum()), 1))
    return float(len(batch))


def policy_loss(algo: AlgorithmConfig, logits: torch.Tensor, mb: dict[str, torch.Tensor], vocab_size: int,
                normalizer: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss of one micro-batch (already divided by the global normalizer) and its raw statistics."""
    targets = mb["tokens"][:, 1:]
    logprobs, entropy = token_logprobs_and_entropy(logits[:, :-1], targets, vocab_size, algo.temperature)
    mask, blp, adv = mb["loss_mask"], mb["behavior_logprobs"], mb["advantages"]
    kwargs = dict(aggregation=algo.aggregation, normalizer=normalizer, constant=float(targets.shape[1]))
    if algo.loss == "sft":  # supervised warm-up: negative log-likelihood of the masked tokens
        loss = algorithms.aggregate(-logprobs, mask, algo.aggregation, normalizer, kwargs["constant"])
    elif algo.loss == "aipo":
        loss, _ = algorithms.aipo_loss(logprobs, blp, adv, mask, rho=algo.rho, **kwargs)
    elif algo.loss == "aipo-clamp":
        loss, _ = algorithms.aipo_clamp_loss(logprobs, blp, adv, mask, rho=algo.rho, **kwargs)
    else:
        loss, _ = algorithms.ppo_clip_loss(logprobs, blp, adv, mask, algo.clip_eps, algo.clip_eps_high, **kwargs)
    stats: dict[str, Any] = {"pg_loss": loss.detach()}
    if algo.kl_coef and "ref_logprobs" in mb:
        kl = algorithms.aggregate(algorithms.kl_penalty(logprobs, mb["ref_logprobs"], mask, algo.kl_estimator),
                                  mask, algo.aggregation, normalizer, kwargs["constant"])
        loss = loss + algo.kl_coef * kl
        stats["kl_ref"] = kl.detach()
    ent = algorithms.aggregate(entropy, mask, algo.aggregation, normalizer, kwargs["constant"])
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * ent
    stats.update(entropy=ent.detach(), loss=loss.detach(),
                 logprobs=logprobs.detach()[mask], behavior_logprobs=blp[mask])
    return loss, stats


class PolicyTrainer:
    """Trains the policy with an RL loss. Every trainer rank calls `train_step` with the same batch."""

    def __init__(self, policy: Policy, algo: AlgorithmConfig, micro_batch_size: int = 1, scheduler=None):
        self.policy, self.algo, self.micro_batch_size, self.scheduler = policy, algo, micro_batch_size, scheduler
        self.step = 0

    def _microbatches(self, batch: TrainBatch) -> list[dict[str, torch.Tensor]]:
        from megatron.core import parallel_state as ps

        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        n, mbs = len(batch), self.micro_batch_size
        if n % (dp * mbs):
            raise ValueError(f"global batch of {n} rollouts is not divisible by data-parallel size {dp} x "
                             f"--micro-batch-size {mbs}")
        share = n // dp
        local = batch.rows(slice(dp_rank * share, (dp_rank + 1) * share))
        out = []
        for i in range(0, share, mbs):
            part = local.rows(slice(i, i + mbs))
            mb = {"tokens": part.tokens, "input_ids": part.tokens, "loss_mask": part.loss_mask,
                  "behavior_logprobs": part.behavior_logprobs, "advantages": part.advantages}
            if part.ref_logprobs is not None:
                mb["ref_logprobs"] = part.ref_logprobs
            out.append(mb)
        return out

    def train_step(self, batch: TrainBatch, before_update: Callable[[], None] | None = None) -> dict[str, float]:
        """One optimizer step on `batch`; returns the same metrics dict on every trainer rank. `before_update`
        runs between the backward passes and the optimizer step (the last moment the old weights are needed)."""
        from megatron.core import parallel_state as ps

        start = time.perf_counter()
        normalizer = _normalizer(batch, self.algo.aggregation)
        vocab = self.policy.spec.vocab_size
        stats = run_microbatches(self.policy, self._microbatches(batch),
                                 lambda logits, mb: policy_loss(self.algo, logits, mb, vocab, normalizer))
        if before_update is not None:
            before_update()
        step = optimizer_step(self.policy)
        if self.scheduler is not None and step["update_successful"]:
            self.scheduler.step(increment=1)  # a skipped step does not advance the schedule (as in Megatron)
        self.step += step["update_successful"]
        metrics = None
        if ps.is_pipeline_last_stage():
            metrics = self._reduce_stats(stats)
        metrics = _share_from_last_stage(metrics)
        elapsed = time.perf_counter() - start
        metrics.update(step, lr=self.policy.optimizer.param_groups[0]["lr"], step_time_s=elapsed,
                       trained_tokens=int(batch.loss_mask.sum()), tokens_per_s=int(batch.loss_mask.sum()) / elapsed)
        return metrics

    def _reduce_stats(self, stats: list[dict[str, Any]]) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        scalars = torch.tensor([sum(float(s[k]) for s in stats) if any(k in s for s in stats) else 0.0
                                for k in ("loss", "pg_loss", "entropy", "kl_ref")], dtype=torch.float64)
        dist.all_reduce(scalars, group=group)  # each micro-batch's value is already a share of the global mean
        lp = torch.cat([s["logprobs"] for s in stats])
        blp = torch.cat([s["behavior_logprobs"] for s in stats])
        gathered: list[Any] = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(gathered, (lp, blp), group=group)
        lp = torch.cat([g[0] for g in gathered]).unsqueeze(0)
        blp = torch.cat([g[1] for g in gathered]).unsqueeze(0)
        mask = torch.ones_like(lp, dtype=torch.bool)
        low = 1 - self.algo.clip_eps if self.algo.loss == "ppo" else None
        high = self.algo.rho if self.algo.loss.startswith("aipo") else 1 + (self.algo.clip_eps_high or self.algo.clip_eps)
        out = {"loss": scalars[0].item(), "pg_loss": scalars[1].item(), "entropy": scalars[2].item()}
        if self.algo.kl_coef:
            out["kl_ref"] = scalars[3].item()
        out.update(algorithms.offpolicy_diagnostics(lp, blp, mask, clip_low=low, clip_high=high))
        return out

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs of tokens[:, 1:] under the current policy, [N, L-1], on every trainer rank."""
        from megatron.core import parallel_state as ps

        vocab = self.policy.spec.vocab_size

        def fn(logits, mb):
            lp, _ = token_logprobs_and_entropy(logits[:, :-1], mb["tokens"][:, 1:], vocab, self.algo.temperature)
            return logits.sum() * 0, {"logprobs": lp}

        out = run_microbatches(self.policy, self._microbatches(batch), fn, forward_only=True)
        local = torch.cat([o["logprobs"] for o in out]) if out else None
        local = _share_from_last_stage(local)
        gathered: list[Any] = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(gathered, local, group=ps.get_data_parallel_group())
        return torch.cat(gathered)


def _share_from_last_stage(obj):
    """Broadcast a Python object from the last pipeline stage to every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    last = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast_object_list(box, src=last, group=ps.get_pipeline_model_parallel_group())
    return box[0]


def build_scheduler(policy: Policy, warmup_steps: int = 0, decay_steps: int = 1, decay_style: str = "constant"):
    """Megatron's learning-rate scheduler over optimizer steps, between the optimizer's lr and min_lr."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = policy.optimizer.config
    return OptimizerParamScheduler(
        policy.optimizer, init_lr=0.0 if warmup_steps else config.lr, max_lr=config.lr, min_lr=config.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=decay_style, start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=1,
        wd_incr_style="constant",
    )
