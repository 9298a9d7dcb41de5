"""Token -> sequence -> batch aggregation with masks, and the diagnostics of an estimate.

Layout convention, used by every klest function that takes per-token values:

- an input of shape ``[..., T]`` with ``ndim >= 2`` holds sequences: the last dim is tokens and
  every leading index is one sequence (a *row*);
- a 1-D input ``[N]`` holds N independent samples (each a row with a single token).

Reductions (the names verl users know):

========================  ==================================================================
``"none"``                per-token values, masked positions set to 0
``"token-mean"``          sum of valid values / number of valid tokens
``"seq-mean-token-sum"``  mean over rows of the per-row sum: the sequence-level KL estimate
``"seq-mean-token-mean"`` mean over rows of the per-row mean
``"sum"``                 sum of all valid values
========================  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klest._checks import check_choice, check_float_tensor, check_mask, check_rows_not_empty

REDUCTIONS = ("none", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "sum")


def as_rows(x: Tensor) -> Tensor:
    """View ``x`` as ``[rows, T]`` under the layout convention (1-D -> ``[N, 1]``)."""
    return x.reshape(-1, 1) if x.ndim <= 1 else x.reshape(-1, x.shape[-1])


def reduce_rows(values: Tensor, valid: Tensor, reduction: str, shape: torch.Size) -> Tensor:
    """Reduce ``[rows, T]`` values whose masked positions are already 0.

    ``shape`` is the caller's original shape, restored for ``reduction="none"``.
    """
    if reduction == "none":
        return values.reshape(shape)
    if reduction == "sum":
        return values.sum()
    if reduction == "token-mean":
        return values.sum() / valid.sum()
    per_row = values.sum(-1)
    if reduction == "seq-mean-token-mean":
        per_row = per_row / valid.sum(-1)
    return per_row.mean()


def aggregate(
    values: Tensor, *, mask: Tensor | None = None, reduction: str = "token-mean"
) -> Tensor:
    """Aggregate per-token values over tokens, sequences and the batch.

    Args:
      values: per-token values, ``[..., T]`` (rows of tokens) or ``[N]`` (independent samples).
      mask: same shape, True (or 1) where a token counts; every row must keep a token.
      reduction: one of ``"none"``, ``"token-mean"``, ``"seq-mean-token-sum"``,
        ``"seq-mean-token-mean"``, ``"sum"`` (see the module docstring).

    Returns:
      A scalar, or ``values`` with masked positions zeroed for ``reduction="none"``.
    """
    check_float_tensor("values", values)
    check_choice("reduction", reduction, REDUCTIONS)
    rows = as_rows(values)
    if mask is None:
        valid = torch.ones_like(rows, dtype=torch.bool)
    else:
        valid = as_rows(check_mask(mask, values.shape, values.device))
        check_rows_not_empty(valid, sequences=values.ndim >= 2)
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    return reduce_rows(rows, valid, reduction, values.shape)


@dataclass(frozen=True)
class KLDiagnostics:
    """Summary statistics of an estimate, for logging.

    Attributes:
      mean: mean of the per-unit estimates (the estimate for the mean reductions).
      stderr: standard error of that mean, ``std / sqrt(n_units)``, treating units as independent.
      frac_negative: fraction of valid per-token values below zero (k1 is negative about half
        the time; k3 never is).
      n_units: number of units: rows (sequences) for the ``seq-*`` reductions and for
        ``level="sequence"``, valid tokens otherwise.
      alpha: mean fitted control-variate coefficient, when one was fitted.
    """

    mean: float
    stderr: float
    frac_negative: float
    n_units: int
    alpha: float | None = None


def diagnostics(
    values: Tensor, valid: Tensor, *, reduction: str, alpha: Tensor | None = None
) -> KLDiagnostics:
    """Diagnostics of ``[rows, T]`` values (masked positions 0); units follow ``reduction``."""
    with torch.no_grad():
        v = values.detach().double()
        if reduction == "seq-mean-token-sum":
            units = v.sum(-1)
        elif reduction == "seq-mean-token-mean":
            units = v.sum(-1) / valid.sum(-1)
        else:
            units = v[valid]
        n = units.numel()
        std = units.std() if n > 1 else torch.tensor(float("nan"))
        return KLDiagnostics(
            mean=float(units.mean()),
            stderr=float(std / n**0.5),
            frac_negative=float((v[valid] < 0).double().mean()),
            n_units=n,
            alpha=None if alpha is None else float(alpha.double().mean()),
        )
