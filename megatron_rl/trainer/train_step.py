"""One policy-gradient step of the Megatron-Core policy on a batch of scored rollouts.

Each trainer rank gets its data-parallel rank's share of the step (`packing.split`; the trainer executor sends
each rank only its own, a caller may also give every rank the whole batch), cut into micro-batches
(`trainer.packing`: rows padded to their own longest, or packed by a token budget), and runs Megatron's schedule.
The loss is normalized by the global count of the chosen aggregation (valid tokens, or sequences), which the share
carries, so gradients are the same for any TP / PP / DP layout and any micro-batching.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl import algorithms
from megatron_rl.algorithms import AlgorithmConfig, checks
from megatron_rl.trainer import packing
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.logprobs import next_token_logprobs_and_entropy
from megatron_rl.trainer.policy import Policy, forward_logprobs, moe_aux_loss, optimizer_step, run_microbatches
from megatron_rl.trainer.reference import ReferenceModel


def policy_loss(algo: AlgorithmConfig, logits: torch.Tensor, mb: dict[str, torch.Tensor], vocab_size: int,
                normalizer: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss of one micro-batch (already divided by the global normalizer) and its raw statistics, among them
    how many valid tokens each of the loss's indicators (clipped, masked, ...) marked."""
    logprobs, entropy = next_token_logprobs_and_entropy(logits, mb["tokens"], vocab_size, algo.temperature)
    logprobs, entropy = packing.rows_view(logprobs, mb), packing.rows_view(entropy, mb)
    mask, blp = mb["loss_mask"], mb["behavior_logprobs"]
    constant = algo.seq_sum_constant if algo.seq_sum_constant is not None else mb["batch_width"]
    aggregation = dict(aggregation=algo.aggregation, normalizer=normalizer, constant=float(constant))
    loss, indicators = algorithms.LOSSES[algo.loss].compute(
        algorithms.LossInputs(logprobs, blp, mb["advantages"], mask, aggregation), algo.params)
    stats: dict[str, Any] = {"pg_loss": loss.detach(),
                             "indicator_counts": {name: (flag & mask).sum() for name, flag in indicators.items()}}
    if algo.kl_coef:
        if "ref_logprobs" not in mb:
            raise ValueError("kl_coef is set but the micro-batch has no reference log-probs (ref_logprobs)")
        kl = algorithms.aggregate(algorithms.kl_penalty(logprobs, mb["ref_logprobs"], mask, algo.kl_estimator),
                                  mask, **aggregation)
        if not algo.kl_in_reward:  # in the reward, the KL already shaped the advantages: here it is only reported
            loss = loss + algo.kl_coef * kl
        stats["kl_ref"] = kl.detach()
    ent = algorithms.aggregate(entropy, mask, **aggregation)
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * ent
    stats.update(entropy=ent.detach(), loss=loss.detach(), model_tokens=mb["tokens"].numel(),
                 logprobs=logprobs.detach(), behavior_logprobs=blp, loss_mask=mask)
    return loss, stats


