"""Zeroing the masked positions of a tensor: ``torch.where(valid, x, 0)``, 2-3x faster on the CPU.

A mask is applied as a bitwise AND of the values' bits with all-ones (keep) or all-zeros (drop):
exact for every value, NaN and infinities included (a dropped position becomes +0.0), and an
integer AND is vectorised where PyTorch's CPU ``where`` is not (2-3x faster on the benchmark's
``[64, 4096]`` float32 batch). Under autograd the gradient is masked the same way, as
``where``'s would be. Under forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``)
and functorch transforms (``torch.func.grad``, ``vmap``), and while ``torch.compile`` traces,
the mask is ``where`` itself: an integer AND carries no tangent (the derivative would silently
be 0), the autograd function has no functorch rule, and the compiler fuses ``where``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from klest._autodiff import transforms_active

_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def mask_bits(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """The bit mask of bool ``valid`` for values of float ``dtype``: -1 (all bits set) where
    True, 0 where False, in the integer type of ``dtype``'s width."""
    return valid.view(torch.uint8).to(_BITS[dtype]).neg_()


def keep_valid(x: Tensor, valid: Tensor, bits: Tensor | None = None) -> Tensor:
    """``torch.where(valid, x, 0)`` for float ``x`` (``bits``: :func:`mask_bits` of ``valid``
    for ``x``'s dtype, when the caller reuses it), with ``where``'s gradient."""
    if transforms_active():  # tangents and functorch rules: where has them
        return torch.where(valid, x, 0.0)
    if bits is None:
        bits = mask_bits(valid, x.dtype)
    if torch.is_grad_enabled() and x.requires_grad:
        return _KeepValid.apply(x, bits, valid)
    return _and(x, bits)


def keep_valid_into(out: Tensor, x: Tensor, valid: Tensor, bits: Tensor | None = None) -> Tensor:
    """:func:`keep_valid` of a detached ``x`` written into ``out`` (same shape and dtype; a
    view of a larger tensor is fine)."""
    if transforms_active():  # out= into a strided view: neither traced nor batched
        return out.copy_(torch.where(valid, x.detach(), 0.0))
    if bits is None:
        bits = mask_bits(valid, x.dtype)
    torch.bitwise_and(x.detach().view(bits.dtype), bits, out=out.view(bits.dtype))
    return out


def _and(x: Tensor, bits: Tensor) -> Tensor:
    return torch.bitwise_and(x.view(bits.dtype), bits).view(x.dtype)


class _KeepValid(torch.autograd.Function):
    # forward(ctx, ...) rather than setup_context: apply() then skips binding the signature
    # (inspect.signature, tens of microseconds a call). The backward reuses the bits (the
    # caller made them for the forward pass; remaking them costs two passes).
    @staticmethod
    def forward(ctx: Any, x: Tensor, bits: Tensor, valid: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(valid, bits)
        return _and(x, bits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        valid, bits = ctx.saved_tensors
        return keep_valid(grad, valid, bits), None, None
