"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary, in bounded memory.

Each TP rank holds logits for its vocabulary slice [b, s, V_pad / TP]. Softmax statistics are combined
with two all-reduces over the TP group (max, then the sums of exp), as in Megatron's vocab-parallel cross
entropy. Megatron pads the vocabulary; padded entries are masked to -inf here so that the distribution is
exactly the model's over its true vocabulary (the generator never samples them).

The logits are read `CHUNK_TOKENS` positions at a time, forward and backward: no fp32 copy of the whole logits
is made, and nothing logits-sized is saved for the backward but the logits themselves, which the backward reads
again to recompute the softmax of each chunk; the trainer's form (`next_token_logprobs_and_entropy`) then writes
the gradient into the logits' own storage. At 8k positions x 32k vocabulary that is three fp32 temporaries of
one chunk (0.1 GiB at 256 positions) instead of four of the whole [8k, 32k] (4 GiB) and a gradient.
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 256  # positions of the logits read at once


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, start: int | None = None) -> torch.Tensor:
    """Set logits of padded vocabulary entries (global index >= vocab_size) to -inf; `start` is the global index of
    this slice's first entry (default: this TP rank's)."""
    local = logits.shape[-1]
    start = _tp()[1] * local if start is None else start
    if start + local <= vocab_size:
        return logits
    index = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(index >= vocab_size, float("-inf"))


def _scaled(logits: torch.Tensor, vocab_size: int, temperature: float, start: int) -> torch.Tensor:
    """fp32 logits / temperature of one chunk, padded vocabulary entries at -inf."""
    return mask_padded_vocab(logits.float() / temperature, vocab_size, start)


def _chunks(b: int, s: int, chunk_tokens: int):
    for i in range(b):
        for t in range(0, s, chunk_tokens):
            yield i, slice(t, min(t + chunk_tokens, s))


class _VocabParallelLogProbs(torch.autograd.Function):
    """(log-probs of the targets, entropy) [b, s] from this rank's [b, s, V_pad / TP] logits. Both outputs are the
    same on every TP rank; each rank's gradient is that of its own vocabulary slice, recomputed chunk by chunk:
    d logp / d x = onehot - p and d H / d x = -p (x - E_p[x]) for x = logits / temperature."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, temperature, chunk_tokens, group, rank, inplace_backward):
        ctx.set_materialize_grads(False)
        b, s, local = logits.shape
        start = rank * local
        shift = torch.empty((b, s), dtype=torch.float32, device=logits.device)
        for i, t in _chunks(b, s, chunk_tokens):  # the max needs no gradient: logsumexp's does not depend on it
            shift[i, t] = _scaled(logits[i, t], vocab_size, temperature, start).max(-1).values
        torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
        in_range = (targets >= start) & (targets < start + local)
        local_index = torch.where(in_range, targets - start, torch.zeros_like(targets))
        sums = torch.zeros((3, b, s), dtype=torch.float32, device=logits.device)  # sum exp, sum exp * x, target x
        for i, t in _chunks(b, s, chunk_tokens):
            x = _scaled(logits[i, t], vocab_size, temperature, start)
            finite = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
            exp = torch.exp(x - shift[i, t, None])
            sums[0, i, t], sums[1, i, t] = exp.sum(-1), (exp * finite).sum(-1)
            picked = finite.gather(-1, local_index[i, t, None]).squeeze(-1)
            sums[2, i, t] = torch.where(in_range[i, t], picked, torch.zeros_like(picked))
        torch.distributed.all_reduce(sums, group=group)
        logsumexp = shift + torch.log(sums[0])
        mean_x = sums[1] / sums[0]
        ctx.save_for_backward(logits, local_index, in_range, logsumexp, mean_x)
        ctx.args = vocab_size, temperature, chunk_tokens, start, inplace_backward
        return sums[2] - logsumexp, logsumexp - mean_x

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_index, in_range, logsumexp, mean_x = ctx.saved_tensors
        vocab_size, temperature, chunk_tokens, start, inplace_backward = ctx.args
        # in place: each chunk's logits are read for the last time just before their gradient replaces them
        grad = logits if inplace_backward else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        b, s, _ = logits.shape
        for i, t in _chunks(b, s, chunk_tokens):
            x = _scaled(logits[i, t], vocab_size, temperature, start)
            p = torch.exp(x - logsumexp[i, t, None])
            g = torch.zeros_like(x)
            if grad_logprobs is not None:
                g_lp = grad_logprobs[i, t]
                g -= p * g_lp[:, None]
                g.scatter_add_(-1, local_index[i, t, None], torch.where(in_range[i, t], g_lp, 0)[:, None])
            if grad_entropy is not None:
                finite = torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
                g -= grad_entropy[i, t, None] * p * (finite - mean_x[i, t, None])
            grad[i, t] = g / temperature
        return grad, None, None, None, None, None, None, None


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                               temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS,
                               inplace_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and the entropy of softmax(logits / temperature) over the true vocabulary.

    logits [b, s, V_pad / TP] (this rank's vocabulary slice, any float dtype), targets [b, s] global token ids.
    Both outputs are [b, s] fp32 and differentiable; the entropy's gradient is computed only when something
    differentiates it. Temperature divides the logits before the softmax, exactly as the generator did when it
    sampled: the behavior log-probs the generator reports are in this convention (after temperature, before
    top-k/top-p truncation). `chunk_tokens` positions are read at a time (see the module docstring).
    `inplace_backward`: the backward writes the gradient into the logits' storage (`next_token_logprobs_and_entropy`).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    group, rank = _tp()
    return _VocabParallelLogProbs.apply(logits, targets, vocab_size, temperature, chunk_tokens, group, rank,
                                        inplace_backward)


def next_token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int,
                                    temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs_and_entropy` of each position's next token, [b, s-1], from a model's whole [b, s, V_pad / TP]
    logits, whose storage the backward reuses for their gradient (as Megatron's fused cross entropy does): no
    logits-sized tensor is allocated at all. The logits must not be read again after the backward; another
    autograd use of them would raise (their version changed)."""
    targets = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)  # the last position has no next token: its result is cut
    logprobs, entropy = token_logprobs_and_entropy(logits, targets, vocab_size, temperature, chunk_tokens,
                                                   inplace_backward=logits.requires_grad)
    return logprobs[:, :-1], entropy[:, :-1]
