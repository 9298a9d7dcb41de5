r"""Triton kernels of the mixture KLs (generalized JSD, skew KL) and total variation: the jit code
behind :mod:`klest.logits.kernels.divergence` (imported only when triton is).

Given the rows' log-normalizers (from :func:`klest.logits.kernels.kl_logits_forward`), with
:math:`\log q = z/\tau - \mathrm{lse}_z`, :math:`\log p = y/\tau - \mathrm{lse}_y` and, for the
mixture, :math:`\log m = \mathrm{logaddexp}(\log(1-w) + \log q, \log w + \log p)`, each element
gives the divergence's term and its gradients :math:`G_q`, :math:`G_p` with respect to the
probabilities (the formulas of :mod:`klest.logits._divergence_rows`):

* mixture (``KIND = 0``): term :math:`c_q\,q(\log q - \log m) + c_p\,p(\log p - \log m)`,
  :math:`r = c_q\,q/m + c_p\,p/m`, :math:`G_q = c_q(\log q - \log m) - (1-w) r`,
  :math:`G_p = c_p(\log p - \log m) - w r`;
* total variation (``KIND = 1``): term :math:`\tfrac12|q - p|`,
  :math:`G_q = \tfrac12\mathrm{sign}(q - p) = -G_p`.

The forward kernel (one program per row) sums the terms and :math:`S_q = \langle q, G_q\rangle`,
:math:`S_p = \langle p, G_p\rangle`; the backward kernel (rows x vocabulary blocks) writes
:math:`g/\tau\; q\odot(G_q - S_q)` and :math:`g/\tau\; p\odot(G_p - S_p)`. Natural-log
arithmetic in float32; ``-inf`` entries have probability 0 and contribute nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from klest.logits.kernels._kl_logits_triton import (
    _careful_sums,
    _fast_sums,
    _store_stats,
    block_sums,
    store_zero_grads,
)


@triton.jit
def _elements(zf, yf, lse_a, lse_b, inv_tau, w, c_q, c_p, KIND: tl.constexpr):
    """``(q, p, term, G_q, G_p)`` of one block (``-inf`` where a lane is outside ``[0, V)``)."""
    la = zf * inv_tau - lse_a
    lb = yf * inv_tau - lse_b
    q = tl.exp(la)
    p = tl.exp(lb)
    if KIND == 0:
        x1 = la + tl.log(1.0 - w)
        x2 = lb + tl.log(w)
        hi = tl.maximum(x1, x2)
        lo = tl.minimum(x1, x2)
        has = hi > float("-inf")
        # log m; 0 where both q and p are 0 (it is read only where one of them is positive)
        lm = tl.where(has, hi + tl.log(1.0 + tl.exp(lo - tl.where(has, hi, 0.0))), 0.0)
        on_q = q > 0.0
        on_p = p > 0.0
        dq = tl.where(on_q, la - lm, 0.0)
        dp = tl.where(on_p, lb - lm, 0.0)
        r = c_q * tl.where(on_q, tl.exp(dq), 0.0) + c_p * tl.where(on_p, tl.exp(dp), 0.0)
        term = c_q * q * dq + c_p * p * dp
        g_q = c_q * dq - (1.0 - w) * r
        g_p = c_p * dp - w * r
    else:
        half = tl.where(q > p, 0.5, tl.where(q < p, -0.5, 0.0))
        term = tl.abs(q - p) * 0.5
        g_q = half
        g_p = -half
    return q, p, term, g_q, g_p


@triton.jit
def divergence_fwd_kernel(
    z_ptr,
    y_ptr,
    lse_a_ptr,
    lse_b_ptr,
    out_ptr,
    stride_z,
    stride_y,
    N,
    V,
    inv_tau,
    w,
    c_q,
    c_p,
    keep_ptr,
    KIND: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row per program; ``out`` is a contiguous float32 ``[3, N]``: value (at least 0 with
    ``CLAMP``; a vocabulary shard's part of a sum can be negative), S_q, S_p. With ``HAS_KEEP``,
    a row whose ``keep`` byte is 0 is not read and gets three zeros."""
    row = tl.program_id(0).to(tl.int64)
    kept = True
    if HAS_KEEP:
        kept = tl.load(keep_ptr + row) != 0
    if kept:
        _fwd_row(
            z_ptr, y_ptr, lse_a_ptr, lse_b_ptr, out_ptr, row, stride_z, stride_y, N, V, inv_tau,
            w, c_q, c_p, KIND, CLAMP, BLOCK_V,
        )  # fmt: skip
    else:
        for k in tl.static_range(3):
            tl.store(out_ptr + k * N + row, 0.0)


