r"""Per-row statistics of two logit tensors and their gradients: chunked PyTorch, or Triton.

The two primitives behind every exact-from-logits path of klest
(:mod:`klest.logits.from_logits`, :mod:`klest.logits.from_hidden`,
:mod:`klest.logits.vocab_parallel`). For pi's logits ``z`` and ref's logits ``y`` (``[N, V]``),
:math:`a = z/\tau`, :math:`b = y/\tau`, :math:`q = \mathrm{softmax}(a)`,
:math:`p = \mathrm{softmax}(b)`, :math:`d = \log q - \log p`:

* :func:`row_stats` gives per row (a :class:`~klest.logits.KLRowStats`) the log-normalizers,
  :math:`KL(q\|p) = \sum_v q_v d_v`, :math:`KL(p\|q) = -\sum_v p_v d_v`,
  :math:`H(q) = -\sum_v q_v \log q_v` and the label log-probs; optionally it also writes the
  gradient of one KL in the same pass (the *stash*: the caller then only scales it);
* :func:`row_grads` recomputes ``q`` and ``p`` from the saved log-normalizers and gives

  .. math::
      \partial/\partial z = \tfrac{1}{\tau}\big[g_1\, q\odot(d - KL(q\|p))
          + g_2 (q - p) - g_3\, q\odot(\log q + H) + g_4 (e_l - q)\big], \\
      \partial/\partial y = \tfrac{1}{\tau}\big[g_1 (p - q)
          - g_2\, p\odot(d + KL(p\|q)) + g_5 (e_l - p)\big]

  for upstream gradients :math:`g_1..g_5` of the five outputs.

The PyTorch path walks row chunks (``log_softmax`` in float32 on each), so no more than a few
chunk-sized buffers exist at once; rows with ``-inf`` entries (a masked vocabulary) go through a
slower masked formula with ``0 log 0 = 0``. On CUDA the Triton kernels of
:mod:`klest.logits.kernels` do the same in one pass each. Labels follow the kernels'
convention: a label ``< 0`` is ignored, a label ``>= V`` is a token of another vocabulary shard
(its ``-q`` / ``-p`` part of the gradient only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from klest.logits._chunking import (
    chunks,
    label_logps,
    lse,
    put,
    put_rows,
    scaled,
    take,
    work_dtype,
)
from klest.logits._stats import Grads, KLRowStats
from klest.logits.kernels import kl_logits_backward, kl_logits_forward, triton_available

# Float32 buffers of V entries that the PyTorch path holds per row of a chunk (a, b, q, p, d).
_BUFFERS_PER_ROW = 5
DEFAULT_MEMORY_BUDGET = 32 * 2**20
"""Bytes of chunk workspace by default on the CPU: a chunk stays near the caches."""
CUDA_MEMORY_BUDGET = 2**30
"""On a GPU, where chunks feed large matmuls (fused linear) and kernels need many rows."""


def default_budget(device: torch.device) -> int:
    return CUDA_MEMORY_BUDGET if device.type == "cuda" else DEFAULT_MEMORY_BUDGET


def resolve_backend(backend: str, z: Tensor) -> str:
    """``"auto"`` is Triton for CUDA tensors in float32/bf16/fp16 when triton imports, else
    PyTorch (on CPU even under ``TRITON_INTERPRET=1``: the interpreter is for tests)."""
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                "backend='triton' needs triton and a CUDA device (or TRITON_INTERPRET=1 for CPU "
                "tensors); use backend='torch'"
            )
        if z.dtype == torch.float64:
            raise TypeError("backend='triton' computes in float32; float64 logits need 'torch'")
        return "triton"
    if backend == "auto" and z.is_cuda and z.dtype != torch.float64 and triton_available():
        return "triton"
    return "torch"


def chunk_rows(
    bytes_per_row: int, device: torch.device, memory_budget: int | None, chunk_size: int | None
) -> int:
    """Rows per chunk: ``chunk_size`` if given, else what fits ``memory_budget`` bytes."""
    if chunk_size is not None:
        return chunk_size
    budget = default_budget(device) if memory_budget is None else memory_budget
    return max(1, budget // max(bytes_per_row, 1))


def workspace_bytes_per_row(v: int) -> int:
    """Float32 workspace of the PyTorch path per row of V entries."""
    return _BUFFERS_PER_ROW * 4 * v


@dataclass(frozen=True)
class _ChunkNeeds:
    """What a chunk computes besides ``KL(q||p)``: ``p``, ``KL(p||q)``, the entropy."""

    p: bool
    kl_ba: bool
    entropy: bool


@dataclass
class _Chunk:
    """One chunk's statistics and the tensors its KL gradients are made of.

    ``d = log q - log p``; ``stats.kl_pi_ref = sum q d = KL(q||p)``,
    ``stats.kl_ref_pi = -sum p d = KL(p||q)`` (0 when not wanted; ``p`` is None when not needed).
    """

    stats: KLRowStats
    q: Tensor
    p: Tensor | None
    d: Tensor
    masked: bool

    def grad_a(self, direction: str, out: Tensor) -> Tensor:
        """Per-unit gradient of the KL named by ``direction`` w.r.t. ``a``, written in ``out``:
        ``q (d - KL(q||p))`` or ``q - p``."""
        q, p, d = self.q, self.p, self.d
        if direction == "ref||pi":
            return torch.sub(q, p, out=out)
        torch.sub(d, self.stats.kl_pi_ref.unsqueeze(1), out=out).mul_(q)
        return out.masked_fill_(q == 0, 0.0) if self.masked else out

    def grad_b(self, direction: str, out: Tensor) -> Tensor:
        """The same w.r.t. ``b``: ``p - q``, or ``-p (d + KL(p||q))``."""
        q, p, d = self.q, self.p, self.d
        assert p is not None
        if direction == "pi||ref":
            return torch.sub(p, q, out=out)
        torch.sub(-self.stats.kl_ref_pi.unsqueeze(1), d, out=out).mul_(p)
        return out.masked_fill_(p == 0, 0.0) if self.masked else out


def _plogq(w: Tensor, x: Tensor) -> Tensor:
    """``sum_v w_v x_v`` with ``0 * x = 0`` where ``w = 0`` (``x`` may be infinite there)."""
    return torch.where(w > 0, w * x, 0.0).sum(-1)


def _chunk_stats(
    a: Tensor, b: Tensor, labels: Tensor | None, want: _ChunkNeeds, *, masked: bool
) -> _Chunk:
    """Statistics of a chunk of rows (module docstring).

    ``masked=False`` is the fast path for rows without ``-inf`` entries (a row with one gets a
    non-finite statistic there and is redone with ``masked=True``): ``0 log 0 = 0``, and a KL
    is ``+inf`` where its first distribution has mass outside the second's support.
    """
    if masked:
        lse_a, lse_b = torch.logsumexp(a, -1), torch.logsumexp(b, -1)
        # A row with nothing but -inf (possible on one shard of a vocabulary-parallel row) has
        # log-probs -inf, not NaN; NaN / +inf inputs give a non-finite lse that the caller rejects.
        la = a - torch.where(torch.isfinite(lse_a), lse_a, 0.0).unsqueeze(1)
        lb = b - torch.where(torch.isfinite(lse_b), lse_b, 0.0).unsqueeze(1)
    else:
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        lse_a, lse_b = lse(a, la), lse(b, lb)
    logp_label, logp_ref_label = label_logps(la, labels), label_logps(lb, labels)
    q = la.exp()
    p = lb.exp() if want.p else None
    zeros = torch.zeros_like(lse_a)
    ent = zeros
    if masked:
        if want.entropy:
            ent = -_plogq(q, la)
        d = torch.where((q > 0) | (lb > float("-inf")), la - lb, 0.0)
        kl_ab = _plogq(q, d)
        kl_ba = -_plogq(lb.exp(), d) if want.kl_ba else zeros
    else:
        # d in lb's buffer; then la's buffer holds each product before its row sum. A summed
        # product (a cascade sum) is as accurate as the plain fp32 expression; a bmm dot product
        # was 40x less accurate at V = 32000 (3e-5 relative against 8e-7).
        d = torch.sub(la, lb, out=lb)
        if want.entropy:
            ent = -torch.mul(q, la, out=la).sum(-1)
        kl_ab = torch.mul(q, d, out=la).sum(-1)
        kl_ba = -torch.mul(p, d, out=la).sum(-1) if want.kl_ba else zeros
    stats = KLRowStats(
        lse_z=lse_a,
        lse_y=lse_b,
        kl_pi_ref=kl_ab.clamp_(min=0.0),
        kl_ref_pi=kl_ba.clamp_(min=0.0),
        entropy=ent.clamp_(min=0.0),
        logp_label=logp_label,
        logp_ref_label=logp_ref_label,
    )
    return _Chunk(stats, q, p, d, masked)


def _nonfinite_rows(stats: KLRowStats) -> Tensor:
    """Rows whose fast-path sums are not all finite (they hold ``-inf``, NaN or ``+inf``)."""
    sums = torch.stack([stats.lse_z, stats.lse_y, stats.kl_pi_ref, stats.kl_ref_pi, stats.entropy])
    return ~torch.isfinite(sums).all(0)


def _write_chunk_grad(
    target: Tensor,
    sel: slice | Tensor,
    grad: Callable[[_Chunk, str, Tensor], Tensor],
    direction: str,
    fast: _Chunk,
    slow: _Chunk | None,
    slow_rows: Tensor | None,
    inv_tau: float,
) -> None:
    """``target[sel] = grad / tau`` for one chunk: the fast rows' gradient, with the rows redone
    on the masked path (``slow_rows`` of the chunk) overwritten by ``slow``'s. Written straight
    into ``target`` when the selection is a slice of the work dtype."""
    direct = isinstance(sel, slice) and target.dtype == work_dtype(target)
    out = (
        target[sel]
        if direct
        else torch.empty(fast.q.shape, dtype=work_dtype(target), device=target.device)
    )
    grad(fast, direction, out)
    if slow is not None:
        assert slow_rows is not None
        out.index_copy_(
            0, slow_rows, grad(slow, direction, torch.empty_like(out[: len(slow_rows)]))
        )
    if inv_tau != 1.0:
        out.mul_(inv_tau)
    if not direct:
        put_rows(target, sel, out)


def row_stats(
    z: Tensor,
    y: Tensor,
    *,
    inv_tau: float,
    labels: Tensor | None,
    rows: Tensor | None,
    want_entropy: bool,
    backend: str,
    chunk: int,
    keep: Tensor | None = None,
    want_kl_ref_pi: bool = True,
    want_kl_pi_ref: bool = True,
    stash: str | None = None,
    stash_z: Tensor | None = None,
    stash_y: Tensor | None = None,
) -> KLRowStats:
    """Per-row statistics of the selected rows (``rows``: int indices, or None for all; or,
    on the Triton backend, ``keep``: one bool flag per row, read by the kernel).

    Rows not selected get 0 statistics. ``want_kl_ref_pi=False`` leaves ``KL(ref||pi)`` at 0
    unless the stash needs it (PyTorch backend; saves two passes when only ``KL(pi||ref)`` is
    used); ``want_kl_pi_ref=False`` lets the Triton backend skip ``KL(pi||ref)`` (0; the PyTorch
    backend computes it anyway). With
    ``stash`` (``"pi||ref"`` / ``"ref||pi"``; PyTorch backend) the per-unit gradients of that KL
    w.r.t. ``z`` and ``y`` are written into the selected rows of ``stash_z`` / ``stash_y``
    (either may be None), already divided by tau. Rows whose logits have NaN, ``+inf`` or
    nothing but ``-inf`` get a non-finite ``lse``; the caller rejects them.
    """
    n, _ = z.shape
    if backend == "triton":
        stats = kl_logits_forward(
            z,
            y,
            temperature=1.0 / inv_tau,
            labels=labels,
            want_kl_pi_ref=want_kl_pi_ref,
            want_kl_ref_pi=want_kl_ref_pi,
            want_entropy=want_entropy,
            keep=row_flags(rows, keep, n),
        )
        return stats  # float32 rows of the kernel's own [7, N] buffer, as they are

    out = torch.zeros(7, n, dtype=work_dtype(z), device=z.device)
    kl_ba = want_kl_ref_pi or stash == "ref||pi"
    needs = _ChunkNeeds(p=kl_ba or stash_y is not None, kl_ba=kl_ba, entropy=want_entropy)
    dtype = out.dtype
    for sel in chunks(n, rows, chunk):
        a = scaled(take(z, sel), inv_tau, dtype)
        b = scaled(take(y, sel), inv_tau, dtype)
        lab = None if labels is None else take(labels, sel)
        fast = _chunk_stats(a, b, lab, needs, masked=False)
        bad = _nonfinite_rows(fast.stats)
        slow = slow_rows = None
        stats = torch.stack(fast.stats)
        if bool(bad.any()):  # rows with -inf entries (or NaN, rejected by the caller)
            slow_rows = bad.nonzero().view(-1)
            sub_lab = None if lab is None else lab[slow_rows]
            slow = _chunk_stats(a[slow_rows], b[slow_rows], sub_lab, needs, masked=True)
            stats = stats.index_copy(1, slow_rows, torch.stack(slow.stats))
        put(out, sel, stats)
        if not stash:
            continue
        for target, grad in ((stash_z, _Chunk.grad_a), (stash_y, _Chunk.grad_b)):
            if target is not None:
                _write_chunk_grad(target, sel, grad, stash, fast, slow, slow_rows, inv_tau)
    return KLRowStats(*out.unbind(0))


def _row_col(g: Tensor | None, sel: slice | Tensor) -> Tensor | None:
    return None if g is None else take(g, sel).unsqueeze(1)


def _grads_chunk(
    a: Tensor,
    b: Tensor,
    st: KLRowStats,
    lab: Tensor | None,
    g: Grads,
    need_z: bool,
    need_y: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """Recomputed ``dL/da`` and ``dL/db`` of one chunk (see the module docstring); ``st`` and
    ``g`` hold the chunk's rows as columns ``[rows, 1]``."""
    lse_a, lse_b, kl_ab, kl_ba, ent = st.lse_z, st.lse_y, st.kl_pi_ref, st.kl_ref_pi, st.entropy
    g1, g2, g3, g4, g5 = g.kl_pi_ref, g.kl_ref_pi, g.entropy, g.logp_label, g.logp_ref_label
    la = a - lse_a
    q = la.exp()
    p = torch.sub(b, lse_b).exp_()
    # d = log q - log p (0 outside both supports)
    lr = torch.where((q > 0) | (p > 0), la - (b - lse_b), 0.0)
    da = db = None
    # A row whose KL is +inf has no gradient; with upstream gradient 0 it still passes 0, not
    # 0 * inf = NaN (as the stashed gradient does): its terms are dropped, not multiplied by 0.
    if need_z:
        coef = torch.zeros_like(q)
        if g1 is not None:
            coef += g1 * torch.where((q > 0) & (g1 != 0), lr - kl_ab, 0.0)
        if g3 is not None:
            coef -= g3 * torch.where(q > 0, la + ent, 0.0)
        if g2 is not None:
            coef += g2
        if g4 is not None:
            coef -= g4
        da = coef.mul_(q)
        if g2 is not None:
            da -= g2 * p
        if g4 is not None:
            _add_onehot(da, lab, g4)
    if need_y:
        db = torch.zeros_like(p)
        if g1 is not None:
            db += g1 * (p - q)
        if g2 is not None:
            db -= g2 * torch.where((p > 0) & (g2 != 0), p * (lr + kl_ba), 0.0)
        if g5 is not None:
            db -= g5 * p
            _add_onehot(db, lab, g5)
    return da, db


