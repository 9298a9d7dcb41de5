r"""Token -> sequence -> batch: the one layout and reduction rule of every klest function.

Layout. An input of shape ``[..., T]`` with at least two dimensions holds sequences: the last
dimension is tokens and every leading index is one sequence (a *row*). A 1-D input ``[N]`` holds
N independent samples (each a row with a single token). ``mask`` (True or 1 = the token counts)
has the input's shape.

Reductions, the same in :func:`klest.kl_estimate`, :func:`klest.kl_penalty`,
:func:`klest.kl_from_logits` and every other function that takes per-token input (the first
five names are verl's):

=========================  ====================================================================
``"seq-mean-token-sum"``   mean over sequences of each sequence's token sum: the sequence-level
                           KL (the default everywhere)
``"token-mean"``           sum over valid tokens / number of valid tokens
``"seq-mean-token-mean"``  mean over sequences of each sequence's token mean
``"sum"``                  sum over valid tokens
``"per-sequence"``         each sequence's token sum, shape ``[...]`` (``[N]`` for 1-D input)
``"none"``                 per-token values, shape ``[..., T]``, 0 at masked positions
=========================  ====================================================================

Trainer batches: a row with no valid token (all padding, a truncated completion that a trainer
masks out, labels all ``ignore_index``) contributes nothing: 0 under ``"none"`` and
``"per-sequence"``, and it is not counted by the means. A batch with no valid token at all gives
0, with a zero gradient. Means divide by counts clamped at 1, so none of this synchronises with
the device.
"""

from __future__ import annotations

import math
from typing import Generic, NamedTuple, TypeVar

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_choice,
    check_float_tensor,
    check_mask,
    resolve_validate,
)
from klest._types import DEFAULT_REDUCTION, Reduction
from klest.layout import Layout, PackedLayout, PaddedLayout, layout_of

__all__ = [
    "SEQUENCE_REDUCTIONS",
    "GlobalCounts",
    "KLDiagnostics",
    "WithDetails",
    "aggregate",
    "check_counts",
    "diagnostics",
    "reduce_rows",
    "sequence_shape",
]

SEQUENCE_REDUCTIONS = ("per-sequence", "seq-mean-token-sum", "sum")
"""The reductions that apply to one value per sequence (``level="sequence"``)."""


def sequence_shape(shape: torch.Size) -> torch.Size:
    """The shape of one value per row: ``shape[:-1]`` for sequences, ``shape`` for samples."""
    return shape[:-1] if len(shape) >= 2 else shape


class GlobalCounts(NamedTuple):
    r"""The normalisers of a loss computed in pieces: over data-parallel ranks and
    gradient-accumulation micro-batches.

    A mean reduction divides a piece's local sum by the count over *every* piece of the step
    instead of its own, so the pieces' losses add up to the loss of the whole batch:

    .. math:: \text{token-mean} = \frac{scale}{N_{tokens}} \sum_{\text{local tokens}} v,
              \qquad \text{seq-mean} = \frac{scale}{N_{sequences}}
              \sum_{\text{local sequences}} v_s

    and ``"sum"`` is multiplied by ``scale``. ``scale`` undoes the engine's averaging of
    gradients over ranks (its number of ranks when it averages, as DDP and FSDP do by default;
    1 when it sums): the gradients the engine combines are then the whole batch's. Build them with
    :func:`klest.distributed.global_counts`, or from counts the engine already has (verl's
    ``batch_num_tokens``, TRL's ``num_items_in_batch``, torchtitan's ``global_valid_tokens``).
    Never divide the loss by the number of micro-batches as well.

    Attributes:
      tokens: valid tokens of the whole step (a number or a 0-dim tensor).
      sequences: sequences with a valid token in the whole step.
      scale: the loss multiplier (the data-parallel world size under gradient averaging).
    """

    tokens: float | Tensor
    sequences: float | Tensor
    scale: float = 1.0


def check_counts(counts: object, reduction: str) -> None:
    """``counts`` must be a :class:`GlobalCounts`, for a scalar reduction."""
    if counts is None:
        return
    if not isinstance(counts, GlobalCounts):
        raise TypeError(
            f"counts must be a klest.GlobalCounts (klest.distributed.global_counts), got "
            f"{type(counts).__name__}"
        )
    if reduction in ("none", "per-sequence"):
        raise ValueError(
            f"counts normalise the scalar reductions; reduction={reduction!r} returns per-element "
            "values (reduce them yourself, or use 'token-mean' / 'seq-mean-token-sum' / 'sum')"
        )


