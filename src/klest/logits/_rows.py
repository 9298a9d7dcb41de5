r"""Per-row statistics of two logit tensors and their gradients: chunked PyTorch, or Triton.

The two primitives behind every exact-from-logits path of klest
(:mod:`klest.logits.from_logits`, :mod:`klest.logits.from_hidden`,
:mod:`klest.logits.vocab_parallel`). For pi's logits ``z`` and ref's logits ``y`` (``[N, V]``),
:math:`a = z/\tau`, :math:`b = y/\tau`, :math:`q = \mathrm{softmax}(a)`,
:math:`p = \mathrm{softmax}(b)`, :math:`d = \log q - \log p`:

* :func:`row_stats` gives per row (a :class:`~klest.logits.KLRowStats`) the log-normalizers,
  :math:`KL(q\|p) = \sum_v q_v d_v`, :math:`KL(p\|q) = -\sum_v p_v d_v`,
  :math:`H(q) = -\sum_v q_v \log q_v` and the label log-probs; :func:`row_stats_grads` also
  writes, from the same read of each row, the gradients for upstream gradients known before the
  call (the *gradient in the forward*: a reduction's weights, a loss's coefficients; the
  backward then only rescales the rows whose upstream gradient differs, :func:`rescale_rows_`);
* :func:`row_grads` recomputes ``q`` and ``p`` from the saved log-normalizers and gives

  .. math::
      \partial/\partial z = \tfrac{1}{\tau}\big[g_1\, q\odot(d - KL(q\|p))
          + g_2 (q - p) - g_3\, q\odot(\log q + H) + g_4 (e_l - q)\big], \\
      \partial/\partial y = \tfrac{1}{\tau}\big[g_1 (p - q)
          - g_2\, p\odot(d + KL(p\|q)) + g_5 (e_l - p)\big]

  for upstream gradients :math:`g_1..g_5` of the five outputs.

Passes over ``[N, V]`` (a pass reads ``z`` and ``y`` once; a gradient's write is one more):
``row_stats`` one; ``row_stats_grads`` one and a write of each gradient (the PyTorch path works
on a chunk of rows while it is in cache; the Triton kernel reads a row of up to 16384 entries
once and a longer one twice in a row, the second time from cache where the rows in flight fit);
``row_grads`` one and a write of each gradient; ``rescale_rows_`` reads and writes only the rows
whose factor is not 1.

The PyTorch path walks row chunks (``log_softmax`` in float32 on each), so no more than a few
chunk-sized buffers exist at once; rows with ``-inf`` entries (a masked vocabulary) go through a
slower masked formula with ``0 log 0 = 0``. On CUDA the Triton kernels of
:mod:`klest.logits.kernels` do the same. Labels follow the kernels'
convention: a label ``< 0`` is ignored, a label ``>= V`` is a token of another vocabulary shard
(its ``-q`` / ``-p`` part of the gradient only).
"""

from __future__ import annotations

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
from klest.logits.kernels import (
    kl_logits_backward,
    kl_logits_forward,
    kl_logits_fused,
    scale_rows_,
    triton_available,
)

# Float32 buffers of V entries that the PyTorch path holds per row of a chunk: a, b, log q,
# log p, q, p, d, a product, and a gradient (the statistics alone need the first eight).
_BUFFERS_PER_ROW = 9
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
    """One chunk's statistics and the tensors its gradients are made of: ``la = log q``,
    ``lb = log p``, ``q``, ``p`` (None when not needed), ``d = log q - log p`` (0 outside both
    supports on the masked path); ``masked``: rows that may hold ``-inf`` entries."""

    stats: KLRowStats
    la: Tensor
    lb: Tensor
    q: Tensor
    p: Tensor | None
    d: Tensor
    masked: bool


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
        # Products summed row by row (a cascade sum) are as accurate as the plain fp32
        # expression; a bmm dot product was 40x less accurate at V = 32000 (3e-5 relative
        # against 8e-7). One product buffer serves them all.
        d = la - lb
        prod = torch.empty_like(d)
        if want.entropy:
            ent = -torch.mul(q, la, out=prod).sum(-1)
        kl_ab = torch.mul(q, d, out=prod).sum(-1)
        kl_ba = -torch.mul(p, d, out=prod).sum(-1) if want.kl_ba else zeros
    stats = KLRowStats(
        lse_z=lse_a,
        lse_y=lse_b,
        kl_pi_ref=kl_ab.clamp_(min=0.0),
        kl_ref_pi=kl_ba.clamp_(min=0.0),
        entropy=ent.clamp_(min=0.0),
        logp_label=logp_label,
        logp_ref_label=logp_ref_label,
    )
    return _Chunk(stats, la, lb, q, p, d, masked)


