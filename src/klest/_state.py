"""Moving-average state kept in float64 inside modules that may be cast to a lower precision."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def keep_float64(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``fn`` (what ``nn.Module._apply`` maps over buffers) for float64 state: moves to the
    device ``fn`` chooses but never changes the dtype, so casting a model to bf16 / fp16 neither
    changes the state's dtype nor rounds its values (``fn(t).double()`` would round them)."""

    def apply(t: Tensor) -> Tensor:
        moved = fn(t)
        return moved if moved.dtype == t.dtype else t.to(device=moved.device)

    return apply


class Float64EMAState(nn.Module):
    """Float64 buffers ``[T]`` (named by ``BUFFERS``) that grow with the longest sequence seen,
    follow ``.to(device)`` but stay float64 when a model is cast to bf16 / fp16, and are saved
    in ``state_dict`` (a resumed run keeps them): the state of the moving averages of
    :mod:`klest.sampled.baselines`."""

    BUFFERS: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        for name in self.BUFFERS:
            self.register_buffer(name, torch.zeros(0, dtype=torch.float64))

    def _grow(self, t: int, device: torch.device) -> tuple[Tensor, ...]:
        """The buffers' first ``t`` entries (views), after growing them to ``t`` on ``device``."""
        first = getattr(self, self.BUFFERS[0])
        if first.device != device:
            self.to(device)
        for name in self.BUFFERS:
            buf = getattr(self, name)
            if buf.numel() < t:
                pad = torch.zeros(t - buf.numel(), dtype=torch.float64, device=device)
                setattr(self, name, torch.cat([buf, pad]))
        return tuple(getattr(self, name)[:t] for name in self.BUFFERS)

    def _apply(self, fn, recurse=True):
        # Follow .to(device), but keep float64 state (values too) when a model is cast.
        return super()._apply(keep_float64(fn), recurse)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args) -> None:
        # The buffers grow with the longest sequence seen; take the saved length.
        for name in self.BUFFERS:
            saved = state_dict.get(prefix + name)
            if isinstance(saved, Tensor):
                setattr(self, name, torch.zeros_like(saved, device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args)