@triton.jit
def _fwd_row(
    z_ptr, y_ptr, lse_a_ptr, lse_b_ptr, out_ptr, row, stride_z, stride_y, N, V, inv_tau,
    w, c_q, c_p, KIND: tl.constexpr, CLAMP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The forward kernel's work for one row."""
    cols = tl.arange(0, BLOCK_V)
    lse_a = tl.load(lse_a_ptr + row)
    lse_b = tl.load(lse_b_ptr + row)
    value = tl.zeros([BLOCK_V], dtype=tl.float32)
    s_q = tl.zeros([BLOCK_V], dtype=tl.float32)
    s_p = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        inside = offs < V
        zf = tl.load(z_ptr + row * stride_z + offs, mask=inside, other=float("-inf"))
        yf = tl.load(y_ptr + row * stride_y + offs, mask=inside, other=float("-inf"))
        q, p, term, g_q, g_p = _elements(
            zf.to(tl.float32), yf.to(tl.float32), lse_a, lse_b, inv_tau, w, c_q, c_p, KIND
        )
        value += term
        s_q += q * g_q
        s_p += p * g_p
    total = tl.sum(value, axis=0)
    if CLAMP:
        total = tl.where(total < 0.0, 0.0, total)
    tl.store(out_ptr + row, total)
    tl.store(out_ptr + N + row, tl.sum(s_q, axis=0))
    tl.store(out_ptr + 2 * N + row, tl.sum(s_p, axis=0))


@triton.jit
def divergence_bwd_kernel(
    z_ptr,
    y_ptr,
    lse_a_ptr,
    lse_b_ptr,
    s_q_ptr,
    s_p_ptr,
    g_ptr,
    dz_ptr,
    dy_ptr,
    stride_z,
    stride_y,
    stride_dz,
    stride_dy,
    V,
    inv_tau,
    w,
    c_q,
    c_p,
    keep_ptr,
    KIND: tl.constexpr,
    NEED_DZ: tl.constexpr,
    NEED_DY: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program ``(row, block)``: ``dz``, ``dy`` of ``g[row]`` times the row's divergence. With
    ``HAS_KEEP``, a row whose ``keep`` byte is 0 is not read and gets zero gradients."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = offs < V
    kept = True
    if HAS_KEEP:
        kept = tl.load(keep_ptr + row) != 0
    if kept:
        _bwd_block(
            z_ptr, y_ptr, lse_a_ptr, lse_b_ptr, s_q_ptr, s_p_ptr, g_ptr, dz_ptr, dy_ptr, row,
            offs, inside, stride_z, stride_y, stride_dz, stride_dy, inv_tau, w, c_q, c_p,
            KIND, NEED_DZ, NEED_DY,
        )  # fmt: skip
    else:
        store_zero_grads(
            dz_ptr, dy_ptr, row, offs, inside, stride_dz, stride_dy, NEED_DZ, NEED_DY, BLOCK_V
        )


@triton.jit
def _bwd_block(
    z_ptr, y_ptr, lse_a_ptr, lse_b_ptr, s_q_ptr, s_p_ptr, g_ptr, dz_ptr, dy_ptr, row,
    offs, inside, stride_z, stride_y, stride_dz, stride_dy, inv_tau, w, c_q, c_p,
    KIND: tl.constexpr, NEED_DZ: tl.constexpr, NEED_DY: tl.constexpr,
):  # fmt: skip
    """The backward kernel's work for one block of one row."""
    zf = tl.load(z_ptr + row * stride_z + offs, mask=inside, other=float("-inf"))
    yf = tl.load(y_ptr + row * stride_y + offs, mask=inside, other=float("-inf"))
    q, p, _, g_q, g_p = _elements(
        zf.to(tl.float32),
        yf.to(tl.float32),
        tl.load(lse_a_ptr + row),
        tl.load(lse_b_ptr + row),
        inv_tau,
        w,
        c_q,
        c_p,
        KIND,
    )
    scale = tl.load(g_ptr + row) * inv_tau
    if NEED_DZ:
        dz = scale * q * (g_q - tl.load(s_q_ptr + row))
        tl.store(dz_ptr + row * stride_dz + offs, dz.to(dz_ptr.dtype.element_ty), mask=inside)
    if NEED_DY:
        dy = scale * p * (g_p - tl.load(s_p_ptr + row))
        tl.store(dy_ptr + row * stride_dy + offs, dy.to(dy_ptr.dtype.element_ty), mask=inside)


@triton.jit
def divergence_fused_kernel(
    z_ptr, y_ptr, label_ptr, stats_ptr, mix_ptr, keep_ptr, g_ptr, dz_ptr, dy_ptr,
    stride_z, stride_y, stride_dz, stride_dy, N, V, scale, inv_tau, w, c_q, c_p,
    KIND: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_KEEP: tl.constexpr,
    WANT_ENT: tl.constexpr, NEED_DZ: tl.constexpr, NEED_DY: tl.constexpr,
    ONE_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The divergence's forward and its gradient for per-row coefficients ``g`` (known before
    the call) in one launch; rows taken in turn by ``num_programs`` programs. Per row: the
    log-normalizers (the KL kernel's loops, into ``stats`` ``[7, N]`` in its layout, KLs 0),
    then the value, ``S_q``, ``S_p`` (into ``mix`` ``[3, N]``), then ``g/tau q (G_q - S_q)`` and
    ``g/tau p (G_p - S_p)``. ``ONE_BLOCK``: the row is read once and all three come from the
    registers; otherwise the value and the gradient loops read it again (twice more). Rows whose
    ``keep`` byte is 0 are not read: zeros."""
    cols = tl.arange(0, BLOCK_V)
    zero64 = tl.program_id(0).to(tl.int64) * 0
    for row32 in range(tl.program_id(0), N, tl.num_programs(0)):
        row = row32 + zero64
        kept = True
        if HAS_KEEP:
            kept = tl.load(keep_ptr + row) != 0
        if kept:
            _fused_row(
                z_ptr, y_ptr, label_ptr, stats_ptr, mix_ptr, g_ptr, dz_ptr, dy_ptr, row,
                stride_z, stride_y, stride_dz, stride_dy, N, V, scale, inv_tau, w, c_q, c_p,
                KIND, HAS_LABELS, WANT_ENT, NEED_DZ, NEED_DY, ONE_BLOCK, BLOCK_V,
            )  # fmt: skip
        else:
            for k in tl.static_range(7):
                tl.store(stats_ptr + k * N + row, 0.0)
            for k in tl.static_range(3):
                tl.store(mix_ptr + k * N + row, 0.0)
            for start in range(0, V, BLOCK_V):
                offs = start + cols
                store_zero_grads(
                    dz_ptr, dy_ptr, row, offs, offs < V, stride_dz, stride_dy, NEED_DZ, NEED_DY,
                    BLOCK_V,
                )  # fmt: skip


@triton.jit
def _fused_row(
    z_ptr, y_ptr, label_ptr, stats_ptr, mix_ptr, g_ptr, dz_ptr, dy_ptr, row,
    stride_z, stride_y, stride_dz, stride_dy, N, V, scale, inv_tau, w, c_q, c_p,
    KIND: tl.constexpr, HAS_LABELS: tl.constexpr, WANT_ENT: tl.constexpr,
    NEED_DZ: tl.constexpr, NEED_DY: tl.constexpr, ONE_BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The fused divergence kernel's work for one row."""
    z_row = z_ptr + row * stride_z
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    if ONE_BLOCK:
        inside = cols < V
        zf = tl.load(z_row + cols, mask=inside, other=neg_inf).to(tl.float32)
        yf = tl.load(y_row + cols, mask=inside, other=neg_inf).to(tl.float32)
        m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b = block_sums(zf, yf, scale)
    else:
        m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b, ok = _fast_sums(
            z_row, y_row, V, scale, False, False, WANT_ENT, False, BLOCK_V
        )
        if not ok:
            m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b, ok = _fast_sums(
                z_row, y_row, V, scale, False, False, WANT_ENT, True, BLOCK_V
            )
            if not ok:
                m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b = _careful_sums(
                    z_row, y_row, V, scale, BLOCK_V
                )
    lse_a, lse_b, _, _, _ = _store_stats(
        z_row, y_row, label_ptr, stats_ptr, row, N, V, scale, m_a, m_b, sum_a, sum_b, w_a,
        tot_a, tot_b, HAS_LABELS, False, False, WANT_ENT,
    )  # fmt: skip
    if ONE_BLOCK:
        q, p, term, g_q, g_p = _elements(zf, yf, lse_a, lse_b, inv_tau, w, c_q, c_p, KIND)
        value = tl.sum(term, axis=0)
        s_q = tl.sum(q * g_q, axis=0)
        s_p = tl.sum(p * g_p, axis=0)
    else:
        acc_v = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_q = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_p = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            inside = offs < V
            zb = tl.load(z_row + offs, mask=inside, other=neg_inf).to(tl.float32)
            yb = tl.load(y_row + offs, mask=inside, other=neg_inf).to(tl.float32)
            q, p, term, g_q, g_p = _elements(zb, yb, lse_a, lse_b, inv_tau, w, c_q, c_p, KIND)
            acc_v += term
            acc_q += q * g_q
            acc_p += p * g_p
        value = tl.sum(acc_v, axis=0)
        s_q = tl.sum(acc_q, axis=0)
        s_p = tl.sum(acc_p, axis=0)
    tl.store(mix_ptr + row, tl.where(value < 0.0, 0.0, value))
    tl.store(mix_ptr + N + row, s_q)
    tl.store(mix_ptr + 2 * N + row, s_p)
    coef = tl.load(g_ptr + row) * inv_tau
    if ONE_BLOCK:
        _store_grads(
            dz_ptr, dy_ptr, row, cols, inside, stride_dz, stride_dy, coef, q, p, g_q, g_p, s_q,
            s_p, NEED_DZ, NEED_DY,
        )  # fmt: skip
    else:
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            inside = offs < V
            zb = tl.load(z_row + offs, mask=inside, other=neg_inf).to(tl.float32)
            yb = tl.load(y_row + offs, mask=inside, other=neg_inf).to(tl.float32)
            q, p, term, g_q, g_p = _elements(zb, yb, lse_a, lse_b, inv_tau, w, c_q, c_p, KIND)
            _store_grads(
                dz_ptr, dy_ptr, row, offs, inside, stride_dz, stride_dy, coef, q, p, g_q, g_p,
                s_q, s_p, NEED_DZ, NEED_DY,
            )  # fmt: skip


@triton.jit
def _store_grads(
    dz_ptr, dy_ptr, row, offs, inside, stride_dz, stride_dy, coef, q, p, g_q, g_p, s_q, s_p,
    NEED_DZ: tl.constexpr, NEED_DY: tl.constexpr,
):  # fmt: skip
    """``coef q (G_q - S_q)`` and ``coef p (G_p - S_p)`` of one block, stored."""
    if NEED_DZ:
        dz = coef * q * (g_q - s_q)
        tl.store(dz_ptr + row * stride_dz + offs, dz.to(dz_ptr.dtype.element_ty), mask=inside)
    if NEED_DY:
        dy = coef * p * (g_p - s_p)
        tl.store(dy_ptr + row * stride_dy + offs, dy.to(dy_ptr.dtype.element_ty), mask=inside)