def _chunk_from_stats(a: Tensor, b: Tensor, st: KLRowStats) -> _Chunk:
    """The chunk's tensors recomputed from its saved log-normalizers (the backward's way;
    ``st`` holds the rows as columns ``[rows, 1]``)."""
    la = a - st.lse_z
    lb = b - st.lse_y
    q = la.exp()
    p = lb.exp()
    # d = log q - log p (0 outside both supports)
    d = torch.where((q > 0) | (p > 0), la - lb, 0.0)
    return _Chunk(st, la, lb, q, p, d, masked=True)


def _chunk_grads(
    ch: _Chunk, lab: Tensor | None, g: Grads, need_z: bool, need_y: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``dL/da`` and ``dL/db`` of one chunk (module docstring, before the ``1/tau``);
    ``ch.stats`` and ``g`` hold the chunk's rows as columns ``[rows, 1]``."""
    st = ch.stats
    la, q, d = ch.la, ch.q, ch.d
    g1, g2, g3, g4, g5 = g.kl_pi_ref, g.kl_ref_pi, g.entropy, g.logp_label, g.logp_ref_label
    p = ch.p
    if p is None and (need_y or g2 is not None):
        p = ch.lb.exp()
    da = db = None
    # A row whose KL is +inf has no gradient; with upstream gradient 0 it still passes 0, not
    # 0 * inf = NaN: its terms are dropped, not multiplied by 0. (Rows on the fast path are
    # finite and need no selects.)
    if need_z:
        coef = None
        if g1 is not None:
            coef = torch.sub(d, st.kl_pi_ref)
            if ch.masked:
                coef = torch.where((q > 0) & (g1 != 0), coef, 0.0)
            coef.mul_(g1)
        if g3 is not None:
            term = torch.add(la, st.entropy)
            if ch.masked:
                term = torch.where(q > 0, term, 0.0)
            term.mul_(g3)
            coef = term.neg_() if coef is None else coef.sub_(term)
        shift = g2  # the per-row constants of the coefficient: g2 - g4
        if g4 is not None:
            shift = -g4 if shift is None else shift - g4
        if shift is not None:
            coef = shift.expand_as(q).clone() if coef is None else coef.add_(shift)
        da = torch.zeros_like(q) if coef is None else coef.mul_(q)
        if g2 is not None:
            da.addcmul_(p, g2, value=-1.0)
        if g4 is not None:
            _add_onehot(da, lab, g4)
    if need_y:
        db = None
        if g1 is not None:
            db = torch.sub(p, q).mul_(g1)
        if g2 is not None:
            term = torch.add(d, st.kl_ref_pi).mul_(p)
            if ch.masked:
                term = torch.where((p > 0) & (g2 != 0), term, 0.0)
            term.mul_(g2)
            db = term.neg_() if db is None else db.sub_(term)
        if g5 is not None:
            db = torch.mul(p, -g5) if db is None else db.addcmul_(p, g5, value=-1.0)
            _add_onehot(db, lab, g5)
        if db is None:
            db = torch.zeros_like(p)
    return da, db


def _nonfinite_rows(stats: KLRowStats) -> Tensor:
    """Rows whose fast-path sums are not all finite (they hold ``-inf``, NaN or ``+inf``)."""
    sums = torch.stack([stats.lse_z, stats.lse_y, stats.kl_pi_ref, stats.kl_ref_pi, stats.entropy])
    return ~torch.isfinite(sums).all(0)


def _add_onehot(x: Tensor, labels: Tensor | None, g: Tensor) -> None:
    """``x[r, labels[r]] += g[r]`` where the label is inside ``[0, V)``."""
    assert labels is not None
    inside = (labels >= 0) & (labels < x.shape[1])
    col = torch.where(inside, labels, 0).unsqueeze(1)
    x.scatter_add_(1, col, torch.where(inside.unsqueeze(1), g, 0.0))


def _columns(rows: tuple, sel: slice | Tensor, kind: type = KLRowStats):
    """The selected rows of per-row tensors as columns ``[rows, 1]`` (None stays None)."""
    return kind(*(None if t is None else take(t, sel).unsqueeze(1) for t in rows))


def _write_rows(target: Tensor, sel: slice | Tensor, val: Tensor, inv_tau: float) -> None:
    """``target[sel] = val / tau`` (``val``, a chunk's work buffer, is scaled in place)."""
    if inv_tau != 1.0:
        val.mul_(inv_tau)
    put_rows(target, sel, val)


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
) -> KLRowStats:
    """Per-row statistics of the selected rows (``rows``: int indices, or None for all; or,
    on the Triton backend, ``keep``: one bool flag per row, read by the kernel).

    Rows not selected get 0 statistics. ``want_kl_ref_pi=False`` leaves ``KL(ref||pi)`` at 0
    (saves two passes of the PyTorch path when only ``KL(pi||ref)`` is used);
    ``want_kl_pi_ref=False`` lets the Triton backend skip ``KL(pi||ref)`` (0; the PyTorch
    backend computes it anyway). Rows whose logits have NaN, ``+inf`` or nothing but ``-inf``
    get a non-finite ``lse``; the caller rejects them.
    """
    if backend == "triton":
        return kl_logits_forward(
            z,
            y,
            temperature=1.0 / inv_tau,
            labels=labels,
            want_kl_pi_ref=want_kl_pi_ref,
            want_kl_ref_pi=want_kl_ref_pi,
            want_entropy=want_entropy,
            keep=row_flags(rows, keep, z.shape[0]),
        )  # float32 rows of the kernel's own [7, N] buffer, as they are
    stats, _, _ = _torch_rows(
        z, y, inv_tau, labels, rows, chunk, want_entropy, want_kl_ref_pi, None, None, None
    )
    return stats


