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
