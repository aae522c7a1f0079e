"""Argument checks shared by the algorithm functions: every error names the offending argument."""

from __future__ import annotations

import contextlib
import contextvars

import torch

# The non-finite counts that `finite_where` appends to instead of checking, inside `deferred_finite_checks`.
_deferred: contextvars.ContextVar[list[tuple[str, torch.Tensor]] | None] = contextvars.ContextVar(
    "deferred_finite_checks", default=None)


def float_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {type(x).__name__}"
                         f"{'' if not isinstance(x, torch.Tensor) else ' of dtype ' + str(x.dtype)}")
    return x


def bool_mask(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bool:
        raise ValueError(f"{name} must be a torch.bool tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x


def same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, x in others.items():
        if tuple(x.shape) != tuple(reference.shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)} but {reference_name} has shape "
                             f"{tuple(reference.shape)}")


def finite_where(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask
    deferred = _deferred.get()
    if deferred is not None:
        deferred.append((name, bad.sum()))
    elif bad.any():
        raise_nonfinite(name, int(bad.sum()))


def raise_nonfinite(name: str, count: int) -> None:
    raise ValueError(f"{name} has {count} non-finite value(s) where it is used")


@contextlib.contextmanager
def deferred_finite_checks():
    """Inside, `finite_where` does not read its verdict from the tensor's device (a host synchronization on a GPU):
    it appends (name, count of non-finite values, a tensor) to the list this yields, for the caller to read with its
    other results and pass to `raise_nonfinite` where a count is not 0."""
    counts: list[tuple[str, torch.Tensor]] = []
    token = _deferred.set(counts)
    try:
        yield counts
    finally:
        _deferred.reset(token)


def token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages [B] broadcast to tokens [B, T]; per-token [B, T] pass through."""
    float_tensor("advantages", advantages)
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(-1).expand_as(like)
    if tuple(advantages.shape) == tuple(like.shape):
        return advantages
    raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected ({like.shape[0]},) or "
                     f"{tuple(like.shape)}")


def require(ok: bool, name: str, value, condition: str) -> None:
    """Refuse a parameter outside its range, naming it (an argument or a flag) and the range."""
    if not ok:
        raise ValueError(f"{name} must be {condition}, got {value!r}")


def loss_inputs(logprobs, behavior_logprobs, advantages, loss_mask, proximal_logprobs=None) -> torch.Tensor:
    """The tensors of a policy loss: float [B, T] log-probs (the policy's, the behavior policy's and, if given,
    the proximal policy's), a bool [B, T] mask, advantages [B] or [B, T], finite wherever the mask is set.
    Returns the advantages per token [B, T]."""
    float_tensor("logprobs", logprobs)
    float_tensor("behavior_logprobs", behavior_logprobs)
    bool_mask("loss_mask", loss_mask)
    same_shape("logprobs", logprobs, behavior_logprobs=behavior_logprobs, loss_mask=loss_mask)
    advantages = token_advantages(advantages, logprobs)
    finite_where("advantages", advantages, loss_mask)
    finite_where("behavior_logprobs", behavior_logprobs, loss_mask)
    if proximal_logprobs is not None:
        float_tensor("proximal_logprobs", proximal_logprobs)
        same_shape("logprobs", logprobs, proximal_logprobs=proximal_logprobs)
        finite_where("proximal_logprobs", proximal_logprobs, loss_mask)
    return advantages
