r"""Exact full-vocabulary KL between two sets of logits, with Triton kernels (GPU).

For pi's logits ``z`` and ref's logits ``y`` (both ``[N, V]``) and a temperature :math:`\tau`, with
:math:`a = z/\tau`, :math:`b = y/\tau`, :math:`q = \mathrm{softmax}(a)` (pi) and
:math:`p = \mathrm{softmax}(b)` (ref), one streaming pass over the vocabulary (sums of
exponentials against the first block's maximum, float32 accumulation; a row that overflows that
offset or holds non-finite entries is re-read with a running maximum) gives per row

.. math::
    KL(\pi\|ref) = \sum_v q_v (\log q_v - \log p_v), \quad
    KL(ref\|\pi) = \sum_v p_v (\log p_v - \log q_v), \quad
    H(\pi) = -\sum_v q_v \log q_v,

the log-normalizers and, optionally, the label log-probabilities :math:`a_l - \mathrm{lse}(a)` and
:math:`b_l - \mathrm{lse}(b)`. The backward pass reads ``z`` and ``y`` once more and writes the
gradients in the inputs' dtypes:

.. math::
    \partial/\partial z = \tfrac{1}{\tau}\big[g_1\, q\odot(\log q - \log p - KL(\pi\|ref))
        + g_2 (q - p) - g_3\, q\odot(\log q + H) + g_4 (e_l - q)\big], \\
    \partial/\partial y = \tfrac{1}{\tau}\big[g_1 (p - q)
        + g_2\, p\odot(\log p - \log q - KL(ref\|\pi)) + g_5 (e_l - p)\big],

with upstream gradients :math:`g_1..g_5` of the five per-row outputs.

This module imports without triton; :func:`triton_available` says whether the kernels can run
(triton importable, and CUDA present or ``TRITON_INTERPRET=1``, which runs them on CPU tensors).
The memory-bounded autograd path that calls these kernels is :mod:`klest.logits.from_logits`.

Caller's contract (not checked here: a check would cost a device synchronisation):
  * no NaN or ``+inf`` logits (a row that has them gives NaN everywhere);
  * no row entirely ``-inf`` (it has no distribution; its outputs are NaN).
``-inf`` entries are otherwise fine: they are outside the support (``0 log 0 = 0``), and mass of
one distribution where the other has none makes that KL ``+inf`` (never NaN).
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import Tensor

from klest._checks import check_int_ids, check_row_vector, check_temperature
from klest.logits._stats import KLRowStats
from klest.logits.kernels._launch import (
    MAX_GRID_Y,
    cdiv,
    check_device,
    check_grad_buffer,
    check_keep,
    check_logits,
    check_programs,
    interpreting,
    resolve_block_v,
    resolve_fused_launch,
    resolve_num_warps,
    triton_importable,
)

__all__ = ["kl_logits_backward", "kl_logits_forward", "kl_logits_fused", "triton_available"]

_GRAD_NAMES = (
    "grad_kl_pi_ref",
    "grad_kl_ref_pi",
    "grad_entropy",
    "grad_logp_label",
    "grad_logp_ref_label",
)


def triton_available() -> bool:
    """Whether the Triton kernels can run here: triton imports, and CUDA is available or
    ``TRITON_INTERPRET=1`` (triton's CPU interpreter, for tests)."""
    return triton_importable() and (torch.cuda.is_available() or interpreting())


def _kernels() -> ModuleType:
    if not triton_importable():
        raise RuntimeError(
            "klest.logits.kernels needs triton, which is not installed; use "
            "kl_from_logits(..., backend='torch')"
        )
    from klest.logits.kernels import _kl_logits_triton

    return _kl_logits_triton


def _check_labels(labels: object, n: int, device: torch.device) -> Tensor | None:
    if labels is None:
        return None
    labels = check_int_ids("labels", labels, torch.Size((n,)), device, of="the rows of z")
    return labels.to(torch.int64).contiguous()


def kl_logits_forward(
    z: Tensor,
    y: Tensor,
    *,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    want_kl_pi_ref: bool = True,
    want_kl_ref_pi: bool = True,
    want_entropy: bool = True,
    block_v: int | None = None,
    num_warps: int | None = None,
    careful_rows: Tensor | None = None,
    keep: Tensor | None = None,
) -> KLRowStats:
    r"""Both KLs, pi's entropy, the log-normalizers and label log-probs, in one pass.

    With :math:`a = z/\tau`, :math:`b = y/\tau`, :math:`q = \mathrm{softmax}(a)` (pi),
    :math:`p = \mathrm{softmax}(b)` (ref), each row gets :math:`\mathrm{lse}(a)`,
    :math:`\mathrm{lse}(b)`, :math:`KL(q\|p)`, :math:`KL(p\|q)`, :math:`H(q)` and
    :math:`a_l - \mathrm{lse}(a)`, :math:`b_l - \mathrm{lse}(b)` for the row's label :math:`l`.
    The kernel reads ``z`` and ``y`` once: float32 sums of ``exp`` against the maximum of the
    row's first vocabulary block, with nothing per element but the terms the asked-for sums need.
    A row where that fails (a later maximum ~87 nats higher overflows; ``-inf``, NaN or ``+inf``
    entries) is detected by its non-finite sums and re-read once with a running maximum (online
    softmax, ``-inf`` selected out). Nothing ``V``-sized is written.

    No gradient is recorded: :func:`kl_logits_backward` gives the gradients
    (:mod:`klest.logits.from_logits` wraps both in an ``autograd.Function``).

    Args:
      z: pi's logits ``[N, V]``, float32 / bfloat16 / float16, CUDA (or CPU under
        ``TRITON_INTERPRET=1``). Any row stride; the last dimension is made contiguous.
      y: ref's logits, same shape and device; its dtype may differ from ``z``'s.
      temperature: :math:`\tau > 0`, dividing both logits.
      labels: optional int ``[N]`` token ids. A negative label (an ignore index such as -100)
        gives log-probs 0 and no gradient. A label ``>= V`` means a token of another vocabulary
        shard (vocab-parallel): log-probs 0 here, and in the backward only the ``-g q`` part of
        its gradient ``g (e_l - q)`` (``e_l`` lives on the shard that holds the token; pass the
        global ``lse`` in ``stats``). Single-device callers should not pass labels ``>= V``.
      want_kl_pi_ref: accumulate KL(pi||ref); a sum not wanted costs nothing and is returned
        as 0 (the log-normalizers and label log-probs are always computed).
      want_kl_ref_pi: accumulate KL(ref||pi).
      want_entropy: accumulate H(pi).
      block_v: vocabulary block (power of two, >= 16); default ``min(1024, next_pow2(V))``.
      num_warps: warps per row's program (power of two, 1 to 32); default ``block_v / 256``
        clipped to [1, 16] (for launch sweeps such as ``benchmarks/gpu_tune.py``).
      careful_rows: optional int32 ``[N]`` tensor on ``z``'s device, filled with the loop that
        gave each row: 0 the fast loop, 1 its re-read with ``-inf`` clamped, 2 the careful loop
        (for tests and benchmarks).
      keep: optional bool ``[N]`` on ``z``'s device: rows where it is False are not read and get
        0 for every statistic (masked positions, with no host read to find them; their logits
        may hold anything).

    Returns:
      :class:`KLRowStats`, every field float32 ``[N]``. KLs are ``+inf`` where one distribution
      has mass where the other has none; a label whose logit is ``-inf`` has log-prob ``-inf``.
      KLs and the entropy are clamped at 0 (their float32 rounding can dip below); equal inputs
      give KLs of exactly 0.
      Rows with NaN / ``+inf`` logits, or entirely ``-inf``, are the caller's to reject (NaN).
    """
    z, y = check_logits(z, y)
    tau = check_temperature(temperature)
    n, v = z.shape
    labels = _check_labels(labels, n, z.device)
    bv = resolve_block_v(block_v, v)
    warps = resolve_num_warps(num_warps, bv)
    if careful_rows is not None and not (
        isinstance(careful_rows, Tensor)
        and careful_rows.dtype == torch.int32
        and careful_rows.shape == (n,)
        and careful_rows.device == z.device
        and careful_rows.is_contiguous()
    ):
        raise TypeError(
            f"careful_rows must be a contiguous int32 tensor of shape ({n},) on {z.device}"
        )
    keep = check_keep(keep, n, z.device)
    out = torch.empty(7, n, dtype=torch.float32, device=z.device)
    if labels is None:
        out[5:].zero_()
    if n > 0:
        check_device(z)
        _kernels().kl_logits_fwd_kernel[(n,)](
            z,
            y,
            out if labels is None else labels,  # unused when HAS_LABELS is False
            out,
            out if careful_rows is None else careful_rows,
            out if keep is None else keep,
            z.stride(0),
            y.stride(0),
            n,
            v,
            math.log2(math.e) / tau,
            HAS_LABELS=labels is not None,
            RECORD_PATH=careful_rows is not None,
            HAS_KEEP=keep is not None,
            WANT_AB=bool(want_kl_pi_ref),
            WANT_BA=bool(want_kl_ref_pi),
            WANT_ENT=bool(want_entropy),
            BLOCK_V=bv,
            num_warps=warps,
        )
    return KLRowStats(*out.unbind(0))


def kl_logits_backward(
    z: Tensor,
    y: Tensor,
    stats: KLRowStats,
    *,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    grad_kl_pi_ref: Tensor | None = None,
    grad_kl_ref_pi: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    grad_logp_label: Tensor | None = None,
    grad_logp_ref_label: Tensor | None = None,
    need_grad_z: bool = True,
    need_grad_y: bool = False,
    block_v: int | None = None,
    num_warps: int | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    r"""Gradients of :math:`\sum_n [g_1 KL(\pi\|ref) + g_2 KL(ref\|\pi) + g_3 H + g_4 \log q_l +
    g_5 \log p_l]_n` with respect to ``z`` and ``y``.

    .. math::
        \partial/\partial z = \tfrac{1}{\tau}\big[g_1\, q\odot(\log q - \log p - KL(\pi\|ref))
            + g_2 (q - p) - g_3\, q\odot(\log q + H) + g_4 (e_l - q)\big]

        \partial/\partial y = \tfrac{1}{\tau}\big[g_1 (p - q)
            + g_2\, p\odot(\log p - \log q - KL(ref\|\pi)) + g_5 (e_l - p)\big]

    ``q`` and ``p`` are recomputed from ``stats.lse_z`` / ``stats.lse_y``: the kernel reads ``z``
    and ``y`` once and writes ``dz`` / ``dy`` once (grid: rows x vocabulary blocks).

    Args:
      z: pi's logits, as given to :func:`kl_logits_forward`.
      y: ref's logits, as given to :func:`kl_logits_forward`.
      stats: what :func:`kl_logits_forward` returned for them; only ``lse_z``, ``lse_y``,
        ``kl_pi_ref``, ``kl_ref_pi`` and ``entropy`` are read. For a shard of a vocabulary-parallel
        row, pass the statistics of the whole row: the gradient of each shard is then exact.
      temperature: as given to :func:`kl_logits_forward`.
      labels: as given to :func:`kl_logits_forward`.
      grad_kl_pi_ref: :math:`g_1`, the upstream gradient of KL(pi||ref), float ``[N]`` (made
        float32), or None for no such term. A zero upstream gradient drops its term exactly,
        even on a row where that KL is ``+inf``; a non-zero one on such a row gives an undefined
        (possibly inf / NaN) gradient, as the gradient does not exist. The same for the others.
      grad_kl_ref_pi: :math:`g_2`, of KL(ref||pi).
      grad_entropy: :math:`g_3`, of H(pi).
      grad_logp_label: :math:`g_4`, of the label log-prob under pi (needs ``labels``).
      grad_logp_ref_label: :math:`g_5`, of the label log-prob under ref (needs ``labels``).
      need_grad_z: compute the gradient w.r.t. ``z``.
      need_grad_y: compute the gradient w.r.t. ``y``.
      block_v: vocabulary block of the backward grid (power of two, >= 16).
      num_warps: warps per program, as in :func:`kl_logits_forward`.
      keep: as in :func:`kl_logits_forward`: rows where it is False are not read and get zero
        gradients.

    Returns:
      ``(dz, dy)``: contiguous ``[N, V]`` tensors in ``z``'s and ``y``'s dtypes (zeros where no
      term reaches them), or None where not needed.
    """
    z, y = check_logits(z, y)
    tau = check_temperature(temperature)
    n, v = z.shape
    dev = z.device
    labels = _check_labels(labels, n, dev)
    bv = resolve_block_v(block_v, v)
    warps = resolve_num_warps(num_warps, bv)
    if not isinstance(stats, tuple) or len(stats) != len(KLRowStats._fields):
        raise TypeError("stats must be the KLRowStats returned by kl_logits_forward")
    stats = KLRowStats(*stats)
    lse_z = check_row_vector("stats.lse_z", stats.lse_z, n, dev)
    lse_y = check_row_vector("stats.lse_y", stats.lse_y, n, dev)
    kl_ab = check_row_vector("stats.kl_pi_ref", stats.kl_pi_ref, n, dev)
    kl_ba = check_row_vector("stats.kl_ref_pi", stats.kl_ref_pi, n, dev)
    ent = check_row_vector("stats.entropy", stats.entropy, n, dev)
    given = (grad_kl_pi_ref, grad_kl_ref_pi, grad_entropy, grad_logp_label, grad_logp_ref_label)
    g = _check_grads(given, labels, n, dev)
    g1, g2, g3, g4, g5 = g
    keep = check_keep(keep, n, dev)

    run_dz = bool(need_grad_z) and any(t is not None for t in (g1, g2, g3, g4))
    run_dy = bool(need_grad_y) and any(t is not None for t in (g1, g2, g5))
    both_sides = g1 is not None or g2 is not None
    if cdiv(v, bv) > MAX_GRID_Y:
        raise ValueError(
            f"V = {v} needs {cdiv(v, bv)} blocks of block_v = {bv}, over the grid limit "
            f"{MAX_GRID_Y}; use a larger block_v"
        )
    dz = torch.empty_like(z, memory_format=torch.contiguous_format) if run_dz else None
    dy = torch.empty_like(y, memory_format=torch.contiguous_format) if run_dy else None
    if n > 0 and (run_dz or run_dy):
        check_device(z)
        dummy = lse_z
        _kernels().kl_logits_bwd_kernel[(n, cdiv(v, bv))](
            z,
            y,
            dummy if labels is None else labels,
            lse_z,
            lse_y,
            kl_ab,
            kl_ba,
            ent,
            *(dummy if t is None else t for t in g),
            dummy if dz is None else dz,
            dummy if dy is None else dy,
            dummy if keep is None else keep,
            z.stride(0),
            y.stride(0),
            v if dz is None else dz.stride(0),
            v if dy is None else dy.stride(0),
            v,
            math.log2(math.e) / tau,
            1.0 / tau,
            HAS_G1=g1 is not None,
            HAS_G2=g2 is not None,
            HAS_G3=run_dz and g3 is not None,
            HAS_G4=run_dz and g4 is not None,
            HAS_G5=run_dy and g5 is not None,
            NEED_DZ=run_dz,
            NEED_DY=run_dy,
            USE_Z=run_dz or (run_dy and both_sides),
            USE_Y=run_dy or (run_dz and both_sides),
            HAS_KEEP=keep is not None,
            BLOCK_V=bv,
            num_warps=warps,
        )
    if need_grad_z and dz is None:
        dz = torch.zeros_like(z, memory_format=torch.contiguous_format)
    if need_grad_y and dy is None:
        dy = torch.zeros_like(y, memory_format=torch.contiguous_format)
    return (dz if need_grad_z else None), (dy if need_grad_y else None)


def _check_grads(
    given: tuple[Tensor | None, ...], labels: Tensor | None, n: int, dev: torch.device
) -> list[Tensor | None]:
    g = [
        None if t is None else check_row_vector(nm, t, n, dev)
        for nm, t in zip(_GRAD_NAMES, given, strict=True)
    ]
    if labels is None and (g[3] is not None or g[4] is not None):
        raise ValueError("grad_logp_label / grad_logp_ref_label need the labels they refer to")
    return g


def kl_logits_fused(
    z: Tensor,
    y: Tensor,
    *,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    grad_kl_pi_ref: Tensor | None = None,
    grad_kl_ref_pi: Tensor | None = None,
    grad_entropy: Tensor | None = None,
    grad_logp_label: Tensor | None = None,
    grad_logp_ref_label: Tensor | None = None,
    need_grad_z: bool = True,
    need_grad_y: bool = False,
    want_kl_pi_ref: bool = True,
    want_kl_ref_pi: bool = True,
    want_entropy: bool = True,
    dz: Tensor | None = None,
    dy: Tensor | None = None,
    keep: Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
) -> tuple[KLRowStats, Tensor | None, Tensor | None]:
    r""":func:`kl_logits_forward` and :func:`kl_logits_backward` in one launch, for upstream
    gradients known before the call (a reduction's weights, a loss's coefficients).

    Per row: the statistics of :func:`kl_logits_forward`, then the gradients of
    :math:`\sum_n [g_1 KL(\pi\|ref) + g_2 KL(ref\|\pi) + g_3 H + g_4 \log q_l +
    g_5 \log p_l]_n` with respect to ``z`` and ``y`` (the formulas of
    :func:`kl_logits_backward`), from the statistics the row just got. Memory traffic: a row of
    at most ``block_v`` entries (by default ``V <= 16384``) is read once, both results from the
    same registers (2 passes over ``[N, V]`` plus one write of each gradient); a longer row's
    blocks are read again right after its statistics (from a cache that holds the rows in
    flight, else from memory: ``programs`` sets how many rows are in flight). The result is that
    of the two kernels, up to float32 rounding (one-block rows take the running-maximum sums).

    Args:
      z: pi's logits ``[N, V]``, as for :func:`kl_logits_forward`.
      y: ref's logits.
      temperature: :math:`\tau > 0`.
      labels: as for :func:`kl_logits_forward`.
      grad_kl_pi_ref: :math:`g_1` per row, float ``[N]``, or None; a zero drops its term
        exactly (even where that KL is ``+inf``).
      grad_kl_ref_pi: :math:`g_2`.
      grad_entropy: :math:`g_3`.
      grad_logp_label: :math:`g_4` (needs ``labels``).
      grad_logp_ref_label: :math:`g_5` (needs ``labels``).
      need_grad_z: write the gradient w.r.t. ``z``.
      need_grad_y: write the gradient w.r.t. ``y``.
      want_kl_pi_ref: as for :func:`kl_logits_forward` (computed anyway when ``g_1`` or the
        gradient needs it).
      want_kl_ref_pi: as for :func:`kl_logits_forward`.
      want_entropy: as for :func:`kl_logits_forward`.
      dz: where to write the gradient w.r.t. ``z`` (``[N, V]``, contiguous rows), e.g. ``z``
        itself (each row is read before it is written); default a new tensor like ``z``.
      dy: the same for ``y``.
      keep: as for :func:`kl_logits_forward`; rows not kept get zero statistics and gradients.
      block_v: vocabulary block (power of two); ``>= V`` reads each row once.
      num_warps: warps per program.
      programs: programs launched (each takes rows ``pid, pid + programs, ...``); default one
        per row.

    Returns:
      ``(stats, dz, dy)``: the :class:`KLRowStats` of :func:`kl_logits_forward` and the
      gradients in ``z``'s / ``y``'s dtype (None where not needed).
    """
    z, y = check_logits(z, y)
    tau = check_temperature(temperature)
    n, v = z.shape
    dev = z.device
    labels = _check_labels(labels, n, dev)
    given = (grad_kl_pi_ref, grad_kl_ref_pi, grad_entropy, grad_logp_label, grad_logp_ref_label)
    g = _check_grads(given, labels, n, dev)
    g1, g2, g3, g4, g5 = g
    keep = check_keep(keep, n, dev)
    bv, warps, one_block = resolve_fused_launch(block_v, num_warps, v)
    grid = check_programs(programs, n)
    run_dz = bool(need_grad_z)
    run_dy = bool(need_grad_y)
    reads = (z, y)
    if run_dz:
        dz = (
            torch.empty_like(z, memory_format=torch.contiguous_format)
            if dz is None
            else check_grad_buffer("dz", dz, z, reads)
        )
    if run_dy:
        dy = (
            torch.empty_like(y, memory_format=torch.contiguous_format)
            if dy is None
            else check_grad_buffer("dy", dy, y, reads)
        )
    out = torch.empty(7, n, dtype=torch.float32, device=dev)
    if labels is None:
        out[5:].zero_()
    if n > 0:
        check_device(z)
        dummy = out
        _kernels().kl_logits_fused_kernel[(grid,)](
            z, y, dummy if labels is None else labels, out, dummy if keep is None else keep,
            *(dummy if t is None else t for t in g),
            dz if run_dz else dummy, dy if run_dy else dummy,
            z.stride(0), y.stride(0), dz.stride(0) if run_dz else v, dy.stride(0) if run_dy else v,
            n, v, math.log2(math.e) / tau, 1.0 / tau,
            HAS_LABELS=labels is not None, HAS_KEEP=keep is not None,
            WANT_AB=bool(want_kl_pi_ref) or g1 is not None,
            WANT_BA=bool(want_kl_ref_pi) or g2 is not None,
            WANT_ENT=bool(want_entropy) or g3 is not None,
            HAS_G1=g1 is not None, HAS_G2=g2 is not None,
            HAS_G3=run_dz and g3 is not None, HAS_G4=run_dz and g4 is not None,
            HAS_G5=run_dy and g5 is not None, NEED_DZ=run_dz, NEED_DY=run_dy,
            ONE_BLOCK=one_block, BLOCK_V=bv, num_warps=warps,
        )  # fmt: skip
    stats = KLRowStats(*out.unbind(0))
    if not want_kl_pi_ref and g1 is not None:  # computed for the gradient, not asked for
        stats = stats._replace(kl_pi_ref=torch.zeros_like(stats.kl_pi_ref))
    if not want_kl_ref_pi and g2 is not None:
        stats = stats._replace(kl_ref_pi=torch.zeros_like(stats.kl_ref_pi))
    if not want_entropy and g3 is not None:
        stats = stats._replace(entropy=torch.zeros_like(stats.entropy))
    return stats, (dz if run_dz else None), (dy if run_dy else None)
