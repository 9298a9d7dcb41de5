"""Moving-average state kept in float64 inside modules that may be cast to a lower precision."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def keep_float64(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``fn`` (what ``nn.Module._apply`` maps over buffers) for float64 state: moves to the
    device ``fn`` chooses but never changes the dtype, so casting a model to bf16 / fp16 neither
    changes the state's dtype nor rounds its values (``fn(t).double()`` would round them)."""

    def apply(t: Tensor) -> Tensor:
        moved = fn(t)
        return moved if moved.dtype == t.dtype else t.to(device=moved.device)

    return apply
