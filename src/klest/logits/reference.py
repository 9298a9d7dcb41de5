r"""Exact KL between categorical distributions given by logits or log-probabilities.

Plain PyTorch over the full last dimension: right for small vocabularies and as the slow,
obviously correct reference that the faster paths are tested against. It materializes a few
``[..., V]`` tensors; the memory-bounded large-vocabulary path is :func:`klest.kl_from_logits`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_direction,
    check_logits_pair,
    check_mask,
    check_rows_have_distributions,
    compute_dtype,
    resolve_validate,
)
from klest._types import DEFAULT_REDUCTION, Direction, Reduction
from klest.aggregation import aggregate

__all__ = ["categorical_kl"]


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
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    validate: bool | None = None,
) -> Tensor:
    r"""Exact KL between categorical distributions ``softmax(logits)`` and ``softmax(logits_ref)``.

    .. math::
        KL(\pi\|ref) = \sum_v \pi_v (\log \pi_v - \log ref_v), \quad
        \pi = \mathrm{softmax}(z), \; ref = \mathrm{softmax}(y)

    and :math:`KL(ref\|\pi)` for ``direction="ref||pi"``. No sampling: the exact value (the
    Rao-Blackwellized per-position term, when positions lie along sampled sequences). Gradients
    flow to both inputs by autodiff:
    :math:`\partial KL(\pi\|ref)/\partial z = \pi \odot (\log\pi - \log ref - KL)` and
    :math:`\partial/\partial y = ref - \pi`.

    Entries equal to ``-inf`` are outside the support (``0 log 0 = 0``); mass of the first
    distribution where the second has none gives ``+inf``. For large vocabularies use
    :func:`klest.kl_from_logits`, which never holds ``[..., V]`` float32 intermediates.

    Args:
      logits: pi's logits (or log-probs), ``[..., V]``, any float dtype (computed in >= fp32).
      logits_ref: ref's logits, same shape.
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      mask: ``[...]`` bool or 0/1: positions to keep (others give 0 and are not checked).
      reduction: over the per-position KLs ``[...]`` by the rule of :mod:`klest.aggregation`
        (default ``"seq-mean-token-sum"``; ``"none"`` keeps ``[...]``).
      validate: check for rows with NaN / ``+inf`` entries or no finite entry (None: the global
        default).

    Returns:
      The reduced KL (per position ``[...]`` for ``reduction="none"``).

    Example:
      >>> z = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]])
      >>> categorical_kl(z, torch.zeros(2, 3), reduction="none")  # the uniform row gives 0
      tensor([0.2662, 0.0000])
    """
    check_direction(direction)
    logits, logits_ref = check_logits_pair(logits, logits_ref)
    checks = ValueChecks(resolve_validate(validate))
    keep = (
        None
        if mask is None
        else check_mask(mask, logits.shape[:-1], logits.device, checks, of="the positions")
    )
    dtype = compute_dtype(logits, logits_ref)
    z, y = logits.to(dtype), logits_ref.to(dtype)
    if keep is not None:
        # Masked rows become uniform: finite, and their (zeroed) value passes no gradient.
        z = torch.where(keep.unsqueeze(-1), z, torch.zeros_like(z))
        y = torch.where(keep.unsqueeze(-1), y, torch.zeros_like(y))
    with torch.no_grad():
        check_rows_have_distributions(z.logsumexp(-1), y.logsumexp(-1), keep, checks)
    checks.run()
    log_pi = torch.log_softmax(z, dim=-1)
    log_ref = torch.log_softmax(y, dim=-1)
    kl = _plogq_diff(log_pi, log_ref) if direction == "pi||ref" else _plogq_diff(log_ref, log_pi)
    return aggregate(kl, mask=keep, reduction=reduction, validate=False)