def reduce_rows(
    values: Tensor,
    valid: Tensor | None,
    reduction: str,
    layout: torch.Size | Layout,
    counts: GlobalCounts | None = None,
) -> Tensor:
    """Reduce ``[rows, T]`` values whose invalid positions are already 0 (module docstring).

    ``valid`` is None when every position counts (no mask). ``layout`` is the caller's
    (:mod:`klest.layout`; a shape means padded): ``"none"`` restores it and ``"per-sequence"``
    gives one value per sequence. ``counts``: global normalisers of the mean reductions.
    """
    if not isinstance(layout, PaddedLayout | PackedLayout):
        layout = PaddedLayout(torch.Size(layout))
    if reduction == "none":
        return layout.tokens(values)
    rows, t = values.shape
    per_row = values.squeeze(-1) if t == 1 else values.sum(-1)
    if reduction == "per-sequence":
        return per_row.reshape(layout.sequences_shape)
    if reduction == "seq-mean-token-mean":
        per_row = per_row / _at_least_one(t if valid is None else valid.sum(-1))
    if counts is not None:
        if reduction == "sum":
            return values.sum() * counts.scale
        count = counts.tokens if reduction == "token-mean" else counts.sequences
        total = values.sum() if reduction == "token-mean" else per_row.sum()
        return total * counts.scale / _at_least_one_count(count, total.dtype)
    if reduction == "sum":
        return values.sum()
    if reduction == "token-mean":
        return values.sum() / _at_least_one(rows * t if valid is None else valid.sum())
    return per_row.sum() / _at_least_one(rows if valid is None else valid.any(-1).sum())


def _at_least_one_count(count: float | Tensor, dtype: torch.dtype) -> float | Tensor:
    """A global count as a divisor in the loss's dtype: at least 1 (no sync for a tensor)."""
    if isinstance(count, Tensor):
        return count.detach().to(dtype).clamp(min=1)
    return max(float(count), 1.0)


def _at_least_one(count: int | Tensor) -> int | Tensor:
    """A divisor of the means: empty counts become 1, so an empty batch gives 0 (no sync)."""
    return max(count, 1) if isinstance(count, int) else count.clamp(min=1)


