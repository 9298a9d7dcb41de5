"""Row-chunk helpers shared by the chunked PyTorch paths (:mod:`klest.logits._rows`,
:mod:`klest.logits._divergence_rows`): walking the selected rows in chunks, reading a chunk,
scaling it by the temperature, its log-normalizer and label log-probs, and writing results back.

A *selection* is a ``slice`` of ``range(N)`` (every row, in order) or an int tensor of row indices.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = [
    "chunks",
    "label_logps",
    "lse",
    "put",
    "put_rows",
    "scaled",
    "take",
    "work_dtype",
]


def chunks(n: int, rows: Tensor | None, size: int) -> Iterator[slice | Tensor]:
    """Row selections of at most ``size`` rows: slices of ``range(n)``, or pieces of ``rows``."""
    size = max(size, 1)
    if rows is None:
        for s in range(0, n, size):
            yield slice(s, min(s + size, n))
    else:
        yield from rows.split(size)


def take(x: Tensor, sel: slice | Tensor) -> Tensor:
    """The selected rows of ``x`` (a view for a slice, a copy for indices)."""
    return x[sel] if isinstance(sel, slice) else x.index_select(0, sel)


def scaled(x: Tensor, inv_tau: float, dtype: torch.dtype) -> Tensor:
    """``x / tau`` in the compute dtype; a view of ``x`` when nothing changes (never written)."""
    if inv_tau == 1.0:
        return x.to(dtype)
    return torch.mul(x.to(dtype), inv_tau) if x.dtype != dtype else torch.mul(x, inv_tau)


def lse(a: Tensor, la: Tensor) -> Tensor:
    """``logsumexp(a)`` from ``la = log_softmax(a)``: ``max a - la[argmax]`` (no extra exp)."""
    m, arg = a.max(-1, keepdim=True)
    return (m - la.gather(1, arg)).view(-1)


def label_logps(la: Tensor, labels: Tensor | None) -> Tensor:
    """``la[r, labels[r]]`` where the label is inside ``[0, V)``, else 0."""
    if labels is None:
        return la.new_zeros(la.shape[0])
    inside = (labels >= 0) & (labels < la.shape[1])
    col = torch.where(inside, labels, 0).unsqueeze(1)
    return torch.where(inside, la.gather(1, col).view(-1), 0.0)


def work_dtype(t: Tensor) -> torch.dtype:
    """The compute dtype of the PyTorch paths: float64 for float64 input, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def put(out: Tensor, sel: slice | Tensor, values: Tensor) -> None:
    """``out[:, sel] = values``: per-row statistics ``[S, N]``, written for the selected rows."""
    if isinstance(sel, slice):
        out[:, sel] = values
    else:
        out.index_copy_(1, sel, values)


def put_rows(target: Tensor, sel: slice | Tensor, values: Tensor) -> None:
    """``target[sel] = values``: a chunk's rows written into ``target`` ``[N, ...]``, in its
    dtype."""
    if isinstance(sel, slice):
        target[sel] = values
    else:
        target.index_copy_(0, sel, values.to(target.dtype))
