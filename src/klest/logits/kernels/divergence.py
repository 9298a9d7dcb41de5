r"""Triton kernels (GPU) for the generalized JSD, skew KL and total variation from logits.

For pi's logits ``z`` and ref's logits ``y`` (``[N, V]``), :math:`q = \mathrm{softmax}(z/\tau)`,
:math:`p = \mathrm{softmax}(y/\tau)` and a :class:`~klest.logits._stats.Divergence`
(:math:`c_q KL(q\|m) + c_p KL(p\|m)` with :math:`m = w p + (1-w) q`, or
:math:`TV = \tfrac12\sum_v |q_v - p_v|`), :func:`divergence_forward` gives per row the value and
the two sums :math:`S_q = \langle q, G_q\rangle`, :math:`S_p = \langle p, G_p\rangle` that the
backward needs, and :func:`divergence_backward` writes

.. math::
    \partial/\partial z = \tfrac{g}{\tau}\, q\odot(G_q - S_q), \qquad
    \partial/\partial y = \tfrac{g}{\tau}\, p\odot(G_p - S_p)

(:math:`G_q`, :math:`G_p`: the gradients with respect to the probabilities, in
:mod:`klest.logits._divergence_rows`). Both take the rows' log-normalizers from
:func:`klest.logits.kernels.kl_logits_forward` (one more read of the logits): the forward reads
``z`` and ``y`` twice in all, the backward once, writing each gradient once. The caller's
contract is that of :mod:`klest.logits.kernels.kl_logits` (finite log-normalizers).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klest._checks import check_int_ids, check_row_vector, check_temperature
from klest.logits._stats import Divergence
from klest.logits.kernels._launch import (
    MAX_GRID_Y,
    cdiv,
    check_device,
    check_grad_buffer,
    check_keep,
    check_logits,
    check_programs,
    resolve_block_v,
    resolve_fused_launch,
    resolve_num_warps,
    triton_importable,
)

__all__ = ["divergence_backward", "divergence_forward", "divergence_fused"]

_KINDS = {"mixture": 0, "tv": 1}


def _divergence_kernels():
    if not triton_importable():
        raise RuntimeError("klest.logits.kernels needs triton, which is not installed")
    from klest.logits.kernels import _divergence_triton

    return _divergence_triton


def _constants(div: Divergence) -> dict:
    if div.kind not in _KINDS:
        raise ValueError(f"div.kind must be one of {tuple(_KINDS)}, got {div.kind!r}")
    if div.kind == "mixture" and not 0.0 < div.w < 1.0:
        raise ValueError(f"the mixture weight w must be in (0, 1), got {div.w!r}")
    return dict(w=float(div.w), c_q=float(div.c_q), c_p=float(div.c_p), KIND=_KINDS[div.kind])


def divergence_forward(
    z: Tensor,
    y: Tensor,
    lse_z: Tensor,
    lse_y: Tensor,
    div: Divergence,
    *,
    temperature: float = 1.0,
    block_v: int | None = None,
    num_warps: int | None = None,
    keep: Tensor | None = None,
    clamp: bool = True,
) -> Tensor:
    r"""Per row: the divergence, :math:`S_q` and :math:`S_p` (module docstring), float32
    ``[3, N]``.

    Args:
      z: pi's logits ``[N, V]``, float32 / bfloat16 / float16, CUDA (or CPU under
        ``TRITON_INTERPRET=1``).
      y: ref's logits, same shape and device.
      lse_z: ``logsumexp(z / tau)`` per row, float ``[N]`` (from ``kl_logits_forward``).
      lse_y: ``logsumexp(y / tau)`` per row.
      div: which divergence.
      temperature: :math:`\tau > 0`, dividing both logits.
      block_v: vocabulary block (power of two, >= 16); default ``min(1024, next_pow2(V))``.
      num_warps: warps per program (power of two, 1 to 32).
      keep: optional bool ``[N]`` on ``z``'s device: rows where it is False are not read and get
        zeros (as in ``kl_logits_forward``).
      clamp: raise a negative value (rounding) to 0; False for the sums over a vocabulary
        shard (given the whole rows' ``lse_z``, ``lse_y``), which add up to the divergence.

    Returns:
      ``[3, N]`` float32: value (clamped at 0 with ``clamp``), :math:`S_q`, :math:`S_p`.

    Example:
      >>> from klest.logits.kernels import triton_available
      >>> z, y = torch.randn(2, 9), torch.randn(2, 9)
      >>> if triton_available():  # CUDA, or TRITON_INTERPRET=1
      ...     out = divergence_forward(z, y, z.logsumexp(-1), y.logsumexp(-1), Divergence("tv"))
    """
    z, y = check_logits(z, y)
    tau = check_temperature(temperature)
    n, v = z.shape
    lse_z = check_row_vector("lse_z", lse_z, n, z.device)
    lse_y = check_row_vector("lse_y", lse_y, n, z.device)
    keep = check_keep(keep, n, z.device)
    consts = _constants(div)
    bv = resolve_block_v(block_v, v)
    out = torch.zeros(3, n, dtype=torch.float32, device=z.device)
    if n > 0:
        check_device(z)
        _divergence_kernels().divergence_fwd_kernel[(n,)](
            z, y, lse_z, lse_y, out, z.stride(0), y.stride(0), n, v, 1.0 / tau,
            **consts, keep_ptr=out if keep is None else keep, HAS_KEEP=keep is not None,
            CLAMP=bool(clamp), BLOCK_V=bv, num_warps=resolve_num_warps(num_warps, bv),
        )  # fmt: skip
    return out


def divergence_backward(
    z: Tensor,
    y: Tensor,
    lse_z: Tensor,
    lse_y: Tensor,
    s_q: Tensor,
    s_p: Tensor,
    grad: Tensor,
    div: Divergence,
    *,
    temperature: float = 1.0,
    need_grad_z: bool = True,
    need_grad_y: bool = False,
    block_v: int | None = None,
    num_warps: int | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    r"""Gradients of :math:`\sum_n g_n D_n` w.r.t. ``z`` and ``y`` (module docstring).

    Args:
      z: pi's logits, as given to :func:`divergence_forward`.
      y: ref's logits, as given to :func:`divergence_forward`.
      lse_z: as given to :func:`divergence_forward`.
      lse_y: as given to :func:`divergence_forward`.
      s_q: :math:`S_q` per row, from :func:`divergence_forward`.
      s_p: :math:`S_p` per row.
      grad: :math:`g`, the upstream gradient per row, float ``[N]``.
      div: which divergence.
      temperature: as given to :func:`divergence_forward`.
      need_grad_z: compute the gradient w.r.t. ``z``.
      need_grad_y: compute the gradient w.r.t. ``y``.
      block_v: vocabulary block of the grid (power of two, >= 16).
      num_warps: warps per program.
      keep: as in :func:`divergence_forward`: rows where it is False get zero gradients.

    Returns:
      ``(dz, dy)``: contiguous ``[N, V]`` tensors in ``z``'s and ``y``'s dtypes, or None where
      not needed.

    Example:
      >>> from klest.logits.kernels import triton_available
      >>> z, y = torch.randn(2, 9), torch.randn(2, 9)
      >>> div = Divergence("mixture", w=0.5, c_q=0.5, c_p=0.5)  # JSD with beta = 1/2
      >>> if triton_available():
      ...     lse = z.logsumexp(-1), y.logsumexp(-1)
      ...     value, s_q, s_p = divergence_forward(z, y, *lse, div)
      ...     dz, _ = divergence_backward(z, y, *lse, s_q, s_p, torch.ones(2), div)
    """
    z, y = check_logits(z, y)
    tau = check_temperature(temperature)
    n, v = z.shape
    dev = z.device
    rows = [
        check_row_vector(name, t, n, dev)
        for name, t in (("lse_z", lse_z), ("lse_y", lse_y), ("s_q", s_q), ("s_p", s_p))
    ]
    grad = check_row_vector("grad", grad, n, dev)
    keep = check_keep(keep, n, dev)
    consts = _constants(div)
    bv = resolve_block_v(block_v, v)
    if cdiv(v, bv) > MAX_GRID_Y:
        raise ValueError(f"V = {v} needs more than {MAX_GRID_Y} blocks of {bv}; raise block_v")
    dz = torch.empty_like(z, memory_format=torch.contiguous_format) if need_grad_z else None
    dy = torch.empty_like(y, memory_format=torch.contiguous_format) if need_grad_y else None
    if n > 0 and (need_grad_z or need_grad_y):
        check_device(z)
        dummy = rows[0]
        _divergence_kernels().divergence_bwd_kernel[(n, cdiv(v, bv))](
            z, y, *rows, grad,
            dummy if dz is None else dz,
            dummy if dy is None else dy,
            z.stride(0), y.stride(0),
            v if dz is None else dz.stride(0),
            v if dy is None else dy.stride(0),
            v, 1.0 / tau, **consts, keep_ptr=dummy if keep is None else keep,
            NEED_DZ=bool(need_grad_z), NEED_DY=bool(need_grad_y), HAS_KEEP=keep is not None,
            BLOCK_V=bv, num_warps=resolve_num_warps(num_warps, bv),
        )  # fmt: skip
    return dz, dy


def divergence_fused(
    z: Tensor,
    y: Tensor,
    grad: Tensor,
    div: Divergence,
    *,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    want_entropy: bool = False,
    need_grad_z: bool = True,
    need_grad_y: bool = False,
    dz: Tensor | None = None,
    dy: Tensor | None = None,
    keep: Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    r"""The rows' log-normalizers, :func:`divergence_forward` and :func:`divergence_backward`
    in one launch, for upstream gradients ``grad`` known before the call.

    Memory traffic: a row of at most ``block_v`` entries (by default ``V <= 16384``) is read
    once (2 passes over ``[N, V]`` and one write of each gradient); a longer row three times in
    a row (log-normalizers, value, gradient), the later reads from a cache that holds the rows
    in flight where it does.

    Args:
      z: pi's logits ``[N, V]``, as for :func:`divergence_forward`.
      y: ref's logits.
      grad: :math:`g`, the upstream gradient per row, float ``[N]``.
      div: which divergence.
      temperature: :math:`\tau > 0`.
      labels: optional int ``[N]`` token ids, as for
        :func:`~klest.logits.kernels.kl_logits_forward` (their log-probs are returned).
      want_entropy: also pi's entropy.
      need_grad_z: write the gradient w.r.t. ``z``.
      need_grad_y: write the gradient w.r.t. ``y``.
      dz: where to write the gradient w.r.t. ``z`` (e.g. ``z`` itself); default a new tensor.
      dy: the same for ``y``.
      keep: as in :func:`divergence_forward`.
      block_v: vocabulary block (power of two); ``>= V`` reads each row once.
      num_warps: warps per program.
      programs: programs launched (each takes rows ``pid, pid + programs, ...``); default one
        per row.

    Returns:
      ``(stats, mix, dz, dy)``: float32 ``[7, N]`` in the layout of
      :class:`~klest.logits.KLRowStats` (``lse_z``, ``lse_y``, the KLs 0, the entropy (0 unless
      asked for), the label log-probs), float32 ``[3, N]`` of :func:`divergence_forward`, and
      the gradients (None where not needed).
    """
    z, y = check_logits(z, y)
    tau = check_temperature(temperature)
    n, v = z.shape
    dev = z.device
    grad = check_row_vector("grad", grad, n, dev)
    if labels is not None:
        labels = check_int_ids("labels", labels, torch.Size((n,)), dev, of="the rows of z")
        labels = labels.to(torch.int64).contiguous()
    keep = check_keep(keep, n, dev)
    consts = _constants(div)
    bv, warps, one_block = resolve_fused_launch(block_v, num_warps, v)
    grid = check_programs(programs, n)
    if need_grad_z:
        dz = (
            torch.empty_like(z, memory_format=torch.contiguous_format)
            if dz is None
            else check_grad_buffer("dz", dz, z, (z, y))
        )
    if need_grad_y:
        dy = (
            torch.empty_like(y, memory_format=torch.contiguous_format)
            if dy is None
            else check_grad_buffer("dy", dy, y, (z, y))
        )
    stats = torch.zeros(7, n, dtype=torch.float32, device=dev)
    mix = torch.zeros(3, n, dtype=torch.float32, device=dev)
    if n > 0:
        check_device(z)
        dummy = stats
        _divergence_kernels().divergence_fused_kernel[(grid,)](
            z, y, dummy if labels is None else labels, stats, mix,
            dummy if keep is None else keep, grad,
            dz if need_grad_z else dummy, dy if need_grad_y else dummy,
            z.stride(0), y.stride(0), dz.stride(0) if need_grad_z else v,
            dy.stride(0) if need_grad_y else v, n, v, math.log2(math.e) / tau, 1.0 / tau,
            **consts, HAS_LABELS=labels is not None, HAS_KEEP=keep is not None,
            WANT_ENT=bool(want_entropy), NEED_DZ=bool(need_grad_z), NEED_DY=bool(need_grad_y),
            ONE_BLOCK=one_block, BLOCK_V=bv, num_warps=warps,
        )  # fmt: skip
    return stats, mix, (dz if need_grad_z else None), (dy if need_grad_y else None)
