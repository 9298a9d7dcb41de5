"""Whether a call's derivatives are being recorded, by any of PyTorch's three mechanisms.

Fast paths that write in place (``out=``, ``addcmul_``) or skip autograd (integer bit masks) are
valid only when nothing records a derivative through them: no autograd graph, no forward-mode
AD level (``torch.autograd.forward_ad``, ``torch.func.jvp``) and no functorch transform
(``torch.func.grad``, ``vmap``), and no ``torch.compile`` tracing. Forward-mode AD rejects
``out=`` functions, ``vmap`` has no batching rule for them, an integer operation carries no
tangent, and Dynamo breaks the graph at an ``out=`` into a strided view (the plain operations
are what the compiler fuses anyway).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import forward_ad


def transforms_active() -> bool:
    """Whether a forward-mode AD level or a functorch transform is active, or ``torch.compile``
    is tracing (C calls and an attribute read: well under a microsecond)."""
    if getattr(forward_ad, "_current_level", -1) >= 0 or torch.compiler.is_compiling():
        return True
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def records_derivatives(x: Tensor) -> bool:
    """Whether an operation on ``x`` may be differentiated: autograd records a graph for it, or
    a forward-mode AD level or functorch transform is active (then every path must be one that
    these can trace: no ``out=``, no integer stand-ins for float operations)."""
    return (torch.is_grad_enabled() and x.requires_grad) or transforms_active()
