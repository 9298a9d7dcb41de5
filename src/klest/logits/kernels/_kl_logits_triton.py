r"""Triton kernels behind :mod:`klest.logits.kernels.kl_logits` (imported only when triton is).

Notation: ``a = z / tau`` and ``b = y / tau`` are pi's and ref's scaled logits, ``q = softmax(a)``,
``p = softmax(b)``. The kernels work in base 2: they load ``a2 = a log2(e)`` (one multiply by
``scale = log2(e) / tau``) so every exponential is a bare ``exp2``, and convert back to nats with
``ln 2`` once per row.

Forward (one program per row, one pass over the vocabulary in blocks of ``BLOCK_V``), against an
offset ``m`` of ``a2`` (and of ``b2``)::

    s_a = sum 2^(a2 - m_a)                      -> lse_a = ln2 (m_a + log2 s_a)
    w_a = sum 2^(a2 - m_a) (a2 - m_a)           -> H(q) = ln2 (log2 s_a - w_a / s_a)
    t_a = sum 2^(a2 - m_a) (a2 - b2)            -> KL(q||p) = ln2 (t_a / s_a - (m_a - m_b)
                                                                   - (log2 s_a - log2 s_b))
    t_b = sum 2^(b2 - m_b) (b2 - a2)            -> KL(p||q), symmetrically

These hold for any offset; two loops choose it differently.

* Fast (``_fast_sums``, tried first): ``m`` is the maximum of the row's first block, fixed for the
  row. The loop body is then a few fma per element pair (two ``exp2``; nothing for a sum not
  asked for: ``WANT_*``): no running maximum, no rescaling, no cross-lane reduction, and no mask
  outside the last block. A row with ``-inf`` entries makes a sum non-finite (``0 * -inf``) and
  is read again by the same loop with ``CLAMP``: ``-inf`` replaced by the finite
  ``MASKED_LOGIT = -2^100`` (a NaN-propagating max), whose ``exp2`` is 0 and whose products with
  0 are 0, so a ``-inf`` mask shared by both logits (a masked vocabulary), or one on a side whose
  KL is not asked for, is handled there. (Clamping on the first read would cost the common,
  finite case ~20% on an H200.) Its largest term is
  ``2^0 = 1`` or more, so nothing the result needs underflows. It cannot give the result, and
  says so (``ok`` False), when a sum goes non-finite (a term overflows: the row's maximum is
  ~88 nats above the first block's, less for the products; NaN or ``+inf`` entries; a first
  block of only ``-inf``) or when ``|z - y|`` reaches ~2^99 in a wanted KL's direction (one
  side's ``-inf`` against the other's finite logit: that KL is ``+inf``; only with ``CLAMP``).
  The kernel then runs the careful loop for that row only. Rounding: the entropy
  ``lg s - w / s`` subtracts two numbers of about the gap ``G`` (log2 units) between the row's
  maximum and the offset, so its absolute error grows to about ``8 (G + log2 V) 2^-24 ln 2``
  (tested; at most ~4e-5 nats before overflow sends the row to the careful loop); the KLs and
  log-normalizers lose a factor ~2 at most.
* Careful (``_careful_sums``): a running maximum ``m`` (a scalar) and per-lane running sums,
  rescaled by ``alpha = 2^(m_old - m_new)`` whenever the maximum grows. ``w_a`` is kept relative
  to the running maximum (not ``sum 2^(a2 - m) a2``) so the entropy does not cancel two numbers of
  the size of the logits; when the maximum moves from ``m`` to ``m'`` it becomes
  ``alpha (w_a + (m - m') s_a)``.

Identical rows give ``t = 0``, equal offsets and equal sums, so both KLs are exactly 0 (the fast
loop accumulates ``e (z - y)`` and scales the sum once, so ``d`` is exactly 0 there too).

Support (the careful loop; ``-inf`` entries, also used for its lanes past ``V``): a lane with
``a = -inf`` adds nothing to the ``q``-weighted sums (selected out, so ``0 * inf`` never happens).
A lane with ``a`` finite and ``b = -inf`` adds ``+inf`` to ``t_a`` (or NaN, when its weight
underflowed to 0 or was later rescaled by an ``alpha`` that underflowed); either way ``KL(q||p)``
is truly ``+inf``, so a non-finite ``t_a`` is reported as ``+inf``. NaN or ``+inf`` inputs make
``s`` NaN and every output of the row NaN. A row that is entirely ``-inf`` has no distribution
(``s = 0``); the caller rejects such rows.

Backward (grid ``rows x vocabulary blocks``; no reduction, the row statistics come from the
forward): with ``la = a - lse_a``, ``lb = b - lse_b``,

    dz = (1/tau) [ g1 q (la - lb - KL(q||p)) + g2 (q - p) - g3 q (la + H) + g4 (onehot - q) ]
    dy = (1/tau) [ g1 (p - q) + g2 p (lb - la - KL(p||q)) + g5 (onehot - p) ]

each ``q (...)`` term taken as 0 where ``q`` has no support. A negative label drops the ``g4`` /
``g5`` terms; a label ``>= V`` (a token of another vocabulary shard) keeps their ``-q`` / ``-p``
part, as the log-prob of that token depends on this shard's logits through the normalizer. A
term whose upstream gradient is 0 contributes exactly 0, even on a row where its KL is ``+inf``
(its gradient does not exist there).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _finite(x):
    return x * 0.0 == 0.0


@triton.jit
def store_zero_grads(
    dz_ptr, dy_ptr, row, offs, inside, stride_dz, stride_dy,
    NEED_DZ: tl.constexpr, NEED_DY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Zero gradients for one block of a row that is not kept (both backward kernels)."""
    zero = tl.zeros([BLOCK_V], dtype=tl.float32)
    if NEED_DZ:
        tl.store(dz_ptr + row * stride_dz + offs, zero.to(dz_ptr.dtype.element_ty), mask=inside)
    if NEED_DY:
        tl.store(dy_ptr + row * stride_dy + offs, zero.to(dy_ptr.dtype.element_ty), mask=inside)


