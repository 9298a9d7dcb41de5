"""What the exact-from-logits front ends share: the positions of a call, its plan, its result.

:func:`kl_from_logits`, :func:`kl_from_hidden`, :func:`kl_from_logits_vocab_parallel` and the
divergences all take positions ``[...]`` with a mask, labels and a reduction, reduce them to rows
of a ``[N, V]`` problem (:func:`positions`), run an autograd Function over those rows, and shape
its six per-row outputs (``OUTPUTS``) into the public result (:func:`finish`).

A Function that writes the gradient in the forward pass needs, before it runs, the upstream
gradient each row's value will get: :func:`value_coefficients` gives it, by differentiating
the very reduction :func:`finish` applies (the backward then finds ``g == c`` bit for bit when
the loss reaches it with 1, and does nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_choice,
    check_direction,
    check_flag,
    check_labels,
    check_mask,
    check_positive_int,
)
from klest._types import Backend, Reduction
from klest.aggregation import (
    GlobalCounts,
    KLDiagnostics,
    WithDetails,
    check_counts,
    diagnostics,
    reduce_rows,
)
from klest.layout import Layout, PaddedLayout, layout_of
from klest.logits._rows import chunk_rows, resolve_backend, workspace_bytes_per_row
from klest.logits._stats import Grads, KLRowStats

OUTPUTS = ("value", "kl_pi_ref", "kl_ref_pi", "entropy", "logp_label", "logp_ref_label")
"""The six per-row outputs of the autograd Functions, in order: ``value`` is what the call
reduces (the divergence, plus ``ce_weight`` times the label's cross-entropy), 0 on rows not
kept; the others are the statistics of :class:`~klest.logits.KLRowStats` (0 where not
computed)."""
SCALAR_REDUCTIONS = ("seq-mean-token-sum", "token-mean", "seq-mean-token-mean", "sum")


class LogitsDetails(NamedTuple):
    """What the exact-from-logits functions report besides the KL (``return_details=True``).

    Attributes:
      logp: ``log pi(label)`` per position ``[...]`` (0 where masked), or None without labels.
      logp_ref: ``log ref(label)`` per position, or None without labels.
      entropy: ``H(pi)`` per position ``[...]`` (0 where masked).
      diagnostics: mean, standard error and counts of the per-position KLs under the call's
        reduction.
    """

    logp: Tensor | None
    logp_ref: Tensor | None
    entropy: Tensor
    diagnostics: KLDiagnostics


@dataclass(frozen=True)
class Positions:
    """The positions of one call: their shape, labels, which count, and what is returned.

    ``keep`` is the boolean ``[...]`` mask of the positions that count (None: all of them);
    :attr:`rows` are their flat indices, found on the host when a path first asks for them (the
    Triton kernels take flags instead and skip the others without a host read: :meth:`selection`).
    """

    lead: torch.Size
    labels: Tensor | None
    keep: Tensor | None
    direction: str
    reduction: str
    details: bool
    layout: Layout | None = None  # None: padded, ``lead``
    counts: GlobalCounts | None = None
    scale: float | Tensor | None = None  # the result's multiplier; None: 1, not given
    ce_weight: float = 0.0  # the label cross-entropy's weight in the value

    @property
    def scalar(self) -> bool:
        """Whether the call returns one number (a reduction over every position)."""
        return self.reduction in SCALAR_REDUCTIONS

    def selection(self, backend: str) -> tuple[Tensor | None, Tensor | None]:
        """``(rows, flags)`` for a row engine: the Triton kernels take one bool flag per row of
        the ``[N, V]`` problem and skip the others without a host read (``(None, flags)``); the
        PyTorch engine gathers the kept rows by index (``(rows, None)``). None: every row."""
        if backend == "triton":
            return None, None if self.keep is None else self.keep.reshape(-1)
        return self.rows, None

    @functools.cached_property
    def rows(self) -> Tensor | None:
        """The flat indices of the kept positions, None when every one is kept (one host read,
        the first time)."""
        if self.keep is None:
            return None
        rows = self.keep.reshape(-1).nonzero().view(-1)
        return None if rows.numel() == self.keep.numel() else rows


def positions(
    lead: torch.Size,
    device: torch.device,
    *,
    direction: str,
    reduction: str,
    mask: Tensor | None,
    labels: Tensor | None,
    vocab_size: int,
    ignore_index: int,
    details: bool,
    checks: ValueChecks,
) -> Positions:
    """Check the per-position arguments; the kept rows are the masked-in, labelled ones."""
    check_direction(direction)
    check_choice("reduction", reduction, Reduction)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    flat = None
    if labels is not None:
        flat = check_labels(
            labels, lead, device, checks, vocab_size=vocab_size, ignore_index=ignore_index
        )
    keep = None if mask is None else check_mask(mask, lead, device, checks, of="the positions")
    if flat is not None:
        labelled = (flat != ignore_index).reshape(lead)
        keep = labelled if keep is None else keep & labelled
    return Positions(lead, flat, keep, direction, reduction, details)


def in_sequences(
    pos: Positions,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    counts: GlobalCounts | None,
    device: torch.device,
    checks: ValueChecks,
) -> Positions:
    """``pos`` with the sequence structure its reduction follows: packed sequences
    (``cu_seqlens``, :mod:`klest.layout`) and the step's global counts (``counts``)."""
    check_counts(counts, pos.reduction)
    layout = layout_of(pos.lead, device, cu_seqlens, max_seqlen, checks, name="logits")
    return dataclasses.replace(pos, layout=layout, counts=counts)


def with_result(
    pos: Positions, *, scale: float | Tensor | None = None, ce_weight: float = 0.0
) -> Positions:
    """``pos`` returning ``scale`` times its reduction of ``divergence + ce_weight * CE`` (the
    label's cross-entropy ``-log pi(label)``, which needs labels)."""
    if scale is not None and not isinstance(scale, Tensor):
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise TypeError(f"scale must be a number or a tensor, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
        scale = float(scale)
    if isinstance(scale, Tensor) and scale.numel() != 1:
        raise ValueError(f"scale must hold one number, got shape {tuple(scale.shape)}")
    if isinstance(ce_weight, bool) or not isinstance(ce_weight, int | float):
        raise TypeError(f"ce_weight must be a number, got {type(ce_weight).__name__}")
    if not math.isfinite(ce_weight):
        raise ValueError(f"ce_weight must be finite, got {ce_weight!r}")
    if ce_weight and pos.labels is None:
        raise ValueError("ce_weight weighs the labels' cross-entropy: pass labels")
    return dataclasses.replace(pos, scale=scale, ce_weight=float(ce_weight))


def _reduce(value: Tensor, pos: Positions, scale) -> tuple[Tensor, Tensor, Tensor]:
    """``(result, rows, valid)``: the per-row ``value`` ``[N]`` reduced as the call asks."""
    per_position = value.reshape(pos.lead)
    keep = torch.ones(pos.lead, dtype=torch.bool, device=per_position.device)
    layout = pos.layout or PaddedLayout(pos.lead)
    valid = layout.rows(keep if pos.keep is None else pos.keep)
    rows = torch.where(valid, layout.rows(per_position), 0.0)
    result = reduce_rows(rows, valid, pos.reduction, layout, pos.counts)
    return (result if scale is None else result * scale), rows, valid


def value_coefficients(pos: Positions, n: int, dtype: torch.dtype, device) -> Tensor:
    """The upstream gradient ``[N]`` each row's value gets when the result reaches the backward
    with 1 (ones for a per-position result): the reduction's weights times ``scale``, computed
    by differentiating the reduction :func:`finish` applies, so that the backward's gradients
    equal them bit for bit. No host synchronisation."""
    scale = pos.scale.detach() if isinstance(pos.scale, Tensor) else pos.scale
    leaf = torch.zeros(n, dtype=dtype, device=device, requires_grad=True)
    with torch.enable_grad():
        result, _, _ = _reduce(leaf, pos, scale)
        (coef,) = torch.autograd.grad(
            result, leaf, grad_outputs=torch.ones_like(result), allow_unused=True
        )
    return torch.zeros_like(leaf) if coef is None else coef.detach()


def finish(outputs: tuple[Tensor, ...], pos: Positions) -> Tensor | WithDetails[LogitsDetails]:
    """Shape the per-row outputs of the autograd Functions into what the public API returns."""
    value, kl_pi_ref, kl_ref_pi, entropy, logp, logp_ref = outputs
    result, rows, valid = _reduce(value, pos, pos.scale)
    if not pos.details:
        return result
    if pos.ce_weight:  # the diagnostics describe the divergence alone
        kl = (kl_pi_ref if pos.direction == "pi||ref" else kl_ref_pi).reshape(pos.lead)
        layout = pos.layout or PaddedLayout(pos.lead)
        rows = torch.where(valid, layout.rows(kl), 0.0)
    with_labels = pos.labels is not None
    details = LogitsDetails(
        logp=logp.reshape(pos.lead) if with_labels else None,
        logp_ref=logp_ref.reshape(pos.lead) if with_labels else None,
        entropy=entropy.reshape(pos.lead),
        diagnostics=diagnostics(rows, valid, reduction=pos.reduction),
    )
    return WithDetails(result, details)


def check_valid_vocab_size(valid: object, widths: tuple[int, ...]) -> int:
    """``valid_vocab_size`` as an int in ``[1, min(widths)]``."""
    if isinstance(valid, bool) or not isinstance(valid, int):
        raise TypeError(f"valid_vocab_size must be an int, got {type(valid).__name__}")
    if not 1 <= valid <= min(widths):
        raise ValueError(
            f"valid_vocab_size must be in [1, V = {min(widths)}] (the narrower model's "
            f"vocabulary), got {valid}"
        )
    return valid


def valid_columns(
    valid: int | None, *tensors: Tensor | None, dim: int = -1
) -> tuple[Tensor | None, ...]:
    """Each tensor's first ``valid`` entries along ``dim`` (logits: their columns; LM heads and
    biases: their rows, ``dim=0``), the rest padding; all of them when ``valid`` is None."""
    widths = tuple(t.shape[dim] for t in tensors if t is not None)
    if valid is None or not widths:
        return tensors
    check_valid_vocab_size(valid, widths)
    return tuple(None if t is None else t.narrow(dim, 0, valid) for t in tensors)


def value_of(stats: KLRowStats, direction: str, ce_weight: float) -> Tensor:
    """Each row's value: its KL in ``direction``, plus ``ce_weight`` times its label's
    cross-entropy ``-log pi(label)``."""
    kl = stats.kl_pi_ref if direction == "pi||ref" else stats.kl_ref_pi
    if ce_weight:
        return kl - ce_weight * stats.logp_label
    return kl.clone()


def value_grads(g: Tensor, direction: str, ce_weight: float) -> Grads:
    """The upstream gradients of the five statistics for gradient ``g`` of the value."""
    return Grads(
        kl_pi_ref=g if direction == "pi||ref" else None,
        kl_ref_pi=g if direction == "ref||pi" else None,
        logp_label=-ce_weight * g if ce_weight else None,
    )


def plus_grads(a: Grads, b: Grads | None) -> Grads:
    """Two sets of upstream gradients added (None: no term)."""
    if b is None:
        return a
    return Grads(
        *(y if x is None else (x if y is None else x + y) for x, y in zip(a, b, strict=True))
    )


@dataclass(frozen=True)
class RowPlan:
    """Everything about one call that is not a tensor (for the autograd Function).

    ``merge`` (vocab-parallel) turns this shard's row statistics into those of the whole row
    (0 on the rows whose flag is False, given a bool ``[N]`` mask);
    ``grad_in_forward``: the value's gradient is written in the forward pass, for the row
    coefficients of :func:`value_coefficients` (else the backward recomputes it);
    ``overwrite``: written over the logits themselves; ``ce_weight``: the labels'
    cross-entropy's weight in the value.
    """

    inv_tau: float
    want_entropy: bool
    backend: str
    chunk: int
    direction: str | None = None  # the KL used; None: both
    merge: Callable[[KLRowStats, Tensor | None], KLRowStats] | None = None
    grad_in_forward: bool = False
    overwrite: bool = False
    ce_weight: float = 0.0


def check_plan_options(backend: object, memory_budget: object, chunk_size: object) -> None:
    check_choice("backend", backend, Backend)
    check_positive_int("memory_budget", memory_budget)
    check_positive_int("chunk_size", chunk_size)


def gradient_in_forward(
    pos: Positions,
    grad_wanted: bool,
    stash: object,
    overwrite: object = False,
    dtype: torch.dtype | None = None,
) -> bool:
    """Whether a call writes its gradient in the forward pass (``stash``: True, False, or None
    for the automatic choice): when a gradient is wanted and either forced, or the result is a
    scalar (its upstream gradient is one number, known up to a factor), or a per-position result
    comes with a known ``scale`` (the caller sums it: the factor is 1), or the logits are to be
    overwritten. Otherwise, and with ``stash=False``, the backward recomputes (a per-position
    result whose upstream gradients are unknown costs the same passes that way, and holds no
    ``[N, V]`` buffer between the passes). Float16 gradients (``dtype``) are recomputed unless
    forced: rounded to float16 at the forward's scale, what underflows there is lost to a
    loss scaler's factor applied after it."""
    if stash is not None and not isinstance(stash, bool):
        raise TypeError(f"stash must be True, False or None, got {stash!r}")
    check_flag("overwrite_logits", overwrite)
    if overwrite and stash is False:
        raise ValueError(
            "overwrite_logits=True writes the gradient over the logits in the forward pass; "
            "stash=False recomputes it in the backward instead: pick one"
        )
    if not grad_wanted:
        return False
    if stash is None:
        if dtype == torch.float16 and not overwrite:
            return False
        return bool(pos.scalar or pos.scale is not None or overwrite)
    return stash


def plan_for(
    z: Tensor,
    y: Tensor,
    pos: Positions,
    *,
    temperature: float,
    backend: str,
    memory_budget: int | None,
    chunk_size: int | None,
    stash: bool | None,
    overwrite: bool = False,
) -> RowPlan:
    """The RowPlan of a call: backend, chunk rows, and whether the gradient is written in the
    forward pass (:func:`gradient_in_forward`)."""
    check_plan_options(backend, memory_budget, chunk_size)
    resolved = resolve_backend(backend, z)
    grad_wanted = torch.is_grad_enabled() and (z.requires_grad or y.requires_grad)
    in_forward = gradient_in_forward(pos, grad_wanted, stash, overwrite, z.dtype)
    return RowPlan(
        inv_tau=1.0 / temperature,
        want_entropy=pos.details,
        backend=resolved,
        chunk=chunk_rows(workspace_bytes_per_row(z.shape[-1]), z.device, memory_budget, chunk_size),
        direction=pos.direction,
        grad_in_forward=in_forward,
        overwrite=bool(overwrite) and in_forward,
        ce_weight=pos.ce_weight,
    )
