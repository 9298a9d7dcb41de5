r"""Exact KL between categorical distributions given by logits or log-probabilities.

Plain PyTorch over the full last dimension: right for small vocabularies and as the slow,
obviously correct reference that faster paths are tested against. It materializes a few
``[..., V]`` tensors; the memory-bounded large-vocabulary path is :mod:`klest.logits.from_logits`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klest._checks import check_direction, check_float_tensor, check_mask, compute_dtype
from klest.aggregation import aggregate


def _check_logits(name: str, z: Tensor, keep: Tensor | None) -> None:
    """Reject NaN / +inf entries and all -inf rows among the kept positions."""
    with torch.no_grad():
        bad = (torch.isnan(z) | (z == float("inf"))).any(-1)
        dead = (z == float("-inf")).all(-1)
        for flags, what in ((bad, "NaN or +inf entries"), (dead, "all entries -inf")):
            flags = flags if keep is None else flags & keep
            if bool(flags.any()):
                raise ValueError(
                    f"{name} has {int(flags.sum())} row(s) with {what} (first at index "
                    f"{tuple(flags.nonzero()[0].tolist())}); mask such rows out"
                )


def _plogq_diff(logq: Tensor, logp: Tensor) -> Tensor:
    """Sum over the last dim of ``q (log q - log p)`` with ``0 log 0 = 0``."""
    q = logq.exp()
    support = q > 0
    diff = torch.where(support, logq - logp, torch.zeros_like(logq))
    return (q * diff).sum(-1)


def categorical_kl(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    direction: str = "pi||ref",
    mask: Tensor | None = None,
    reduction: str = "none",
) -> Tensor:
    r"""Exact KL between categorical distributions ``softmax(logits)`` and ``softmax(logits_ref)``.

    .. math::
        KL(\pi\|ref) = \sum_v \pi_v (\log \pi_v - \log ref_v), \quad
        \pi = \mathrm{softmax}(z), \; ref = \mathrm{softmax}(y)

    and :math:`KL(ref\|\pi)` for ``direction="ref||pi"``. No sampling: this is the exact value
    (the Rao-Blackwellized per-position term of seed 003). Gradients flow to both inputs by
    autodiff: :math:`\partial KL(\pi\|ref)/\partial z = \pi \odot (\log\pi - \log ref - KL)` and
    :math:`\partial/\partial y = ref - \pi` (DESIGN.md section 3).

    Entries equal to ``-inf`` are outside the support (``0 log 0 = 0``); mass of the first
    distribution where the second has none gives ``+inf``.

    Args:
      logits: pi's logits (or log-probs), ``[..., V]``, any float dtype (computed in >= fp32).
      logits_ref: ref's logits, same shape.
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      mask: ``[...]`` bool or 0/1: positions to keep (others give 0 and are not checked).
      reduction: as in :func:`klest.aggregate`, over the per-position KLs ``[...]``.

    Returns:
      Per-position KL ``[...]`` for ``reduction="none"``, else a scalar.
    """
    check_direction(direction)
    check_float_tensor("logits", logits)
    check_float_tensor("logits_ref", logits_ref)
    if logits.shape != logits_ref.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)} but logits_ref has shape "
            f"{tuple(logits_ref.shape)}; they must match (same vocabulary size V)"
        )
    keep = None if mask is None else check_mask(mask, logits.shape[:-1], logits.device)
    _check_logits("logits", logits, keep)
    _check_logits("logits_ref", logits_ref, keep)
    dtype = compute_dtype(logits, logits_ref)
    z, y = logits.to(dtype), logits_ref.to(dtype)
    if keep is not None:
        # Masked rows become uniform: finite, and their (zeroed) value passes no gradient.
        z = torch.where(keep.unsqueeze(-1), z, torch.zeros_like(z))
        y = torch.where(keep.unsqueeze(-1), y, torch.zeros_like(y))
    log_pi = torch.log_softmax(z, dim=-1)
    log_ref = torch.log_softmax(y, dim=-1)
    kl = _plogq_diff(log_pi, log_ref) if direction == "pi||ref" else _plogq_diff(log_ref, log_pi)
    return aggregate(kl, mask=mask, reduction=reduction)