class PolicyTrainer:
    """Trains the policy with an RL loss. Every trainer rank calls `train_step` with the same batch or with its
    DP rank's share of it (a `packing.BatchShare`). `batching`:
    how the batch becomes micro-batches (a `packing.MicroBatching`, or a number of rows per micro-batch). With a KL
    penalty (`algo.kl_coef`), `reference` is the frozen reference model whose log-probs it needs."""

    def __init__(self, policy: Policy, algo: AlgorithmConfig, batching: packing.MicroBatching | int = 1,
                 scheduler=None, reference: ReferenceModel | None = None):
        if isinstance(batching, int):
            batching = packing.MicroBatching(micro_batch_size=batching)
        if batching.dynamic and policy.layout.transformer_impl == "local" and policy.spec.sliding_window:
            raise ValueError(f"--use-dynamic-batch-size: model {policy.spec.name!r} has sliding-window attention, "
                             "which the local spec cannot restrict to packed sequences; use --transformer-impl "
                             "transformer_engine or a fixed --micro-batch-size")
        self.policy, self.algo, self.batching, self.scheduler = policy, algo, batching, scheduler
        self.reference = reference
        self.step = 0

    def share(self, batch: TrainBatch | packing.BatchShare, forward_only: bool = False) -> packing.BatchShare:
        """This DP rank's share of a step (`batch` itself when it is one already)."""
        from megatron.core import parallel_state as ps

        if isinstance(batch, packing.BatchShare):
            return batch
        return packing.split(batch, self.batching, ps.get_data_parallel_world_size(), forward_only)[
            ps.get_data_parallel_rank()]

    def _microbatches(self, share: packing.BatchShare) -> list[dict[str, Any]]:
        """The share's micro-batches, planned on the host (`packing.microbatches`) and then moved to the policy's
        device; on a GPU through pinned memory, so that the copies do not wait for the device's queued work."""
        from megatron.core import parallel_state as ps

        multiple = ps.get_tensor_model_parallel_world_size() if self.policy.config.sequence_parallel else 1
        parts = packing.microbatches(share, multiple, thd=self.policy.layout.transformer_impl == "transformer_engine")
        device = self.policy.device
        pin = device.type == "cuda"

        def moved(v):
            return (v.pin_memory() if pin else v).to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v

        return [{**{k: moved(v) for k, v in mb.items()}, "batch_width": share.width} for mb in parts]

    def train_step(self, batch: TrainBatch | packing.BatchShare, before_update: Callable[[], None] | None = None
                   ) -> dict[str, float]:
        """One optimizer step on `batch`; returns the same metrics dict on every trainer rank. `before_update`
        runs between the backward passes and the optimizer step (the last moment the old weights are needed).

        The host waits for the device once in the micro-batches' work (besides what Megatron-Core's optimizer
        does, such as reading the gradient norm): when it reads the step's metrics, which carry the loss inputs'
        non-finite counts too. A non-finite advantage or log-prob where the loss mask is set raises, naming it,
        before the optimizer step, on every rank."""
        from megatron.core import parallel_state as ps

        start = time.perf_counter()
        share = self.share(batch)
        normalizer = algorithms.AGGREGATIONS[self.algo.aggregation].global_normalizer(share.valid_tokens, share.size)
        vocab = self.policy.spec.vocab_size
        microbatches = self._microbatches(share)
        if self.algo.kl_coef and share.batch.ref_logprobs is None:
            self._add_reference_logprobs(microbatches)
        with checks.deferred_finite_checks() as nonfinite:
            stats = run_microbatches(self.policy, microbatches,
                                     lambda logits, mb: policy_loss(self.algo, logits, mb, vocab, normalizer))
        aux_loss = moe_aux_loss(self.policy, len(microbatches))
        metrics = self._reduce_stats(stats, nonfinite) if ps.is_pipeline_last_stage() else None
        metrics = _share_from_last_stage(metrics)
        for name, count in metrics.pop("nonfinite").items():
            if count:
                checks.raise_nonfinite(name, count)
        if before_update is not None:
            before_update()
        step = optimizer_step(self.policy)
        if self.scheduler is not None and step["update_successful"]:
            self.scheduler.step(increment=1)  # a skipped step does not advance the schedule (as in Megatron)
        self.step += step["update_successful"]
        if aux_loss is not None:
            metrics["moe_aux_loss"] = aux_loss
        elapsed = time.perf_counter() - start
        metrics.update(step, lr=self.policy.optimizer.param_groups[0]["lr"], step_time_s=elapsed,
                       trained_tokens=share.valid_tokens, tokens_per_s=share.valid_tokens / elapsed)
        return metrics

    def _add_reference_logprobs(self, microbatches: list[dict[str, torch.Tensor]]) -> None:
        """The reference model's log-probs of each micro-batch, as its "ref_logprobs" (on the policy's device,
        on the last pipeline stage, where the loss is computed): a forward-only pass before the policy's."""
        if self.reference is None:
            raise ValueError(f"kl_coef {self.algo.kl_coef} needs a reference model, and the trainer has none")
        ref = self.reference.logprobs(microbatches, self.algo.temperature)
        if ref and len(ref) != len(microbatches):
            raise RuntimeError(f"the reference gave log-probs for {len(ref)} of {len(microbatches)} micro-batches")
        for mb, lp in zip(microbatches, ref):
            mb["ref_logprobs"] = lp

    def _reduce_stats(self, stats: list[dict[str, Any]], nonfinite: list[tuple[str, torch.Tensor]]
                      ) -> dict[str, Any]:
        """The step's metrics, the same on every data-parallel rank: the losses; `<name>_fraction`, the fraction of
        the batch's valid tokens that each of the loss's indicators marked; the off-policy diagnostics; and
        "nonfinite", the loss inputs' non-finite values by name (`checks.deferred_finite_checks`).

        One read from the device: the scalars (summed over DP on the device) and this rank's per-token log-probs,
        behavior log-probs and loss masks, in one tensor. The tokens' values are then gathered over DP on the host
        (Megatron-Core's gloo DP group), for the diagnostics' quantiles."""
        from megatron.core import parallel_state as ps

        device = self.policy.device
        names = sorted(stats[0]["indicator_counts"])  # the same on every rank: the loss and its config decide
        checked = list(dict.fromkeys(name for name, _ in nonfinite))

        def total(values) -> torch.Tensor:
            values = list(values)
            return torch.stack(values).double().sum() if values else torch.zeros((), dtype=torch.float64,
                                                                                   device=device)

        scalars = torch.stack([total(s[k] for s in stats if k in s) for k in ("loss", "pg_loss", "entropy", "kl_ref")]
                              + [total(s["indicator_counts"][k] for s in stats) for k in names]
                              + [torch.full((), float(sum(s["model_tokens"] for s in stats)), dtype=torch.float64,
                                            device=device)]
                              + [total(c for n, c in nonfinite if n == name) for name in checked])
        dist.all_reduce(scalars, group=ps.get_data_parallel_group())  # micro-batch values are shares of global means
        per_token = [torch.cat([s[k].flatten() for s in stats]).double()
                     for k in ("logprobs", "behavior_logprobs", "loss_mask")]
        host = torch.cat([scalars, *per_token]).cpu()
        scalars, lp, blp, mask = host.split([len(scalars)] + [len(t) for t in per_token])
        mask = mask.bool()
        gathered: list[Any] = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(gathered, (lp[mask], blp[mask]), group=ps.get_data_parallel_group_gloo())
        lp = torch.cat([g[0] for g in gathered]).unsqueeze(0)
        blp = torch.cat([g[1] for g in gathered]).unsqueeze(0)
        values = scalars.tolist()
        out: dict[str, Any] = {"loss": values[0], "pg_loss": values[1], "entropy": values[2]}
        if self.algo.kl_coef:
            out["kl_ref"] = values[3]
        valid_tokens = max(lp.numel(), 1)  # every rank's valid tokens, gathered
        indicators, rest = values[4:4 + len(names)], values[4 + len(names):]
        out.update({f"{name}_fraction": count / valid_tokens for name, count in zip(names, indicators)})
        out["model_tokens"] = int(rest[0])  # what the model ran on: real tokens and padding
        out["nonfinite"] = {name: int(count) for name, count in zip(checked, rest[1:])}
        out.update(algorithms.offpolicy_diagnostics(lp, blp, torch.ones_like(lp, dtype=torch.bool)))
        return out

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch | packing.BatchShare, reference: bool = False) -> torch.Tensor:
        """Log-probs of tokens[:, 1:] under the current policy (or, with `reference`, the reference model),
        [N, L-1], on every trainer rank (on the host: gathered as Python objects)."""
        from megatron.core import parallel_state as ps

        share = self.share(batch, forward_only=True)
        microbatches = self._microbatches(share)
        if reference:
            if self.reference is None:
                raise ValueError("reference log-probs need a reference model (--kl-coef), and the trainer has none")
            out = self.reference.logprobs(microbatches, self.algo.temperature)
        else:
            out = forward_logprobs(self.policy, microbatches, self.policy.spec.vocab_size, self.algo.temperature)
        local = [(mb["rows"].cpu(), lp.cpu()) for mb, lp in zip(microbatches, out) if not mb.get("filler")] \
            if out else None
        local = _share_from_last_stage(local)
        gathered: list[Any] = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(gathered, local, group=ps.get_data_parallel_group())
        width = share.width
        result = torch.zeros((share.size, width), dtype=torch.float32)
        for rows, lp in (part for rank in gathered for part in rank):
            result[rows, :min(width, lp.shape[1])] = lp[:, :width]  # without any sequence-parallel padding
        return result


def _share_from_last_stage(obj):
    """Broadcast a Python object from the last pipeline stage to every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    last = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast_object_list(box, src=last, group=ps.get_pipeline_model_parallel_group())
    return box[0]


def build_scheduler(policy: Policy, warmup_steps: int = 0, decay_steps: int = 1, decay_style: str = "constant",
                    wsd_decay_steps: int | None = None, wsd_decay_style: str = "exponential"):
    """Megatron's learning-rate scheduler over optimizer steps, between the optimizer's lr and min_lr. WSD:
    warm-up, a stable phase at lr, then `wsd_decay_steps` of `wsd_decay_style` decay ending at `decay_steps`."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = policy.optimizer.config
    return OptimizerParamScheduler(
        policy.optimizer, init_lr=0.0 if warmup_steps else config.lr, max_lr=config.lr, min_lr=config.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=decay_style, start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=1,
        wd_incr_style="constant", wsd_decay_steps=wsd_decay_steps, lr_wsd_decay_style=wsd_decay_style,
    )