# -inf stands in the fast loop for this (finite) value: its exp2 is 0, and 0 times it is 0.
MASKED_LOGIT = tl.constexpr(-(2.0**100))


@triton.jit
def _fast_terms(
    zf, yf, inside, m_a, m_b, scale, s_a, s_b, w_a, t_a, t_b, d_hi, d_lo,
    WANT_AB: tl.constexpr, WANT_BA: tl.constexpr, WANT_ENT: tl.constexpr, MASKED: tl.constexpr,
    CLAMP: tl.constexpr,
):  # fmt: skip
    """One block's terms added to the fast loop's per-lane sums (``inside``: lanes < V, used only
    when ``MASKED``; masked lanes hold 0 and get weight 0). With ``CLAMP``, ``-inf`` entries count
    as ``MASKED_LOGIT`` and ``d_hi`` / ``d_lo`` track the largest / smallest ``z - y`` (for the KL
    that needs it)."""
    if CLAMP:
        # -inf -> MASKED_LOGIT; NaN stays NaN (a plain max would drop it), +inf stays +inf.
        zf = tl.maximum(zf, MASKED_LOGIT, propagate_nan=tl.PropagateNan.ALL)
        yf = tl.maximum(yf, MASKED_LOGIT, propagate_nan=tl.PropagateNan.ALL)
    x_a = zf * scale - m_a
    e_a = tl.exp2(x_a)
    e_b = tl.exp2(yf * scale - m_b)
    if MASKED:
        e_a = tl.where(inside, e_a, 0.0)
        e_b = tl.where(inside, e_b, 0.0)
    d = zf - yf
    if WANT_AB:
        t_a += e_a * d
        if CLAMP:
            d_hi = tl.maximum(d_hi, d)
    if WANT_BA:
        t_b += e_b * d
        if CLAMP:
            d_lo = tl.minimum(d_lo, d)
    if WANT_ENT:
        w_a += e_a * x_a
    return s_a + e_a, s_b + e_b, w_a, t_a, t_b, d_hi, d_lo


