"""Micro-batches that pay for real tokens: which rollouts go to which data-parallel rank and micro-batch, and how
one micro-batch is laid out for the model.

Two ways to cut a step's rollouts (`MicroBatching`):
- fixed (`--micro-batch-size`): each DP rank takes a contiguous share of rows, cut into micro-batches of that many
  rows, each right-padded only to its own longest row;
- dynamic (`--use-dynamic-batch-size --max-tokens-per-gpu N`): the rollouts are spread over the DP ranks balanced
  by tokens, and each rank's share is packed into micro-batches of at most N tokens, the same number on every rank
  (expert-parallel all-to-alls run per micro-batch in step across DP). A micro-batch is then one
  packed row: its sequences back to back, positions restarting at each, attention confined to each sequence
  (a block-diagonal causal mask on the local spec, THD `PackedSeqParams` on Transformer Engine).

The plan is a pure function of the rollouts' lengths. Trainer rank 0 makes it and sends each DP rank only its share
of the step (`split`: its rollouts, its micro-batches, and the step's counts that normalizers need). Every DP rank
runs the same number of micro-batches; a rank with fewer rollouts than that (a step the gates left short, or fewer
rollouts than DP ranks) runs fillers: a copy of one of its rollouts with nothing in its loss mask. A mixture
of experts' router losses (--moe-aux-loss-coeff) still count a filler's tokens: Megatron-Core computes them in the
forward pass, and a micro-batch of padding only would divide by zero there.
Whatever the packing, the loss sees each micro-batch as rows ([rows, width] per-token tensors: `rows_view`), so
the losses and aggregations are the same code for both, and their normalizers are global counts.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import torch

from megatron_rl.trainer.batch import TrainBatch


@dataclasses.dataclass(frozen=True)
class MicroBatching:
    """How a step's rollouts become micro-batches. `max_tokens` set: dynamic (packed, token-budgeted) micro-batches
    for training and `logprob_max_tokens` (default `max_tokens`) for forward-only log-prob passes; None: fixed
    micro-batches of `micro_batch_size` rows."""

    micro_batch_size: int = 1
    max_tokens: int | None = None
    logprob_max_tokens: int | None = None

    def __post_init__(self):
        for flag, value in (("--micro-batch-size", self.micro_batch_size), ("--max-tokens-per-gpu", self.max_tokens),
                            ("--log-probs-max-tokens-per-gpu", self.logprob_max_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.logprob_max_tokens is not None and self.max_tokens is None:
            raise ValueError("--log-probs-max-tokens-per-gpu needs --use-dynamic-batch-size and --max-tokens-per-gpu")

    @property
    def dynamic(self) -> bool:
        return self.max_tokens is not None

    def budget(self, forward_only: bool) -> int | None:
        return (self.logprob_max_tokens or self.max_tokens) if forward_only else self.max_tokens


def balanced_partition(costs: list[int], parts: int) -> list[list[int]]:
    """Indices of `costs` in `parts` groups of near-equal total cost: longest first, each to the least loaded
    group (LPT). Each group lists its indices in increasing order; ties go to the lowest group."""
    heap = [(0, g) for g in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + costs[i], g))
    return [sorted(g) for g in groups]


def plan_dynamic(lengths: list[int], dp: int, max_tokens: int, flag: str = "--max-tokens-per-gpu"
                 ) -> list[list[list[int]]]:
    """plan[rank][k]: the rows (indices into `lengths`) of DP rank `rank`'s k-th micro-batch, every micro-batch at
    most `max_tokens` tokens, the same number of micro-batches on every rank (the fewest LPT finds; a rank with
    fewer rollouts than that gets empty ones, see `microbatches`). A sequence longer than the budget is an error
    naming both."""
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"rollout {i} has {n} tokens (prompt + response), more than {flag} {max_tokens}: "
                             f"raise {flag} to at least {n} or lower --rollout-max-response-len")
    shares = balanced_partition(lengths, dp)
    count = max(1, max(_ceil_div(sum(lengths[i] for i in share), max_tokens) for share in shares))
    while True:
        plan = [[[share[j] for j in mb] for mb in balanced_partition([lengths[i] for i in share], count)]
                for share in shares]
        if all(sum(lengths[i] for i in mb) <= max_tokens for rank in plan for mb in rank):
            return plan
        count += 1


def plan_fixed(n: int, dp: int, micro_batch_size: int) -> list[list[list[int]]]:
    """plan[rank][k]: a contiguous share of the rows per DP rank (sizes differing by at most one), cut into the
    same number of contiguous micro-batches on every rank, at most `micro_batch_size` rows each: exactly that
    many when `n` divides evenly, near-equal parts when the gates left a step short of its global batch."""
    bounds = [r * n // dp for r in range(dp + 1)]
    count = max(1, _ceil_div(_ceil_div(n, dp), micro_batch_size))
    return [[list(range(lo + k * (hi - lo) // count, lo + (k + 1) * (hi - lo) // count)) for k in range(count)]
            for lo, hi in zip(bounds, bounds[1:])]


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def _round_up(n: int, multiple: int) -> int:
    return _ceil_div(n, multiple) * multiple


def _row_tensors(batch: TrainBatch, rows, width: int) -> dict[str, torch.Tensor]:
    """The loss's per-row inputs of these rows, `width` prediction positions each."""
    out = {"loss_mask": batch.loss_mask[rows, :width], "behavior_logprobs": batch.behavior_logprobs[rows, :width],
           "advantages": batch.advantages[rows]}
    if batch.ref_logprobs is not None:
        out["ref_logprobs"] = batch.ref_logprobs[rows, :width]
    return out