def aggregate(
    values: Tensor,
    *,
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    counts: GlobalCounts | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""Reduce per-token values over tokens, sequences and the batch, by the one rule of klest.

    .. math::
        \text{seq-mean-token-sum} = \frac{1}{|\{b: n_b > 0\}|}\sum_b \sum_t m_{bt} v_{bt},
        \qquad \text{token-mean} = \frac{\sum_{b,t} m_{bt} v_{bt}}{\sum_{b,t} m_{bt}}

    with :math:`m` the mask and :math:`n_b` the valid tokens of row :math:`b`; the other
    reductions are in the table of :mod:`klest.aggregation`.

    Args:
      values: per-token values, ``[..., T]`` (rows of tokens) or ``[N]`` (independent samples).
      mask: same shape, True (or 1) where a token counts. Rows may be empty.
      reduction: see the table; default ``"seq-mean-token-sum"``.
      counts: the step's global counts (:class:`GlobalCounts`) when the batch is one piece of
        it (a data-parallel rank, a micro-batch): the means divide by them.
      cu_seqlens: packed sequences (:mod:`klest.layout`): ``values`` ``[total]`` holds them one
        after another.
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known.
      validate: check the mask holds only 0/1 (None: the global default).

    Returns:
      A scalar; ``[...]`` for ``"per-sequence"``; ``values`` with masked positions zeroed for
      ``"none"``.

    Example:
      >>> v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
      >>> m = torch.tensor([[1, 1, 1], [1, 0, 0]])
      >>> aggregate(v, mask=m)  # (6 + 4) / 2 sequences
      tensor(5.)
      >>> aggregate(v, mask=m, reduction="token-mean")  # 10 / 4 tokens
      tensor(2.5000)
    """
    check_float_tensor("values", values, what="per-token values")
    check_choice("reduction", reduction, Reduction)
    check_counts(counts, reduction)
    checks = ValueChecks(resolve_validate(validate))
    layout = layout_of(values.shape, values.device, cu_seqlens, max_seqlen, checks, name="values")
    rows = layout.rows(values)
    valid = None
    if mask is not None or cu_seqlens is not None:
        keep = torch.ones_like(values, dtype=torch.bool)
        if mask is not None:
            keep = check_mask(mask, values.shape, values.device, checks, of="values")
        valid = layout.rows(keep)
        rows = torch.where(valid, rows, torch.zeros_like(rows))
    checks.run()
    return reduce_rows(rows, valid, reduction, layout, counts)


class KLDiagnostics(NamedTuple):
    """Summary statistics of an estimate, for logging (Python numbers).

    Attributes:
      mean: mean of the units; for the mean reductions it is the returned value.
      stderr: standard error of that mean, ``std / sqrt(n_units)``, treating units as
        independent (NaN with fewer than 2 units).
      frac_negative: fraction of the valid per-token values below zero (per sequence for
        ``level="sequence"``): k1 is negative about half the time, k3 never.
      n_units: the units averaged: valid sequences for ``"seq-mean-*"`` and ``"per-sequence"``,
        valid tokens for the other reductions.
      n_empty_rows: rows (sequences, or masked samples of a 1-D input) with no valid token.
      alpha: mean control-variate coefficient over the rows, when one was used (else None).
      pareto_k: the Pareto shape k-hat of the largest ratios the value averages
        (:mod:`klest.pareto`): ``r = ref/pi`` for k3 and cv (and k1 of KL(ref||pi)), the
        importance weights off-policy, the sampled tail of top-k. Above 0.7 a batch's value is
        typically below the KL by more than ``stderr`` shows. None where the value carries no
        ratio (k1, k2, abs of KL(pi||ref) on-policy; exact values); NaN with fewer than 50
        valid ratios.
    """

    mean: float
    stderr: float
    frac_negative: float
    n_units: int
    n_empty_rows: int
    alpha: float | None = None
    pareto_k: float | None = None


def diagnostics(
    values: Tensor,
    valid: Tensor | None,
    *,
    reduction: str,
    alpha: Tensor | None = None,
    pareto_k: Tensor | None = None,
) -> KLDiagnostics:
    """Diagnostics of ``[rows, T]`` values (0 where not valid; ``valid`` None: all count); units
    follow ``reduction``; ``pareto_k``: the 0-dim k-hat of the ratios the values carry (None:
    none). One host synchronisation (all numbers are read back together).
    """
    if valid is None:
        valid = torch.ones_like(values, dtype=torch.bool)
    with torch.no_grad():
        v = values.detach().double()
        nonempty = valid.any(-1)
        if reduction in ("seq-mean-token-sum", "per-sequence"):
            units, counted = v.sum(-1), nonempty
        elif reduction == "seq-mean-token-mean":
            units, counted = v.sum(-1) / valid.sum(-1).clamp(min=1), nonempty
        else:
            units, counted = v, valid
        n = counted.sum().double()
        mean = torch.where(counted, units, 0.0).sum() / n.clamp(min=1)
        var = torch.where(counted, (units - mean) ** 2, 0.0).sum() / (n - 1).clamp(min=1)
        stderr = torch.where(n > 1, (var / n.clamp(min=1)).sqrt(), math.nan)
        frac_negative = (valid & (v < 0)).sum().double() / valid.sum().clamp(min=1).double()
        coef = math.nan if alpha is None else alpha.detach().double().mean()
        k_hat = math.nan if pareto_k is None else pareto_k.detach().double()
        numbers = torch.stack(
            [
                mean,
                stderr,
                frac_negative.double(),
                n,
                (~nonempty).sum().double(),
                torch.as_tensor(coef, dtype=torch.float64, device=v.device),
                torch.as_tensor(k_hat, dtype=torch.float64, device=v.device),
            ]
        ).tolist()
    return KLDiagnostics(
        mean=numbers[0],
        stderr=numbers[1],
        frac_negative=numbers[2],
        n_units=int(numbers[3]),
        n_empty_rows=int(numbers[4]),
        alpha=None if alpha is None else numbers[5],
        pareto_k=None if pareto_k is None else numbers[6],
    )


D = TypeVar("D")


class WithDetails(NamedTuple, Generic[D]):
    """What every klest function returns with ``return_details=True``: ``(value, details)``.

    ``value`` is what the call returns without the flag; ``details`` is the function's own
    details type, and every one of them has a ``diagnostics`` (:class:`KLDiagnostics`).
    """

    value: Tensor
    details: D