def row_stats_grads(
    z: Tensor,
    y: Tensor,
    grads: Grads,
    *,
    inv_tau: float,
    labels: Tensor | None,
    rows: Tensor | None,
    want_entropy: bool,
    backend: str,
    chunk: int,
    need_z: bool,
    need_y: bool,
    keep: Tensor | None = None,
    want_kl_ref_pi: bool = True,
    want_kl_pi_ref: bool = True,
    dz: Tensor | None = None,
    dy: Tensor | None = None,
) -> tuple[KLRowStats, Tensor | None, Tensor | None]:
    """:func:`row_stats` and, from the same read of each row, the gradients of
    ``sum_n sum_k grads_k[n] output_k[n]`` w.r.t. ``z`` and ``y`` (``grads``: per-row upstream
    gradients known before the call; module docstring), 0 on rows not selected.

    ``dz`` / ``dy``: where to write them (e.g. the logits themselves: each chunk of rows is read
    before it is written); default new tensors like ``z`` / ``y``.
    """
    if backend == "triton":
        return kl_logits_fused(
            z,
            y,
            temperature=1.0 / inv_tau,
            labels=labels,
            grad_kl_pi_ref=grads.kl_pi_ref,
            grad_kl_ref_pi=grads.kl_ref_pi,
            grad_entropy=grads.entropy,
            grad_logp_label=grads.logp_label,
            grad_logp_ref_label=grads.logp_ref_label,
            need_grad_z=need_z,
            need_grad_y=need_y,
            want_kl_pi_ref=want_kl_pi_ref,
            want_kl_ref_pi=want_kl_ref_pi,
            want_entropy=want_entropy,
            dz=dz,
            dy=dy,
            keep=row_flags(rows, keep, z.shape[0]),
        )
    dz = zeroed_rows_buffer(z, rows, into=dz) if need_z else None
    dy = zeroed_rows_buffer(y, rows, into=dy) if need_y else None
    kl_ba = want_kl_ref_pi or grads.kl_ref_pi is not None
    return _torch_rows(z, y, inv_tau, labels, rows, chunk, want_entropy, kl_ba, grads, dz, dy)


