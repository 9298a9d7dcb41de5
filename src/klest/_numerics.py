"""Cancellation-free elementwise functions behind k3 and its ref||pi analogue.

Peers compute k3 as ``exp(x) - x - 1``; near x = 0 the two large terms cancel and in float32 the
result is mostly rounding noise (relative error 0.3-1 for |x| in [1e-5, 1e-2]). Here each function
is a Taylor polynomial near 0 (truncation below the dtype's precision) and the direct
formula elsewhere, where no cancellation happens. Both branches see only inputs valid for them, so
the unselected branch never puts NaN into a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# e^x - 1 - x = sum_{k>=2} x^k / k!, and e^-x - 1 + x = sum_{k>=2} (-x)^k / k!
_EXP_TAIL = tuple(1.0 / math.factorial(k) for k in range(2, 18))
_EXP_NEG_TAIL = tuple((-1.0) ** k / math.factorial(k) for k in range(2, 18))
# 1 + e^x (x - 1) = x e^x - (e^x - 1) = sum_{k>=2} (k - 1) x^k / k!
_XEXP_TAIL = tuple((k - 1) / math.factorial(k) for k in range(2, 18))


@dataclass(frozen=True)
class _Series:
    """A Taylor polynomial below ``radius``, the direct formula above.

    ``degree`` (per dtype) makes the truncation, relative to the leading term x^2 / 2, about the
    dtype's epsilon or less at the radius; the radius makes the direct formula's cancellation
    small above it. e^x - 1 - x loses about 2 eps / |x| relative (its terms are of size |x|; 5
    ulps at the radius 0.2): degrees 12 (float64: 2 |x|^10 / 13! < 7e-18) and 6 (float32:
    2 |x|^5 / 7! < 1.3e-7, one ulp at the radius and less inside, where the direct formula's
    error is the larger). x e^x - e^x + 1 loses about 2 eps / x^2 (its terms are of size 1):
    radius 1/2, degrees 17 (float64) and 9 (float32: 18 |x|^8 / 10! < 2e-8).
    """

    coeffs: tuple[float, ...]
    radius: float
    degree: dict[torch.dtype, int]
    default_degree: int


_EXP_TAIL_SERIES = _Series(_EXP_TAIL, 0.2, {torch.float64: 12}, 6)
_EXP_NEG_TAIL_SERIES = _Series(_EXP_NEG_TAIL, 0.2, {torch.float64: 12}, 6)
_XEXP_TAIL_SERIES = _Series(_XEXP_TAIL, 0.5, {torch.float64: 17}, 9)


def _series_or_direct(x: Tensor, series: _Series, direct: Callable[[Tensor], Tensor]) -> Tensor:
    """The Taylor polynomial of ``series`` where ``|x| < radius``, ``direct(x)`` elsewhere.

    Each branch sees only inputs valid for it (the unselected branch's backward would otherwise
    put ``inf * 0 = NaN`` into the gradient).
    """
    coeffs = series.coeffs[: series.degree.get(x.dtype, series.default_degree) - 1]
    small = x.abs() < series.radius
    xs = torch.where(small, x, 0.0)
    xd = torch.where(small, 1.0, x)
    return torch.where(small, _horner(coeffs, xs) * xs * xs, direct(xd))


def _horner(coeffs: tuple[float, ...], x: Tensor) -> Tensor:
    """``c_0 + c_1 x + ... + c_n x^n`` by Horner's rule (the series is x^2 times it)."""
    acc = coeffs[-1] * x + coeffs[-2]
    for c in reversed(coeffs[:-2]):
        acc = acc * x + c
    return acc


def exp_tail(x: Tensor) -> Tensor:
    """``e^x - 1 - x``, accurate to a few ulp for every x (>= 0; +inf only past overflow)."""
    return _series_or_direct(x, _EXP_TAIL_SERIES, _expm1_minus_identity)


def _expm1_minus_identity(z: Tensor) -> Tensor:
    return torch.expm1(z) - z


def exp_neg_tail(x: Tensor) -> Tensor:
    """``e^-x - 1 + x`` (k3 of KL(pi||ref) at the log-ratio x), accurate to a few ulp for every
    x: :func:`exp_tail` of ``-x`` (the same values: the series' terms only change sign)."""
    return _series_or_direct(x, _EXP_NEG_TAIL_SERIES, _expm1_neg_plus_identity)


def _expm1_neg_plus_identity(z: Tensor) -> Tensor:
    return torch.expm1(-z) + z


def xexp_tail(x: Tensor) -> Tensor:
    """``x e^x - (e^x - 1)``, accurate for every x (>= 0); equals 1 at x = -inf."""
    # Clamping -inf to the most negative finite value gives e^x = 0 exactly and a zero gradient.
    x = x.clamp(min=torch.finfo(x.dtype).min)
    # e^x (x - 1) + 1 rather than x e^x - expm1(x): the latter is inf - inf past overflow.
    return _series_or_direct(x, _XEXP_TAIL_SERIES, _exp_times_x_minus_one)


def _exp_times_x_minus_one(z: Tensor) -> Tensor:
    """``e^z (z - 1) + 1`` (exactly 0 at z = 0)."""
    return torch.exp(z) * (z - 1.0) + 1.0


def times_exp(c: Tensor, x: Tensor) -> Tensor:
    """``c e^x``, finite wherever the product is, also where ``e^x`` alone overflows.

    Where ``e^x`` is finite this is the product (two roundings); where it overflows the product
    is ``sign(c) e^{x + log|c|}`` (relative error about ``|x|`` ulps: at most ~5e-6 in float32,
    ~1e-13 in float64), which is finite for small enough ``|c|`` and the correctly signed
    infinity otherwise. ``c = 0`` gives 0.
    """
    c, x = torch.broadcast_tensors(c, x)
    with torch.no_grad():
        overflow = torch.isinf(torch.exp(x)) & (x > 0)
        via_log = overflow & (c != 0)
    # Each branch sees only inputs valid for it (no inf * 0 in either backward).
    direct = c * torch.exp(torch.where(overflow, torch.zeros_like(x), x))
    c_log = torch.where(via_log, c, torch.ones_like(c))
    x_log = torch.where(via_log, x, torch.zeros_like(x))
    logged = torch.sign(c_log) * torch.exp(x_log + torch.log(c_log.abs()))
    return torch.where(via_log, logged, direct)


def x_exp(x: Tensor) -> Tensor:
    """``x e^x`` with the limit 0 at x = -inf (``r log r`` at ``r = 0``)."""
    x = x.clamp(min=torch.finfo(x.dtype).min)
    return x * torch.exp(x)