def padded_microbatch(batch: TrainBatch, rows: list[int], multiple: int = 1) -> dict[str, Any]:
    """Rows right-padded to their own longest (rounded up to `multiple`: the sequence-parallel split)."""
    index = torch.tensor(rows)
    length = _round_up(int(batch.seq_lengths[index].max()), multiple)
    part = batch.rows(index)
    if length > part.tokens.shape[1]:
        part = part.padded(multiple)
    mb = {"tokens": part.tokens[:, :length], **_row_tensors(part, slice(None), length - 1),
          "padding_mask": torch.arange(length)[None] >= batch.seq_lengths[index][:, None]}
    if part.routed_experts is not None:
        mb["routed_experts"] = part.routed_experts[:, :length]
    return mb


def packed_microbatch(batch: TrainBatch, rows: list[int], multiple: int = 1) -> dict[str, Any]:
    """Rows packed back to back into one row of tokens, padded at the end to a multiple of `multiple`. Adds what
    the model needs to see each sequence alone (`position_ids`, `segments`: the sequence of each position, the tail
    padding its own; `cu_seqlens` and `longest_segment`, their bounds for THD attention) and `unpack` [rows, width]:
    where each row's prediction positions sit in the packed row. Everything is computed here, on the host, so that
    the step never reads a shape back from the device."""
    index = torch.tensor(rows)
    lengths = batch.seq_lengths[index]
    total = int(lengths.sum())
    padded_total = _round_up(total, multiple)
    starts = torch.cumsum(lengths, 0) - lengths
    width = int(lengths.max()) - 1
    tokens = torch.cat([batch.tokens[i, :n] for i, n in zip(rows, lengths.tolist())]
                       + [batch.tokens.new_zeros(padded_total - total)])
    segment_lengths = lengths.tolist() + ([padded_total - total] if padded_total > total else [])
    segments = torch.repeat_interleave(torch.arange(len(segment_lengths)), torch.tensor(segment_lengths))
    positions = torch.cat([torch.arange(n) for n in segment_lengths])
    column = torch.arange(width)
    unpack = torch.where(column < (lengths - 1)[:, None], starts[:, None] + column, torch.zeros((), dtype=torch.long))
    cu_seqlens = torch.tensor([0] + segment_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    mb = {"tokens": tokens[None], "position_ids": positions[None], "segments": segments[None], "unpack": unpack,
          "cu_seqlens": cu_seqlens, "longest_segment": max(segment_lengths),
          "padding_mask": (torch.arange(padded_total) >= total)[None], **_row_tensors(batch, index, width)}
    if batch.routed_experts is not None:
        routes = batch.routed_experts
        topk = routes.shape[-1]
        tail = torch.arange(topk, dtype=routes.dtype).expand(padded_total - total, *routes.shape[2:])
        mb["routed_experts"] = torch.cat([routes[i, :n] for i, n in zip(rows, lengths.tolist())] + [tail])[None]
    return mb


def rows_view(per_position: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
    """[rows, width] per-token values of a micro-batch from the model's [b, s-1] prediction positions: the same
    tensor for padded rows, gathered out of the packed row for a packed micro-batch (differentiable)."""
    if "unpack" not in mb:
        return per_position
    return per_position[0][mb["unpack"]]


@dataclasses.dataclass
class BatchShare:
    """One DP rank's part of a step: its rollouts, how they are cut into micro-batches, and the counts of the whole
    step that normalizers and metrics need. Trainer rank 0 sends each DP rank only its share."""

    batch: TrainBatch  # this rank's rollouts, trimmed to their own longest (one masked-out row if it has none)
    rows: list[int]  # their indices in the step's batch
    plan: list[list[int]]  # the micro-batches: indices into `batch`, [] for a filler
    packed: bool  # micro-batches are packed rows (dynamic batching), else padded rows
    size: int  # rollouts in the step
    width: int  # the step's prediction positions: its longest prompt + response, minus one
    valid_tokens: int  # loss-mask tokens in the step


def split(batch: TrainBatch, batching: MicroBatching, dp: int, forward_only: bool = False) -> list[BatchShare]:
    """The step's `batch` as one share per DP rank (see `plan_fixed`, `plan_dynamic`)."""
    budget = batching.budget(forward_only)
    if budget is None:
        plan = plan_fixed(len(batch), dp, batching.micro_batch_size)
    else:
        flag = "--log-probs-max-tokens-per-gpu" if forward_only and batching.logprob_max_tokens else \
            "--max-tokens-per-gpu"
        plan = plan_dynamic(batch.seq_lengths.tolist(), dp, budget, flag)
    counts = dict(packed=budget is not None, size=len(batch), width=batch.tokens.shape[1] - 1,
                  valid_tokens=int(batch.loss_mask.sum()))
    shares = []
    for rank_plan in plan:
        rows = sorted(i for mb in rank_plan for i in mb)
        local = {row: j for j, row in enumerate(rows)}
        if rows:
            part = batch.rows(torch.tensor(rows)).trimmed()
        else:  # nothing to train on: a row for the fillers
            part = batch.rows(torch.tensor([0])).trimmed()
            part.loss_mask = torch.zeros_like(part.loss_mask)
        shares.append(BatchShare(part, rows, [[local[i] for i in mb] for mb in rank_plan], **counts))
    return shares


def microbatches(share: BatchShare, multiple: int = 1, thd: bool = False) -> list[dict[str, Any]]:
    """A share's micro-batches (on the host), each with "rows": its rollouts' indices in the step's batch.
    `multiple`: what a row's length is rounded up to (TP under sequence parallelism); `thd`: packed rows go to
    Transformer Engine's attention as THD (else to the local spec's, with a mask)."""
    build = packed_microbatch if share.packed else padded_microbatch
    extra = {"thd": thd} if share.packed else {}
    out = []
    for rows in share.plan:
        if rows:
            out.append({**build(share.batch, rows, multiple), "rows": torch.tensor([share.rows[j] for j in rows]),
                        **extra})
        else:  # a filler (a row of the share, nothing trained on) so that every rank runs as many micro-batches
            mb = build(share.batch, [0], multiple)
            out.append({**mb, "loss_mask": torch.zeros_like(mb["loss_mask"]), "rows": torch.tensor([-1]),
                        "filler": True, **extra})
    return out


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True where attention is masked (Megatron's convention): a position sees the positions
    of its own sequence up to itself."""
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(segments.shape[1], segments.shape[1], dtype=torch.bool, device=segments.device).tril()
    return ~(same & causal)[:, None]


def packed_seq_params(mb: dict[str, Any]):
    """Transformer Engine's THD view of a packed micro-batch: its segments' cumulative lengths (int32)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, longest = mb["cu_seqlens"], mb["longest_segment"]
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


class PerSequenceRotary(torch.nn.Module):
    """Megatron's rotary embedding at given positions [b, s] (restarting per packed sequence, none beyond
    `positions`): GPTModel asks its rotary module for positions 0..s-1 of every row, which a packed row on the local
    spec must not use."""

    def __init__(self, inner: torch.nn.Module, position_ids: torch.Tensor, positions: int):
        super().__init__()
        self.inner, self.position_ids, self.positions = inner, position_ids, positions

    def get_rotary_seq_len(self, *args, **kwargs):
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        emb = self.inner(self.positions)  # [positions, 1, 1, dim]
        return emb[:, 0, 0][self.position_ids].transpose(0, 1)[:, :, None]  # [s, b, 1, dim]


def _moe_padding_mask(gpt: torch.nn.Module, mb: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`padding_mask` [b, s] (True: padding) for a mixture of experts, whose routers then leave padding out of the
    load-balancing loss; none for a dense model. Megatron-Core splits it for sequence parallelism on the first
    pipeline stage only: later stages get their TP rank's part here."""
    mask = mb.get("padding_mask")
    if not gpt.config.num_moe_experts or mask is None:
        return {}
    if gpt.config.sequence_parallel and not gpt.pre_process:
        from megatron.core import parallel_state as ps

        part = mask.shape[1] // ps.get_tensor_model_parallel_world_size()
        mask = mask[:, ps.get_tensor_model_parallel_rank() * part:][:, :part]
    return {"padding_mask": mask}


def model_forward(model: torch.nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    """The model's output for one micro-batch: causal rows, or a packed row in which each sequence sees only itself
    at its own positions (THD on Transformer Engine; a block-diagonal mask and per-sequence rotary positions on the
    local spec, whose attention takes the mask it is given)."""
    gpt = model
    while not hasattr(gpt, "rotary_pos_emb"):  # DDP and other wrappers around the GPTModel
        gpt = gpt.module
    ids, extra = mb["tokens"], _moe_padding_mask(gpt, mb)
    if "segments" not in mb:
        return model(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None, **extra)
    if mb["thd"]:
        return model(ids, mb["position_ids"], None, packed_seq_params=packed_seq_params(mb), **extra)
    rotary = gpt.rotary_pos_emb
    gpt.rotary_pos_emb = PerSequenceRotary(rotary, mb["position_ids"], mb["longest_segment"])
    try:
        return model(ids, mb["position_ids"], block_causal_mask(mb["segments"]), **extra)
    finally:
        gpt.rotary_pos_emb = rotary
