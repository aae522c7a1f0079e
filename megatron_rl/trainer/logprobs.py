"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its vocabulary slice [b, s, V_pad / TP]. Softmax statistics are combined
with two all-reduces over the TP group (max, then sum of exp), as in Megatron's vocab-parallel cross
entropy. Megatron pads the vocabulary; padded entries are masked to -inf here so that the distribution is
exactly the model's over its true vocabulary (the generator never samples them).
"""

from __future__ import annotations

import torch


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Set logits of padded vocabulary entries (global index >= vocab_size) to -inf."""
    _, rank = _tp()
    local = logits.shape[-1]
    start = rank * local
    if start + local <= vocab_size:
        return logits
    index = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(index >= vocab_size, float("-inf"))


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and the entropy of softmax(logits / temperature) over the true vocabulary.

    logits [b, s, V_pad / TP] (this rank's vocabulary slice), targets [b, s] global token ids. Both outputs
    are [b, s] and differentiable. Temperature divides the logits before the softmax, exactly as the
    generator did when it sampled: the behavior log-probs the generator reports are in this convention
    (after temperature, before top-k/top-p truncation).
    """
    # Forward: sum over TP ranks. Backward: identity, since every TP rank holds the same (replicated) loss.
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as all_reduce

    group, rank = _tp()
    x = mask_padded_vocab(logits.float() / temperature, vocab_size)
    local = x.shape[-1]
    start = rank * local

    # Global max (no gradient needed: logsumexp's gradient does not depend on the shift).
    shift = x.detach().max(dim=-1, keepdim=True).values
    torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
    exp = torch.exp(x - shift)
    finite_x = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))
    sum_exp = all_reduce(exp.sum(-1))
    sum_exp_x = all_reduce((exp * finite_x).sum(-1))
    logsumexp = shift.squeeze(-1) + torch.log(sum_exp)

    in_range = (targets >= start) & (targets < start + local)
    local_index = torch.where(in_range, targets - start, torch.zeros_like(targets))
    picked = torch.gather(finite_x, -1, local_index.unsqueeze(-1)).squeeze(-1)
    target_logit = all_reduce(torch.where(in_range, picked, torch.zeros_like(picked)))

    logprobs = target_logit - logsumexp
    entropy = logsumexp - sum_exp_x / sum_exp
    return logprobs, entropy
