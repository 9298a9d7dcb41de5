"""What the three exact-from-logits front ends share: the positions of a call, its plan, its
result.

:func:`kl_from_logits`, :func:`kl_from_hidden` and :func:`kl_from_logits_vocab_parallel` all
take positions ``[...]`` with a mask, labels and a reduction, reduce them to rows of a
``[N, V]`` problem (:func:`positions`), run an autograd Function over those rows, and shape its
five per-row outputs into the public result (:func:`finish`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_choice,
    check_direction,
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
from klest.logits._stats import KLRowStats

OUTPUTS = ("kl_pi_ref", "kl_ref_pi", "entropy", "logp_label", "logp_ref_label")
"""The five per-row outputs of the autograd Functions, in order."""


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


def finish(outputs: tuple[Tensor, ...], pos: Positions) -> Tensor | WithDetails[LogitsDetails]:
    """Shape the per-row outputs of the autograd Functions into what the public API returns."""
    kl_pi_ref, kl_ref_pi, entropy, logp, logp_ref = outputs
    per_position = (kl_pi_ref if pos.direction == "pi||ref" else kl_ref_pi).reshape(pos.lead)
    keep = torch.ones(pos.lead, dtype=torch.bool, device=per_position.device)
    layout = pos.layout or PaddedLayout(pos.lead)
    valid = layout.rows(keep if pos.keep is None else pos.keep)
    rows = torch.where(valid, layout.rows(per_position), 0.0)
    kl = reduce_rows(rows, valid, pos.reduction, layout, pos.counts)
    if not pos.details:
        return kl
    with_labels = pos.labels is not None
    details = LogitsDetails(
        logp=logp.reshape(pos.lead) if with_labels else None,
        logp_ref=logp_ref.reshape(pos.lead) if with_labels else None,
        entropy=entropy.reshape(pos.lead),
        diagnostics=diagnostics(rows, valid, reduction=pos.reduction),
    )
    return WithDetails(kl, details)


@dataclass(frozen=True)
class RowPlan:
    """Everything about one call that is not a tensor (for the autograd Function).

    ``merge`` (vocab-parallel) turns this shard's row statistics into those of the whole row
    (0 on the rows whose flag is False, given a bool ``[N]`` mask);
    ``stash`` names the KL whose gradient is written in the forward pass (PyTorch backend, the
    KL the only output), or is None to recompute in the backward.
    """

    inv_tau: float
    want_entropy: bool
    backend: str
    chunk: int
    direction: str | None = None  # the KL used; None: both
    stash: str | None = None
    merge: Callable[[KLRowStats, Tensor | None], KLRowStats] | None = None


def check_plan_options(backend: object, memory_budget: object, chunk_size: object) -> None:
    check_choice("backend", backend, Backend)
    check_positive_int("memory_budget", memory_budget)
    check_positive_int("chunk_size", chunk_size)


def plan_for(
    z: Tensor,
    y: Tensor,
    pos: Positions,
    *,
    temperature: float,
    backend: str,
    memory_budget: int | None,
    chunk_size: int | None,
    stash: bool,
) -> RowPlan:
    """The RowPlan of a call: backend, chunk rows, and whether the gradient is stashed."""
    check_plan_options(backend, memory_budget, chunk_size)
    resolved = resolve_backend(backend, z)
    grad_wanted = torch.is_grad_enabled() and (z.requires_grad or y.requires_grad)
    stash = stash and grad_wanted and not pos.details and resolved == "torch"
    return RowPlan(
        inv_tau=1.0 / temperature,
        want_entropy=pos.details,
        backend=resolved,
        chunk=chunk_rows(workspace_bytes_per_row(z.shape[-1]), z.device, memory_budget, chunk_size),
        direction=pos.direction,
        stash=pos.direction if stash else None,
    )
