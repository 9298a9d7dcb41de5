r"""Scale a gradient written in the forward pass by the upstream gradient, deciding on the device.

When a loss's gradient is written during the forward pass (for the coefficients ``c`` its rows
were expected to get: a reduction's weights times ``scale``), the backward receives the actual
upstream gradients ``g`` and must multiply each row by ``g / c``. Where ``g == c`` (a loss that
reaches the backward with 1, as ``pg + kl_from_logits(..., scale=beta)`` does) the row is
already right: these kernels read the factor on the device and return at once, so that a
backward costs no pass over the ``[N, V]`` gradient and no host synchronisation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klest._checks import check_row_vector
from klest.logits.kernels._launch import cdiv, check_device, triton_importable

__all__ = ["scale_", "scale_rows_"]

_BLOCK = 1024


def _scale_kernels():
    if not triton_importable():
        raise RuntimeError("klest.logits.kernels needs triton, which is not installed")
    from klest.logits.kernels import _scale_triton

    return _scale_triton


def scale_rows_(x: Tensor, g: Tensor, c: Tensor) -> Tensor:
    r"""``x[n] *= g[n] / c[n]`` in place, for ``[N, V]`` ``x`` with contiguous rows.

    A row where ``g == c`` is neither read nor written; where ``g == 0`` it is set to zeros
    (a term whose upstream gradient is 0 contributes exactly 0, even if ``x`` holds ``inf`` or
    NaN there, as the gradient of an infinite KL does).

    Args:
      x: the gradient written in the forward pass, ``[N, V]`` float32 / bf16 / fp16, CUDA (or
        CPU under ``TRITON_INTERPRET=1``).
      g: the upstream gradient per row, float ``[N]``.
      c: the coefficient per row that ``x`` was written for, float ``[N]``.

    Returns:
      ``x``.
    """
    if x.ndim != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be [N, V] with contiguous rows, got {tuple(x.shape)}")
    n, v = x.shape
    g = check_row_vector("g", g, n, x.device)
    c = check_row_vector("c", c, n, x.device)
    if x.numel():
        check_device(x)
        _scale_kernels().scale_rows_kernel[(n, cdiv(v, _BLOCK))](
            x, g, c, x.stride(0), v, BLOCK_V=_BLOCK, num_warps=4
        )
    return x


def scale_(x: Tensor, r: Tensor) -> Tensor:
    """``x *= r`` in place for a contiguous ``x`` and a one-element ``r``, reading neither ``x``
    nor ``r`` on the host: nothing happens where ``r == 1``, zeros where ``r == 0``."""
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if r.numel() != 1 or r.device != x.device:
        raise ValueError(f"r must hold one number on {x.device}")
    if x.numel():
        check_device(x)
        r = r.reshape(1).to(torch.float32)
        _scale_kernels().scale_kernel[(cdiv(x.numel(), _BLOCK),)](
            x, r, x.numel(), BLOCK=_BLOCK, num_warps=4
        )
    return x