@triton.jit
def _fast_sums(
    z_row,
    y_row,
    V,
    scale,
    WANT_AB: tl.constexpr,
    WANT_BA: tl.constexpr,
    WANT_ENT: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """The row's sums against a fixed offset (the first block's maxima); see the module docstring.

    Returns ``(m_a, m_b, s_a, s_b, w_a, t_a, t_b, ok)``: scalars in log2 units, ``t_b`` with the
    sign of ``sum 2^(b2 - m_b) (b2 - a2)``, and whether they hold. Where ``ok`` is False the caller
    must use :func:`_careful_sums` for this row.
    """
    cols = tl.arange(0, BLOCK_V)
    first = cols < V
    m_a = tl.max(tl.load(z_row + cols, mask=first, other=float("-inf")).to(tl.float32), axis=0)
    m_b = tl.max(tl.load(y_row + cols, mask=first, other=float("-inf")).to(tl.float32), axis=0)
    m_a = m_a * scale
    m_b = m_b * scale
    s_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    s_b = tl.zeros([BLOCK_V], dtype=tl.float32)
    w_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    t_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    t_b = tl.zeros([BLOCK_V], dtype=tl.float32)
    d_hi = tl.zeros([BLOCK_V], dtype=tl.float32)
    d_lo = tl.zeros([BLOCK_V], dtype=tl.float32)
    v_full = V - V % BLOCK_V
    for start in range(0, v_full, BLOCK_V):
        zf = tl.load(z_row + start + cols).to(tl.float32)
        yf = tl.load(y_row + start + cols).to(tl.float32)
        s_a, s_b, w_a, t_a, t_b, d_hi, d_lo = _fast_terms(
            zf, yf, first, m_a, m_b, scale, s_a, s_b, w_a, t_a, t_b, d_hi, d_lo,
            WANT_AB, WANT_BA, WANT_ENT, False, CLAMP,
        )  # fmt: skip
    if v_full < V:
        offs = v_full + cols
        inside = offs < V
        zf = tl.load(z_row + offs, mask=inside, other=0.0).to(tl.float32)
        yf = tl.load(y_row + offs, mask=inside, other=0.0).to(tl.float32)
        s_a, s_b, w_a, t_a, t_b, d_hi, d_lo = _fast_terms(
            zf, yf, inside, m_a, m_b, scale, s_a, s_b, w_a, t_a, t_b, d_hi, d_lo,
            WANT_AB, WANT_BA, WANT_ENT, True, CLAMP,
        )  # fmt: skip
    sum_a = tl.sum(s_a, axis=0)
    sum_b = tl.sum(s_b, axis=0)
    tot_w = tl.sum(w_a, axis=0)
    tot_a = tl.sum(t_a, axis=0) * scale
    tot_b = -tl.sum(t_b, axis=0) * scale
    ok = _finite(sum_a) & _finite(sum_b) & _finite(tot_a) & _finite(tot_b) & _finite(tot_w)
    # |z - y| near 2^100 is one side's -inf against the other's finite logit: a KL of +inf (or a
    # logit beyond 2^99), left to the careful loop.
    if CLAMP:
        ok = ok & (tl.max(d_hi, axis=0) < -0.5 * MASKED_LOGIT)
        ok = ok & (tl.min(d_lo, axis=0) > 0.5 * MASKED_LOGIT)
    return m_a, m_b, sum_a, sum_b, tot_w, tot_a, tot_b, ok


@triton.jit
def _careful_sums(z_row, y_row, V, scale, BLOCK_V: tl.constexpr):
    """The row's sums against a running maximum, with -inf entries selected out (module
    docstring); the same return values as :func:`_fast_sums`, every one of them computed."""
    cols = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    m_a = neg_inf
    m_b = neg_inf
    s_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    s_b = tl.zeros([BLOCK_V], dtype=tl.float32)
    w_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    t_a = tl.zeros([BLOCK_V], dtype=tl.float32)
    t_b = tl.zeros([BLOCK_V], dtype=tl.float32)

    for start in range(0, V, BLOCK_V):
        offs = start + cols
        inside = offs < V
        zf = tl.load(z_row + offs, mask=inside, other=neg_inf).to(tl.float32)
        yf = tl.load(y_row + offs, mask=inside, other=neg_inf).to(tl.float32)
        a2 = zf * scale
        b2 = yf * scale
        fin_a = a2 > neg_inf
        fin_b = b2 > neg_inf

        # New running maxima; the shift used in exp2 is 0 while a row has seen only -inf, so that
        # 2^(-inf - shift) = 0 and the rescale factor of the (all-zero) old sums is 0, not NaN.
        new_m_a = tl.maximum(m_a, tl.max(a2, axis=0))
        new_m_b = tl.maximum(m_b, tl.max(b2, axis=0))
        shift_a = tl.where(new_m_a > neg_inf, new_m_a, 0.0)
        shift_b = tl.where(new_m_b > neg_inf, new_m_b, 0.0)
        alpha_a = tl.exp2(m_a - shift_a)
        alpha_b = tl.exp2(m_b - shift_b)
        move_a = tl.where(m_a > neg_inf, m_a - shift_a, 0.0)

        e_a = tl.exp2(a2 - shift_a)
        e_b = tl.exp2(b2 - shift_b)
        # (z - y) scale, not a2 - b2: exactly 0 for equal inputs even if the compiler contracts
        # a product and a difference into one fma (and one rounding fewer).
        d = (zf - yf) * scale
        w_a = (w_a + move_a * s_a) * alpha_a + tl.where(fin_a, e_a * (a2 - shift_a), 0.0)
        s_a = s_a * alpha_a + e_a
        s_b = s_b * alpha_b + e_b
        t_a = t_a * alpha_a + tl.where(fin_a, e_a * d, 0.0)
        t_b = t_b * alpha_b - tl.where(fin_b, e_b * d, 0.0)
        m_a = new_m_a
        m_b = new_m_b
    return (
        m_a,
        m_b,
        tl.sum(s_a, axis=0),
        tl.sum(s_b, axis=0),
        tl.sum(w_a, axis=0),
        tl.sum(t_a, axis=0),
        tl.sum(t_b, axis=0),
    )


@triton.jit
def kl_logits_fwd_kernel(
    z_ptr,
    y_ptr,
    label_ptr,
    out_ptr,
    path_ptr,
    keep_ptr,
    stride_z,
    stride_y,
    N,
    V,
    scale,
    HAS_LABELS: tl.constexpr,
    RECORD_PATH: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WANT_AB: tl.constexpr,
    WANT_BA: tl.constexpr,
    WANT_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row per program. ``out`` is a contiguous ``[7, N]`` float32 buffer; the KLs and the
    entropy not asked for (``WANT_*`` False) are written as 0. With ``RECORD_PATH``, ``path`` (int32
    ``[N]``) gets the loop that gave the row: 0 fast, 1 fast with -inf clamped, 2 careful. With
    ``HAS_KEEP``, a row whose ``keep`` byte is 0 is not read: its seven outputs are 0 (path 0)."""
    row = tl.program_id(0).to(tl.int64)
    kept = True
    if HAS_KEEP:
        kept = tl.load(keep_ptr + row) != 0
    if kept:
        _fwd_row(
            z_ptr, y_ptr, label_ptr, out_ptr, path_ptr, row, stride_z, stride_y, N, V, scale,
            HAS_LABELS, RECORD_PATH, WANT_AB, WANT_BA, WANT_ENT, BLOCK_V,
        )  # fmt: skip
    else:
        for k in tl.static_range(7):
            tl.store(out_ptr + k * N + row, 0.0)
        if RECORD_PATH:
            tl.store(path_ptr + row, 0)


@triton.jit
def _fwd_row(
    z_ptr, y_ptr, label_ptr, out_ptr, path_ptr, row, stride_z, stride_y, N, V, scale,
    HAS_LABELS: tl.constexpr, RECORD_PATH: tl.constexpr, WANT_AB: tl.constexpr,
    WANT_BA: tl.constexpr, WANT_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The forward kernel's work for one row."""
    z_row = z_ptr + row * stride_z
    y_row = y_ptr + row * stride_y

    m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b, ok = _fast_sums(
        z_row, y_row, V, scale, WANT_AB, WANT_BA, WANT_ENT, False, BLOCK_V
    )
    ok_clamped = ok
    if not ok:
        m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b, ok_clamped = _fast_sums(
            z_row, y_row, V, scale, WANT_AB, WANT_BA, WANT_ENT, True, BLOCK_V
        )
        if not ok_clamped:
            m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b = _careful_sums(
                z_row, y_row, V, scale, BLOCK_V
            )
    if RECORD_PATH:
        tl.store(path_ptr + row, (~ok).to(tl.int32) + (~ok_clamped).to(tl.int32))
    _store_stats(
        z_row, y_row, label_ptr, out_ptr, row, N, V, scale, m_a, m_b, sum_a, sum_b, w_a, tot_a,
        tot_b, HAS_LABELS, WANT_AB, WANT_BA, WANT_ENT,
    )  # fmt: skip


@triton.jit
def _store_stats(
    z_row, y_row, label_ptr, out_ptr, row, N, V, scale, m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b,
    HAS_LABELS: tl.constexpr, WANT_AB: tl.constexpr, WANT_BA: tl.constexpr,
    WANT_ENT: tl.constexpr,
):  # fmt: skip
    """The row's seven statistics from its sums (module docstring), stored in ``out[:, row]``;
    returned as ``(lse_a, lse_b, kl_ab, kl_ba, entropy)`` (the ones not wanted as 0)."""
    lg_a = tl.log2(sum_a)
    lg_b = tl.log2(sum_b)
    lse_a = LN2 * (m_a + lg_a)
    lse_b = LN2 * (m_b + lg_b)
    nan_row = (lse_a != lse_a) | (lse_b != lse_b)
    common = (m_a - m_b) + (lg_a - lg_b)
    tl.store(out_ptr + row, lse_a)
    tl.store(out_ptr + N + row, lse_b)
    kl_ab = LN2 * (tot_a / sum_a - common)
    kl_ba = LN2 * (tot_b / sum_b + common)
    # Exact values are >= 0; clamp the rounding noise (the comparisons keep NaN as NaN).
    kl_ab = tl.where(kl_ab < 0.0, 0.0, kl_ab)
    kl_ba = tl.where(kl_ba < 0.0, 0.0, kl_ba)
    # A non-finite t means q has mass where p has none (see the module docstring): +inf.
    kl_ab = tl.where((tot_a != tot_a) | (tot_a == float("inf")), float("inf"), kl_ab)
    kl_ba = tl.where((tot_b != tot_b) | (tot_b == float("inf")), float("inf"), kl_ba)
    kl_ab = tl.where(nan_row, float("nan"), kl_ab)
    kl_ba = tl.where(nan_row, float("nan"), kl_ba)
    entropy = LN2 * (lg_a - w_a / sum_a)
    entropy = tl.where(entropy < 0.0, 0.0, entropy)
    zero = tl.zeros_like(lse_a)
    kl_ab = tl.where(WANT_AB, kl_ab, zero)
    kl_ba = tl.where(WANT_BA, kl_ba, zero)
    entropy = tl.where(WANT_ENT, entropy, zero)
    tl.store(out_ptr + 2 * N + row, kl_ab)
    tl.store(out_ptr + 3 * N + row, kl_ba)
    tl.store(out_ptr + 4 * N + row, entropy)
    if HAS_LABELS:
        label = tl.load(label_ptr + row)
        valid = (label >= 0) & (label < V)
        col = tl.where(valid, label, 0)
        a2_l = tl.load(z_row + col).to(tl.float32) * scale
        b2_l = tl.load(y_row + col).to(tl.float32) * scale
        logp = tl.where(valid, LN2 * ((a2_l - m_a) - lg_a), 0.0)
        logp_ref = tl.where(valid, LN2 * ((b2_l - m_b) - lg_b), 0.0)
        tl.store(out_ptr + 5 * N + row, logp)
        tl.store(out_ptr + 6 * N + row, logp_ref)
    return lse_a, lse_b, kl_ab, kl_ba, entropy


@triton.jit
def kl_logits_bwd_kernel(
    z_ptr,
    y_ptr,
    label_ptr,
    lse_a_ptr,
    lse_b_ptr,
    kl_ab_ptr,
    kl_ba_ptr,
    ent_ptr,
    g1_ptr,
    g2_ptr,
    g3_ptr,
    g4_ptr,
    g5_ptr,
    dz_ptr,
    dy_ptr,
    keep_ptr,
    stride_z,
    stride_y,
    stride_dz,
    stride_dy,
    V,
    scale,
    inv_tau,
    HAS_G1: tl.constexpr,
    HAS_G2: tl.constexpr,
    HAS_G3: tl.constexpr,
    HAS_G4: tl.constexpr,
    HAS_G5: tl.constexpr,
    NEED_DZ: tl.constexpr,
    NEED_DY: tl.constexpr,
    USE_Z: tl.constexpr,
    USE_Y: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program ``(row, block)``. The row statistics and ``g*`` are float32 ``[N]``. With
    ``HAS_KEEP``, a row whose ``keep`` byte is 0 is not read and gets zero gradients."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = offs < V
    kept = True
    if HAS_KEEP:
        kept = tl.load(keep_ptr + row) != 0
    if kept:
        neg_inf = float("-inf")
        zf = tl.zeros([BLOCK_V], dtype=tl.float32)
        yf = tl.zeros([BLOCK_V], dtype=tl.float32)
        if USE_Z:
            zf = tl.load(z_ptr + row * stride_z + offs, mask=inside, other=neg_inf).to(tl.float32)
        if USE_Y:
            yf = tl.load(y_ptr + row * stride_y + offs, mask=inside, other=neg_inf).to(tl.float32)
        dz, dy = grad_values(
            zf, yf, offs, row, label_ptr, tl.load(lse_a_ptr + row), tl.load(lse_b_ptr + row),
            tl.load(kl_ab_ptr + row), tl.load(kl_ba_ptr + row), tl.load(ent_ptr + row),
            g1_ptr, g2_ptr, g3_ptr, g4_ptr, g5_ptr, scale, inv_tau,
            HAS_G1, HAS_G2, HAS_G3, HAS_G4, HAS_G5, NEED_DZ, NEED_DY, USE_Z, USE_Y, BLOCK_V,
        )  # fmt: skip
        if NEED_DZ:
            tl.store(dz_ptr + row * stride_dz + offs, dz.to(dz_ptr.dtype.element_ty), mask=inside)
        if NEED_DY:
            tl.store(dy_ptr + row * stride_dy + offs, dy.to(dy_ptr.dtype.element_ty), mask=inside)
    else:
        store_zero_grads(
            dz_ptr, dy_ptr, row, offs, inside, stride_dz, stride_dy, NEED_DZ, NEED_DY, BLOCK_V
        )


@triton.jit
def grad_values(
    zf, yf, offs, row, label_ptr, lse_a, lse_b, kl_ab, kl_ba, ent,
    g1_ptr, g2_ptr, g3_ptr, g4_ptr, g5_ptr, scale, inv_tau,
    HAS_G1: tl.constexpr, HAS_G2: tl.constexpr, HAS_G3: tl.constexpr, HAS_G4: tl.constexpr,
    HAS_G5: tl.constexpr, NEED_DZ: tl.constexpr, NEED_DY: tl.constexpr, USE_Z: tl.constexpr,
    USE_Y: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """``(dz, dy)`` of one block (float32; module docstring) from its logits ``zf``, ``yf``
    (``-inf`` past ``V``; either unused unless ``USE_Z`` / ``USE_Y``), the row's statistics and
    the row's upstream gradients ``g*`` (read at ``row``). Zeros where not ``NEED_*``."""
    neg_inf = float("-inf")
    big = 3.0e38
    q = tl.zeros([BLOCK_V], dtype=tl.float32)
    p = tl.zeros([BLOCK_V], dtype=tl.float32)
    la2 = tl.zeros([BLOCK_V], dtype=tl.float32)
    d = tl.zeros([BLOCK_V], dtype=tl.float32)
    d_lse = 0.0
    fin_a = zf > neg_inf
    fin_b = yf > neg_inf
    if USE_Z:
        la2 = zf * scale - lse_a * LOG2E  # log2 q
        q = tl.exp2(la2)
    if USE_Y:
        p = tl.exp2(yf * scale - lse_b * LOG2E)
    if USE_Z and USE_Y:
        # a2 - b2, kept finite so that a zero coefficient times it is 0 on a row whose KL is +inf.
        d = tl.minimum(tl.maximum((zf - yf) * scale, -big), big)
        d_lse = (lse_a - lse_b) * LOG2E
    counted = False
    onehot = tl.zeros([BLOCK_V], dtype=tl.float32)
    if HAS_G4 or HAS_G5:
        label = tl.load(label_ptr + row)
        # label < 0: ignored, no gradient. label >= V: a token of another vocabulary shard, whose
        # log-prob still depends on this shard through the normalizer: -g q here (onehot is 0).
        counted = label >= 0
        onehot = (offs == label).to(tl.float32)

    dz = tl.zeros([BLOCK_V], dtype=tl.float32)
    if NEED_DZ:
        # Everything multiplied by q, in log2 units (times ln2 / tau below).
        bracket = tl.zeros([BLOCK_V], dtype=tl.float32)
        if HAS_G1:
            g1 = tl.load(g1_ptr + row)
            kl_ab_term = tl.where(g1 != 0.0, d_lse + kl_ab * LOG2E, 0.0)
            bracket += g1 * (d - kl_ab_term)
        if HAS_G3:
            g3 = tl.load(g3_ptr + row)
            bracket -= g3 * (la2 + ent * LOG2E)
        if HAS_G1 or HAS_G3:
            dz += LN2 * tl.where(fin_a, q * bracket, 0.0)
        if HAS_G2:
            g2 = tl.load(g2_ptr + row)
            dz += g2 * (q - p)
        if HAS_G4:
            g4 = tl.where(counted, tl.load(g4_ptr + row), 0.0)
            dz += g4 * (onehot - q)
        dz = dz * inv_tau

    dy = tl.zeros([BLOCK_V], dtype=tl.float32)
    if NEED_DY:
        if HAS_G1:
            g1 = tl.load(g1_ptr + row)
            dy += g1 * (p - q)
        if HAS_G2:
            g2 = tl.load(g2_ptr + row)
            kl_ba_term = tl.where(g2 != 0.0, kl_ba * LOG2E - d_lse, 0.0)
            dy += (LN2 * g2) * tl.where(fin_b, p * (-d - kl_ba_term), 0.0)
        if HAS_G5:
            g5 = tl.where(counted, tl.load(g5_ptr + row), 0.0)
            dy += g5 * (onehot - p)
        dy = dy * inv_tau
    return dz, dy


# -- forward with the gradient -------------------------------------------------------------------


@triton.jit
def block_sums(zf, yf, scale):
    """The sums of a row held in one block (``zf``, ``yf``: ``-inf`` past ``V``) against its own
    maximum, ``-inf`` entries selected out: :func:`_careful_sums` in one step, same returns."""
    neg_inf = float("-inf")
    a2 = zf * scale
    b2 = yf * scale
    fin_a = a2 > neg_inf
    fin_b = b2 > neg_inf
    m_a = tl.max(a2, axis=0)
    m_b = tl.max(b2, axis=0)
    shift_a = tl.where(m_a > neg_inf, m_a, 0.0)
    shift_b = tl.where(m_b > neg_inf, m_b, 0.0)
    e_a = tl.exp2(a2 - shift_a)
    e_b = tl.exp2(b2 - shift_b)
    d = (zf - yf) * scale
    w_a = tl.sum(tl.where(fin_a, e_a * (a2 - shift_a), 0.0), axis=0)
    t_a = tl.sum(tl.where(fin_a, e_a * d, 0.0), axis=0)
    t_b = -tl.sum(tl.where(fin_b, e_b * d, 0.0), axis=0)
    return m_a, m_b, tl.sum(e_a, axis=0), tl.sum(e_b, axis=0), w_a, t_a, t_b


@triton.jit
def kl_logits_fused_kernel(
    z_ptr, y_ptr, label_ptr, out_ptr, keep_ptr, g1_ptr, g2_ptr, g3_ptr, g4_ptr, g5_ptr,
    dz_ptr, dy_ptr, stride_z, stride_y, stride_dz, stride_dy, N, V, scale, inv_tau,
    HAS_LABELS: tl.constexpr, HAS_KEEP: tl.constexpr, WANT_AB: tl.constexpr,
    WANT_BA: tl.constexpr, WANT_ENT: tl.constexpr, HAS_G1: tl.constexpr, HAS_G2: tl.constexpr,
    HAS_G3: tl.constexpr, HAS_G4: tl.constexpr, HAS_G5: tl.constexpr, NEED_DZ: tl.constexpr,
    NEED_DY: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The forward kernel and the gradient of ``sum_n g1 KL(q||p) + g2 KL(p||q) + g3 H +
    g4 log q_l + g5 log p_l`` (``g*``: per-row coefficients, known before the call) in one
    launch. Rows are taken in turn by ``num_programs`` programs (``row = pid, pid + P, ...``):
    each row's statistics (as :func:`kl_logits_fwd_kernel`, into ``out`` ``[7, N]``), then its
    gradients (as :func:`kl_logits_bwd_kernel`). ``ONE_BLOCK`` (``V <= BLOCK_V``): the row is
    read once and both come from the registers; otherwise the gradient loop reads the row's
    blocks again right after the statistics loop (a read that a cache holding the rows in
    flight serves). Rows whose ``keep`` byte is 0 are not read: zero statistics and gradients."""
    cols = tl.arange(0, BLOCK_V)
    zero64 = tl.program_id(0).to(tl.int64) * 0
    for row32 in range(tl.program_id(0), N, tl.num_programs(0)):
        row = row32 + zero64  # 64-bit offsets (row * stride can pass 2^31)
        kept = True
        if HAS_KEEP:
            kept = tl.load(keep_ptr + row) != 0
        if kept:
            _fused_row(
                z_ptr, y_ptr, label_ptr, out_ptr, g1_ptr, g2_ptr, g3_ptr, g4_ptr, g5_ptr, dz_ptr,
                dy_ptr, row, stride_z, stride_y, stride_dz, stride_dy, N, V, scale, inv_tau,
                HAS_LABELS, WANT_AB, WANT_BA, WANT_ENT, HAS_G1, HAS_G2, HAS_G3, HAS_G4, HAS_G5,
                NEED_DZ, NEED_DY, ONE_BLOCK, BLOCK_V,
            )  # fmt: skip
        else:
            for k in tl.static_range(7):
                tl.store(out_ptr + k * N + row, 0.0)
            for start in range(0, V, BLOCK_V):
                offs = start + cols
                store_zero_grads(
                    dz_ptr, dy_ptr, row, offs, offs < V, stride_dz, stride_dy, NEED_DZ, NEED_DY,
                    BLOCK_V,
                )  # fmt: skip


@triton.jit
def _fused_row(
    z_ptr, y_ptr, label_ptr, out_ptr, g1_ptr, g2_ptr, g3_ptr, g4_ptr, g5_ptr, dz_ptr, dy_ptr,
    row, stride_z, stride_y, stride_dz, stride_dy, N, V, scale, inv_tau,
    HAS_LABELS: tl.constexpr, WANT_AB: tl.constexpr, WANT_BA: tl.constexpr,
    WANT_ENT: tl.constexpr, HAS_G1: tl.constexpr, HAS_G2: tl.constexpr, HAS_G3: tl.constexpr,
    HAS_G4: tl.constexpr, HAS_G5: tl.constexpr, NEED_DZ: tl.constexpr, NEED_DY: tl.constexpr,
    ONE_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """The fused kernel's work for one row."""
    z_row = z_ptr + row * stride_z
    y_row = y_ptr + row * stride_y
    dz_row = dz_ptr + row * stride_dz
    dy_row = dy_ptr + row * stride_dy
    cols = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    if ONE_BLOCK:
        inside = cols < V
        zf = tl.load(z_row + cols, mask=inside, other=neg_inf).to(tl.float32)
        yf = tl.load(y_row + cols, mask=inside, other=neg_inf).to(tl.float32)
        m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b = block_sums(zf, yf, scale)
    else:
        m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b, ok = _fast_sums(
            z_row, y_row, V, scale, WANT_AB, WANT_BA, WANT_ENT, False, BLOCK_V
        )
        if not ok:
            m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b, ok = _fast_sums(
                z_row, y_row, V, scale, WANT_AB, WANT_BA, WANT_ENT, True, BLOCK_V
            )
            if not ok:
                m_a, m_b, sum_a, sum_b, w_a, tot_a, tot_b = _careful_sums(
                    z_row, y_row, V, scale, BLOCK_V
                )
    # (The launcher asks for every sum that a coefficient's gradient needs.)
    lse_a, lse_b, kl_ab, kl_ba, ent = _store_stats(
        z_row, y_row, label_ptr, out_ptr, row, N, V, scale, m_a, m_b, sum_a, sum_b, w_a, tot_a,
        tot_b, HAS_LABELS, WANT_AB, WANT_BA, WANT_ENT,
    )  # fmt: skip
    use_z = NEED_DZ or (NEED_DY and (HAS_G1 or HAS_G2))
    use_y = NEED_DY or (NEED_DZ and (HAS_G1 or HAS_G2))
    if ONE_BLOCK:
        dz, dy = grad_values(
            zf, yf, cols, row, label_ptr, lse_a, lse_b, kl_ab, kl_ba, ent, g1_ptr, g2_ptr,
            g3_ptr, g4_ptr, g5_ptr, scale, inv_tau, HAS_G1, HAS_G2, HAS_G3, HAS_G4, HAS_G5,
            NEED_DZ, NEED_DY, use_z, use_y, BLOCK_V,
        )  # fmt: skip
        if NEED_DZ:
            tl.store(dz_row + cols, dz.to(dz_ptr.dtype.element_ty), mask=inside)
        if NEED_DY:
            tl.store(dy_row + cols, dy.to(dy_ptr.dtype.element_ty), mask=inside)
    else:
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            inside = offs < V
            zf = tl.load(z_row + offs, mask=inside, other=neg_inf).to(tl.float32)
            yf = tl.load(y_row + offs, mask=inside, other=neg_inf).to(tl.float32)
            dz, dy = grad_values(
                zf, yf, offs, row, label_ptr, lse_a, lse_b, kl_ab, kl_ba, ent, g1_ptr, g2_ptr,
                g3_ptr, g4_ptr, g5_ptr, scale, inv_tau, HAS_G1, HAS_G2, HAS_G3, HAS_G4, HAS_G5,
                NEED_DZ, NEED_DY, use_z, use_y, BLOCK_V,
            )  # fmt: skip
            if NEED_DZ:
                tl.store(dz_row + offs, dz.to(dz_ptr.dtype.element_ty), mask=inside)
            if NEED_DY:
                tl.store(dy_row + offs, dy.to(dy_ptr.dtype.element_ty), mask=inside)