def _add_onehot(x: Tensor, labels: Tensor | None, g: Tensor) -> None:
    """``x[r, labels[r]] += g[r]`` where the label is inside ``[0, V)``."""
    assert labels is not None
    inside = (labels >= 0) & (labels < x.shape[1])
    col = torch.where(inside, labels, 0).unsqueeze(1)
    x.scatter_add_(1, col, torch.where(inside.unsqueeze(1), g, 0.0))


def row_grads(
    z: Tensor,
    y: Tensor,
    stats: KLRowStats,
    grads: Grads,
    *,
    inv_tau: float,
    labels: Tensor | None,
    rows: Tensor | None,
    need_z: bool,
    need_y: bool,
    backend: str,
    chunk: int,
    keep: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients w.r.t. ``z`` and ``y`` (in their dtypes; 0 on rows not selected: by ``rows``
    or ``keep``, as in :func:`row_stats`)."""
    need_z = need_z and grads.any_z()
    need_y = need_y and grads.any_y()
    if backend == "triton":
        dz, dy = kl_logits_backward(
            z,
            y,
            KLRowStats(*(s.float() for s in stats)),
            temperature=1.0 / inv_tau,
            labels=labels,
            grad_kl_pi_ref=grads.kl_pi_ref,
            grad_kl_ref_pi=grads.kl_ref_pi,
            grad_entropy=grads.entropy,
            grad_logp_label=grads.logp_label,
            grad_logp_ref_label=grads.logp_ref_label,
            need_grad_z=need_z,
            need_grad_y=need_y,
            keep=row_flags(rows, keep, z.shape[0]),
        )
        return dz, dy

    n = z.shape[0]
    dtype = stats.lse_z.dtype
    dz = zeroed_rows_buffer(z, rows) if need_z else None
    dy = zeroed_rows_buffer(y, rows) if need_y else None
    if not (need_z or need_y):
        return dz, dy
    for sel in chunks(n, rows, chunk):
        a = scaled(take(z, sel), inv_tau, dtype)
        b = scaled(take(y, sel), inv_tau, dtype)
        lab = None if labels is None else take(labels, sel)
        da, db = _grads_chunk(
            a,
            b,
            KLRowStats(*(_row_col(s, sel) for s in stats)),
            lab,
            Grads(*(_row_col(g, sel) for g in grads)),
            need_z,
            need_y,
        )
        for target, val in ((dz, da), (dy, db)):
            if target is not None and val is not None:
                put_rows(target, sel, val.mul_(inv_tau))
    return dz, dy


def row_flags(rows: Tensor | None, keep: Tensor | None, n: int) -> Tensor | None:
    """The selected rows as bool ``[n]`` flags: ``keep`` itself, or the flags of the indices
    ``rows`` (None when neither selects: every row)."""
    if rows is None:
        return keep
    return torch.zeros(n, dtype=torch.bool, device=rows.device).index_fill_(0, rows, True)


def zeroed_rows_buffer(x: Tensor, rows: Tensor | None) -> Tensor:
    """A buffer like ``x`` to fill row by row: uninitialised when every row will be written
    (``rows`` None), else zeros (rows not selected stay 0)."""
    if rows is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.zeros_like(x, memory_format=torch.contiguous_format)
