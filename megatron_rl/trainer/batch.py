"""The trainer's input: scored rollouts as right-padded tensors, with their lengths and advantages."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from megatron_rl.algorithms import compute_advantages, kl_reward_penalty


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
    ref_logprobs: torch.Tensor | None = None  # [N, L-1] the reference policy's log-probs, for the KL penalty
    # [N, L, num_layers, topk] int16: the experts the generator routed each token to (rollout routing replay)
    routed_experts: torch.Tensor | None = None
    lengths: torch.Tensor | None = None  # [N] long: prompt + response tokens of each row (None: the full width)

    @property
    def seq_lengths(self) -> torch.Tensor:
        """[N] real tokens of each row."""
        if self.lengths is not None:
            return self.lengths
        return torch.full((len(self),), self.tokens.shape[1], dtype=torch.long)

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       behavior_logprobs: Sequence[Sequence[float]], advantages: Sequence[float],
                       response_masks: Sequence[Sequence[bool]] | None = None, pad_id: int = 0,
                       pad_to_multiple_of: int = 1) -> TrainBatch:
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
        return cls(tokens, mask, blp, torch.tensor(advantages, dtype=torch.float32),
                   lengths=prompt_len + response_len)

    def with_routes(self, routes: Sequence[torch.Tensor | Sequence], lengths: Sequence[int]) -> TrainBatch:
        """This batch with each row's recorded routes: `routes[i]` is [positions, layers, topk] expert ids for
        row i's prompt and response tokens, `lengths[i]` their number; a generator may leave out the last sampled
        token, which it never ran through the model. Positions without a route (that last token, padding) get
        experts 0..topk-1: they are causally after every position a loss is computed at, so they change no
        trained log-prob. A row of length 0 takes no routes (a rollout that trains nothing, see `from_groups`)."""
        if len(routes) != len(self) or len(lengths) != len(self):
            raise ValueError(f"routed experts for {len(routes)} rollouts ({len(lengths)} lengths), the batch has "
                             f"{len(self)}")
        tensors = []
        for i, (r, n) in enumerate(zip(routes, lengths)):
            if r is None:
                raise ValueError(f"--use-rollout-routing-replay: rollout {i} of the batch carries no routed experts "
                                 "(a generator that does not record them, or a checkpoint from a run without the "
                                 "flag)")
            if n and len(r) not in (n - 1, n):
                raise ValueError(f"--use-rollout-routing-replay: rollout {i} has routes for {len(r)} positions, "
                                 f"its prompt and response have {n}")
            tensors.append(torch.as_tensor(r, dtype=torch.int16) if n else None)
        shapes = {tuple(t.shape[1:]) for t in tensors if t is not None}
        if len(shapes) != 1:
            raise ValueError(f"--use-rollout-routing-replay: the batch's routes have (layers, topk) {sorted(shapes)}")
        (num_layers, topk), = shapes
        n, length = self.tokens.shape
        out = torch.arange(topk, dtype=torch.int16).expand(n, length, num_layers, topk).clone()
        for i, t in enumerate(tensors):
            if t is not None:
                out[i, :len(t)] = t
        return dataclasses.replace(self, routed_experts=out)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: slice | torch.Tensor) -> TrainBatch:
        def take(t):
            return None if t is None else t[index]
        return TrainBatch(self.tokens[index], self.loss_mask[index], self.behavior_logprobs[index],
                          self.advantages[index], take(self.ref_logprobs), take(self.routed_experts),
                          take(self.lengths))

    def trimmed(self) -> TrainBatch:
        """The same rows cut to their own longest prompt + response (the padding beyond it dropped)."""
        length = int(self.seq_lengths.max()) if len(self) else 0
        if length >= self.tokens.shape[1]:
            return self

        def cut(t, n):
            return None if t is None else t[:, :n]
        return TrainBatch(cut(self.tokens, length), cut(self.loss_mask, length - 1),
                          cut(self.behavior_logprobs, length - 1), self.advantages, cut(self.ref_logprobs, length - 1),
                          cut(self.routed_experts, length), self.lengths)

    def padded(self, multiple: int) -> TrainBatch:
        """The same batch right-padded to a sequence length that is a multiple of `multiple` (padding is masked)."""
        extra = -self.tokens.shape[1] % multiple
        if not extra:
            return self

        def pad(t):
            return None if t is None else torch.nn.functional.pad(t, (0, extra))

        routes = self.routed_experts
        if routes is not None:  # padding positions route to experts 0..topk-1 (see with_routes)
            n, _, layers, topk = routes.shape
            routes = torch.cat([routes, torch.arange(topk, dtype=routes.dtype).expand(n, extra, layers, topk)], 1)
        return TrainBatch(pad(self.tokens), pad(self.loss_mask), pad(self.behavior_logprobs), self.advantages,
                          pad(self.ref_logprobs), routes, self.lengths)

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch on `device` (the trainer's): every tensor moved, none copied when already there."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)
        return TrainBatch(move(self.tokens), move(self.loss_mask), move(self.behavior_logprobs),
                          move(self.advantages), move(self.ref_logprobs), move(self.routed_experts),
                          move(self.lengths))

    @classmethod
    def from_groups(cls, groups: list[list], advantage_estimator: str, mask_truncated: bool = False,
                    reference: Callable[[TrainBatch], torch.Tensor] | None = None, kl_coef: float = 0.0,
                    kl_estimator: str = "k1", routing_replay: bool = False) -> TrainBatch:
        """Buffer groups (lists of `buffer.Rollout`, one list per prompt) with advantages within each group.

        `mask_truncated` (--mask-truncated): a rollout cut off by the length limit (finish_reason "length") keeps
        its reward in its group's baseline but gets an all-False loss mask: it carries no gradient.

        The KL in the reward (--use-kl-in-reward): `reference(batch)` gives the reference log-probs of the packed
        rollouts ([N, L-1], kept as the batch's `ref_logprobs`), and each reward is reduced by `kl_coef` x the
        rollout's per-token KL summed over its response (`kl_reward_penalty`, with the behavior log-probs: the
        policy that sampled it) before the advantages, as verl's `apply_kl_penalty` does.

        `routing_replay` (--use-rollout-routing-replay): the batch carries each rollout's recorded routes; an aborted
        rollout whose routes stop short carries no gradient."""
        rollouts = [r for g in groups for r in g]
        rewards = torch.tensor([r.reward.reward for r in rollouts], dtype=torch.float32)
        group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g])
        outputs = [r.output for r in rollouts]
        truncated = [mask_truncated and o.finish_reason == "length" for o in outputs]
        masks = None if all(o.loss_mask is None for o in outputs) and not any(truncated) else \
            [[False] * len(o.token_ids) if cut else o.loss_mask or [True] * len(o.token_ids)
             for o, cut in zip(outputs, truncated)]
        batch = cls.from_sequences([o.prompt_token_ids for o in outputs], [o.token_ids for o in outputs],
                                   [o.logprobs for o in outputs], [0.0] * len(rollouts), masks)
        if routing_replay:
            lengths = [len(o.prompt_token_ids) + len(o.token_ids) for o in outputs]
            # An aborted request may stop before its routes cover it: it keeps its reward in its group's baseline
            # but trains nothing (its positions would otherwise run through experts it was never routed to).
            unrouted = [o.finish_reason == "abort" and (o.routed_experts is None or len(o.routed_experts) < n - 1)
                        for o, n in zip(outputs, lengths)]
            if any(unrouted):
                batch.loss_mask[torch.tensor(unrouted)] = False
            batch = batch.with_routes([[] if cut else o.routed_experts for o, cut in zip(outputs, unrouted)],
                                      [0 if cut else n for n, cut in zip(lengths, unrouted)])
        if reference is not None:
            batch.ref_logprobs = reference(batch)
            rewards = rewards - kl_reward_penalty(batch.behavior_logprobs, batch.ref_logprobs, batch.loss_mask,
                                                  kl_coef, kl_estimator)
        batch.advantages = compute_advantages(rewards, group_ids, advantage_estimator)
        return batch
