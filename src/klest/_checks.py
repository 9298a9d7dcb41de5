"""Argument validation with clear errors.

Every public entry point of klest validates its tensors here, so a bad call fails with a
``TypeError`` / ``ValueError`` that names the argument (and both shapes, for a mismatch)
instead of returning a silent NaN.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

DIRECTIONS = ("pi||ref", "ref||pi")


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``; else raise naming the argument."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"unknown {name} {value!r}; expected one of {', '.join(map(repr, choices))}"
        )
    return value


def check_direction(direction: object) -> str:
    """Validate a KL direction spelled by its arguments: ``"pi||ref"`` or ``"ref||pi"``."""
    return check_choice("direction", direction, DIRECTIONS)


def check_float_tensor(name: str, x: object) -> Tensor:
    """A non-empty floating-point tensor, or a TypeError/ValueError naming ``name``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must have a floating-point dtype (log-probabilities), got {x.dtype}"
        )
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)})")
    return x


def check_same_shape(**tensors: Tensor | None) -> None:
    """Raise if the given tensors (``None`` skipped) do not all have the same shape."""
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"{first_name} has shape {tuple(first.shape)} but {name} has shape "
                f"{tuple(t.shape)}; they must match"
            )
        if t.device != first.device:
            raise ValueError(
                f"{first_name} is on {first.device} but {name} is on {t.device}; "
                "they must be on the same device"
            )


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype klest computes in: the promoted input dtype, never below float32."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_mask(mask: object, shape: torch.Size, device: torch.device) -> Tensor:
    """A boolean mask of ``shape`` (True = keep); accepts bool or 0/1 numeric tensors."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but the log-probs have shape {tuple(shape)}"
        )
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device} but the log-probs are on {device}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"mask must be bool or 0/1 numeric, got {mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        raise ValueError("mask must contain only 0 and 1 (or be a bool tensor)")
    return mask != 0


def check_rows_not_empty(mask: Tensor, *, sequences: bool = True) -> None:
    """Raise if any row of ``[rows, T]`` is entirely masked.

    For ``sequences=False`` (a 1-D input of independent samples) only an all-masked input is an
    error: dropping single samples is what a mask is for.
    """
    if not sequences:
        if not bool(mask.any()):
            raise ValueError("mask leaves no valid sample")
        return
    row_has_token = mask.any(dim=-1)
    if not bool(row_has_token.all()):
        empty = (~row_has_token).nonzero().tolist()
        shown = ", ".join(str(tuple(i)) for i in empty[:5])
        more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
        raise ValueError(
            f"mask leaves {len(empty)} row(s) with no valid token (rows {shown}{more}); "
            "drop those rows before estimating"
        )


def _first_index(flags: Tensor) -> tuple[int, ...]:
    return tuple(flags.nonzero()[0].tolist())


def check_log_probs(
    name: str, x: Tensor, mask: Tensor | None, *, allow_neg_inf: bool, role: str
) -> None:
    """Reject NaN and +inf everywhere the mask keeps; reject -inf unless ``allow_neg_inf``.

    ``role`` explains in the message why -inf is impossible (e.g. "a sample pi cannot produce").
    """
    with torch.no_grad():
        keep = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
        for flags, what in (
            (torch.isnan(x) & keep, "NaN"),
            ((x == float("inf")) & keep, "+inf"),
        ):
            if bool(flags.any()):
                raise ValueError(
                    f"{name} contains {what} at {int(flags.sum())} position(s) "
                    f"(first at index {_first_index(flags)})"
                )
        if not allow_neg_inf:
            flags = (x == float("-inf")) & keep
            if bool(flags.any()):
                raise ValueError(
                    f"{name} is -inf at {int(flags.sum())} position(s) (first at index "
                    f"{_first_index(flags)}): {role}; mask such positions out"
                )


def check_int_ids(
    name: str, ids: object, shape: torch.Size, device: torch.device, *, of: str
) -> Tensor:
    """An integer tensor of ``shape`` on ``device`` (``of`` says what each id belongs to)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer ids, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer ids, got dtype {ids.dtype}")
    if ids.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(ids.shape)} but {of} have shape {tuple(shape)}; "
            f"give one id per entry"
        )
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but {of} are on {device}")
    return ids


def check_group(group: object, shape: torch.Size, device: torch.device) -> Tensor:
    """Integer group ids, one per row of log-probs shaped ``shape``; returned flat ``[rows]``."""
    rows_shape = shape[:-1] if len(shape) >= 2 else shape
    of = f"the rows (sequences) of the log-probs of shape {tuple(shape)}"
    return check_int_ids("group", group, rows_shape, device, of=of).reshape(-1)
