"""Triton kernels behind :mod:`klest.logits.kernels.scale` (imported only when triton is): a
gradient written in the forward pass, multiplied in the backward by a factor read on the device,
and left alone, unread, where the factor is 1."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_rows_kernel(x_ptr, g_ptr, c_ptr, stride, V, BLOCK_V: tl.constexpr):
    """Program ``(row, block)``: ``x[row] *= g[row] / c[row]`` unless ``g == c`` (then nothing is
    read or written); ``g == 0`` writes zeros (a dropped term, even over ``inf`` / NaN)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(g_ptr + row)
    c = tl.load(c_ptr + row)
    if g != c:
        offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        inside = offs < V
        ptrs = x_ptr + row * stride + offs
        x = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
        out = tl.where(g == 0.0, 0.0, x * (g / c))
        tl.store(ptrs, out.to(x_ptr.dtype.element_ty), mask=inside)


@triton.jit
def scale_kernel(x_ptr, r_ptr, numel, BLOCK: tl.constexpr):
    """``x *= r`` over a contiguous buffer, unless ``r == 1`` (nothing read or written); ``r == 0``
    writes zeros."""
    r = tl.load(r_ptr)
    if r != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < numel
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        out = tl.where(r == 0.0, 0.0, x * r)
        tl.store(x_ptr + offs, out.to(x_ptr.dtype.element_ty), mask=inside)