def _torch_rows(
    z: Tensor,
    y: Tensor,
    inv_tau: float,
    labels: Tensor | None,
    rows: Tensor | None,
    chunk: int,
    want_entropy: bool,
    kl_ba: bool,
    grads: Grads | None,
    dz: Tensor | None,
    dy: Tensor | None,
) -> tuple[KLRowStats, Tensor | None, Tensor | None]:
    """The chunked PyTorch engine: statistics, and the gradients for ``grads`` into ``dz`` /
    ``dy`` (those given) from each chunk while it is in cache."""
    n = z.shape[0]
    out = torch.zeros(7, n, dtype=work_dtype(z), device=z.device)
    need_z, need_y = dz is not None, dy is not None
    with_grads = grads is not None and (need_z or need_y)
    entropy = want_entropy or (with_grads and grads.entropy is not None)
    # ref's probabilities: for KL(ref||pi), or a gradient that has them (not KL(pi||ref)'s
    # gradient to pi's logits alone)
    p_in_grads = with_grads and (need_y or grads.kl_ref_pi is not None)
    needs = _ChunkNeeds(p=kl_ba or p_in_grads, kl_ba=kl_ba, entropy=entropy)
    for sel in chunks(n, rows, chunk):
        a = scaled(take(z, sel), inv_tau, out.dtype)
        b = scaled(take(y, sel), inv_tau, out.dtype)
        lab = None if labels is None else take(labels, sel)
        fast = _chunk_stats(a, b, lab, needs, masked=False)
        bad = _nonfinite_rows(fast.stats)
        slow = slow_rows = sub_lab = None
        stats = torch.stack(fast.stats)
        if bool(bad.any()):  # rows with -inf entries (or NaN, rejected by the caller)
            slow_rows = bad.nonzero().view(-1)
            sub_lab = None if lab is None else lab[slow_rows]
            slow = _chunk_stats(a[slow_rows], b[slow_rows], sub_lab, needs, masked=True)
            stats = stats.index_copy(1, slow_rows, torch.stack(slow.stats))
        put(out, sel, stats)
        if not with_grads:
            continue
        g = _columns(grads, sel, Grads)
        fast.stats = KLRowStats(*(s.unsqueeze(1) for s in fast.stats))
        da, db = _chunk_grads(fast, lab, g, need_z, need_y)
        if slow is not None:
            slow.stats = KLRowStats(*(s.unsqueeze(1) for s in slow.stats))
            g_slow = Grads(*(None if t is None else t[slow_rows] for t in g))
            parts = _chunk_grads(slow, sub_lab, g_slow, need_z, need_y)
            for full, part in zip((da, db), parts, strict=True):
                if full is not None and part is not None:
                    full.index_copy_(0, slow_rows, part)
        for target, val in ((dz, da), (dy, db)):
            if target is not None and val is not None:
                _write_rows(target, sel, val, inv_tau)
    stats = KLRowStats(*out.unbind(0))
    if entropy and not want_entropy:
        stats = stats._replace(entropy=torch.zeros_like(stats.entropy))
    return stats, dz, dy


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
        ch = _chunk_from_stats(a, b, _columns(stats, sel))
        da, db = _chunk_grads(ch, lab, _columns(grads, sel, Grads), need_z, need_y)
        for target, val in ((dz, da), (dy, db)):
            if target is not None and val is not None:
                _write_rows(target, sel, val, inv_tau)
    return dz, dy


def rescale_rows_(x: Tensor, g: Tensor, c: Tensor, *, backend: str) -> Tensor:
    """``x[n] *= g[n] / c[n]``: a gradient written in the forward pass for row coefficients
    ``c``, brought to the upstream gradients ``g`` of the backward. Rows where ``g == c`` are
    left alone (on the Triton backend decided on the device: no pass, no synchronisation; on
    the CPU by one host read, which costs nothing there); rows where ``g == 0`` become 0."""
    if backend == "triton":
        return scale_rows_(x, g, c)
    ratio = torch.where(g == c, 1.0, g / torch.where(c == 0, 1.0, c)).unsqueeze(1)
    on_cpu = x.device.type == "cpu"
    if on_cpu and not bool((ratio != 1).any()):
        return x
    x.mul_(ratio)
    dropped = ((g == 0) & (g != c)).unsqueeze(1)
    if not on_cpu or bool(dropped.any()):
        x.masked_fill_(dropped, 0.0)
    return x


def row_flags(rows: Tensor | None, keep: Tensor | None, n: int) -> Tensor | None:
    """The selected rows as bool ``[n]`` flags: ``keep`` itself, or the flags of the indices
    ``rows`` (None when neither selects: every row)."""
    if rows is None:
        return keep
    return torch.zeros(n, dtype=torch.bool, device=rows.device).index_fill_(0, rows, True)


def zeroed_rows_buffer(x: Tensor, rows: Tensor | None, *, into: Tensor | None = None) -> Tensor:
    """A buffer like ``x`` to fill row by row: uninitialised when every row will be written
    (``rows`` None), else zeros (rows not selected stay 0). ``into``: that buffer, given (e.g.
    ``x`` itself, to be overwritten), with its rows not selected set to 0."""
    if into is not None:
        if rows is not None:
            others = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
            into.masked_fill_(others.index_fill_(0, rows, False).unsqueeze(1), 0.0)
        return into
    if rows is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.zeros_like(x, memory_format=torch.contiguous_format)
