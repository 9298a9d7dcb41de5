r"""Tail probabilities of linear combinations of independent chi-squares, and normal deviates.

:func:`chi2_combination_log_tails` gives both tails of :math:`Q = \sum_i w_i \chi^2_{\nu_i}` at 0
(weights of either sign) by inverting its moment generating function exactly along the vertical
line through the saddlepoint:

.. math::
    P(Q > 0) = \frac{1}{2\pi i} \int_{c - i\infty}^{c + i\infty} \frac{M(s)}{s}\, ds
    = \frac{e^{K(c)}}{\pi} \int_0^\infty e^{A(t)}
      \frac{c \cos B(t) + t \sin B(t)}{c^2 + t^2}\, dt \qquad (0 < c < s_+),

with :math:`K(s) = -\tfrac12 \sum_i \nu_i \log(1 - 2 s w_i)`, :math:`b_i = 2 w_i / (1 - 2 c w_i)`,
:math:`A = -\tfrac14 \sum_i \nu_i \log(1 + t^2 b_i^2)` and
:math:`B = \tfrac12 \sum_i \nu_i \arctan(t b_i)`; for :math:`s_- < c < 0` the same integral is
:math:`-P(Q < 0)`. With ``c`` at the saddlepoint (:math:`K'(c) = 0`) the integrand is positive
where it matters, so the smaller tail keeps its relative precision however far out it is
(no ``1/2 - ...`` cancellation as in Imhof's formula, which is the case ``c -> 0``). The integral
is a double-exponential (exp-sinh) trapezoid rule, halving its step until two levels agree.
Reference: Helstrom, "Distribution of quadratic forms in Gaussian random variables" (1983);
Imhof, Biometrika 48 (1961).

Only numpy and the standard library: the audit's null distribution, not a tensor computation.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

# Exp-sinh nodes: t = scale * exp(pi/2 sinh(u)), |u| <= _U, steps halved from 1/8 until two
# levels agree to _RTOL, down to _MIN_STEP or until nodes x terms reach _BUDGET.
_U = 5.0
_RTOL = 1e-12
_MIN_STEP = 2.0**-16
_BUDGET = 2e7


def _cumulant_derivatives(s: float, w: np.ndarray, nu: np.ndarray) -> tuple[float, float]:
    """``(K'(s), K''(s))`` of the combination."""
    q = w / (1.0 - 2.0 * s * w)
    return float((nu * q).sum()), float((2.0 * nu * q * q).sum())


def _saddlepoint(w: np.ndarray, nu: np.ndarray, lo: float, hi: float) -> float:
    """The root of K' in ``(lo, hi)`` (K' increases from -inf to +inf there): Newton's
    method kept inside a shrinking bracket. Any point near it serves (the inversion is exact
    for every ``c`` in the strip), so a relative 1e-9 of the natural scale is enough."""
    s = 0.0
    for _ in range(200):
        d1, d2 = _cumulant_derivatives(s, w, nu)
        if d1 > 0:
            hi = s
        elif d1 < 0:
            lo = s
        else:
            return s
        step = d1 / d2
        if abs(step) <= 1e-9 * (abs(s) + 1.0 / math.sqrt(d2)):
            return s
        s = s - step if lo < s - step < hi else 0.5 * (lo + hi)
    return s


def _integrand(u: np.ndarray, c: float, b: np.ndarray, nu: np.ndarray, scale: float):
    """The integrand in ``u`` (times the exp-sinh Jacobian) and its envelope (the same with
    ``|c cos B + t sin B|`` bounded by ``|c + it|``)."""
    t = scale * np.exp(0.5 * math.pi * np.sinh(u))
    tb = np.multiply.outer(t, b)
    a = -0.25 * (np.log1p(tb * tb) @ nu)
    phase = 0.5 * (np.arctan(tb) @ nu)
    jacobian = np.exp(a) * t * (0.5 * math.pi) * np.cosh(u) / (c * c + t * t)
    return jacobian * (c * np.cos(phase) + t * np.sin(phase)), jacobian * np.hypot(c, t)


def _integral(c: float, w: np.ndarray, nu: np.ndarray) -> float | None:
    r"""``(1/pi) int_0^inf e^A (c cos B + t sin B) / (c^2 + t^2) dt`` (see the module), or None
    when the trapezoid rule has not converged within its budget of nodes (an integrand that
    oscillates over many periods: a single dominant chi-square far out in the tail)."""
    b = 2.0 * w / (1.0 - 2.0 * c * w)
    scale = 1.0 / math.sqrt(0.5 * float((nu * b * b).sum()))  # 1 / sqrt(K''(c))
    # The range of u where the envelope is above 1e-18 of its peak (it falls off
    # double-exponentially at both ends), from a coarse grid.
    h = 0.125
    u = np.arange(-round(_U / h), round(_U / h) + 1) * h
    _, envelope = _integrand(u, c, b, nu, scale)
    where = np.nonzero(envelope > 1e-18 * envelope.max())[0]
    lo, hi = u[max(where[0] - 1, 0)], u[min(where[-1] + 1, u.size - 1)]
    u = np.arange(round(lo / h), round(hi / h) + 1) * h
    total = float(_integrand(u, c, b, nu, scale)[0].sum())
    previous = total * h / math.pi
    while h > _MIN_STEP and (hi - lo) / h * b.size <= _BUDGET:
        h /= 2
        # Nested levels: only the new nodes, half-way between the old ones.
        u = np.arange(round(lo / h) + 1, round(hi / h), 2) * h
        total += float(_integrand(u, c, b, nu, scale)[0].sum())
        value = total * h / math.pi
        if h <= 1 / 16 and abs(value - previous) <= _RTOL * abs(value):
            return value
        previous = value
    return None


def chi2_combination_log_tails(
    weights: np.ndarray, df: np.ndarray | float = 1.0
) -> tuple[float, float]:
    r"""``(log P(Q > 0), log P(Q < 0))`` of :math:`Q = \sum_i w_i \chi^2_{\nu_i}`, independent.

    ``weights`` of either sign (zeros are dropped); ``df`` the degrees of freedom
    :math:`\nu_i > 0`, one per weight or one for all. The smaller tail is the exact inversion
    (see the module) while it is above ``FAR_TAIL``; beyond, the Lugannani-Rice saddlepoint
    approximation, whose relative error there stays below about 20% (for one dominant
    chi-square with one degree of freedom; it vanishes as the degrees of freedom grow), i.e. a
    normal deviate within 0.02 when it is above 8.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    nu = np.broadcast_to(np.asarray(df, dtype=np.float64), w.shape).copy()
    if not (np.isfinite(w).all() and np.isfinite(nu).all() and (nu > 0).all()):
        raise ValueError("need finite weights and finite positive degrees of freedom")
    keep = w != 0
    w, nu = w[keep], nu[keep]
    if not (w > 0).any():
        return -math.inf, (0.0 if w.size else -math.inf)
    if not (w < 0).any():
        return 0.0, -math.inf
    w = w / np.abs(w).max()
    lo = 0.5 / float(w.min())  # s_- < 0
    hi = 0.5 / float(w.max())  # s_+ > 0
    s = _saddlepoint(w, nu, lo, hi)
    d1, d2 = _cumulant_derivatives(0.0, w, nu)
    upper = s > 0 if s != 0 else d1 < 0  # which tail is the smaller one
    log_tail = _lugannani_rice(s, w, nu) if s != 0 else 0.0
    if log_tail >= FAR_TAIL:
        # Keep c away from the pole at 0 (near the centre both tails are large anyway).
        c0 = 0.5 / math.sqrt(d2)
        c = max(s, min(c0, 0.5 * hi)) if upper else min(s, max(-c0, 0.5 * lo))
        value = _integral(c, w, nu)
        tail = None if value is None else (value if upper else -value)
        if tail is not None and tail > 0:  # not converged: keep the approximation
            log_k = -0.5 * float((nu * np.log1p(-2.0 * c * w)).sum())
            log_tail = min(log_k + math.log(tail), 0.0)
    other = _log1mexp(log_tail)
    return (log_tail, other) if upper else (other, log_tail)


FAR_TAIL = math.log(1e-15)
"""Below this log-probability the smaller tail is the saddlepoint approximation."""


def _lugannani_rice(s: float, w: np.ndarray, nu: np.ndarray) -> float:
    """log of the Lugannani-Rice approximation of the tail beyond 0 on the side of the
    saddlepoint ``s != 0``: ``Q(r) + phi(r) (1/u - 1/r)``, ``r = sqrt(-2 K(s))``,
    ``u = |s| sqrt(K''(s))``, written as ``phi(r) (Q(r)/phi(r) + 1/u - 1/r)``."""
    k = -0.5 * float((nu * np.log1p(-2.0 * s * w)).sum())
    r = math.sqrt(max(-2.0 * k, 0.0))
    u = abs(s) * math.sqrt(_cumulant_derivatives(s, w, nu)[1])
    if r < 1e-3:  # at the centre (removable singularity): no tail is small there
        return math.log(0.5)
    factor = math.exp(_log_mills(r)) + 1.0 / u - 1.0 / r
    if not factor > 0:
        return math.log(0.5)
    return -0.5 * r * r - 0.5 * math.log(2.0 * math.pi) + math.log(factor)


def _log_mills(z: float) -> float:
    """``log(Q(z) / phi(z))`` for ``z >= 0`` (Q the normal upper tail, phi its density)."""
    if z < 37.0:
        return (
            math.log(0.5 * math.erfc(z / math.sqrt(2.0)))
            + 0.5 * z * z
            + 0.5 * math.log(2.0 * math.pi)
        )
    y = 1.0 / (z * z)  # the asymptotic series; its error is below 1e-13 here
    return -math.log(z) + math.log(1.0 - y * (1.0 - 3.0 * y * (1.0 - 5.0 * y * (1.0 - 7.0 * y))))


def _log1mexp(x: float) -> float:
    """``log(1 - e^x)`` for ``x <= 0``, accurately."""
    if x == 0.0:
        return -math.inf
    return math.log(-math.expm1(x)) if x > -math.log(2) else math.log1p(-math.exp(x))


_LOG_TINY = math.log(1e-300)


def normal_upper_deviate(log_upper: float, log_lower: float) -> float:
    """The z with ``P(N(0, 1) > z) = e^log_upper`` (= ``1 - e^log_lower``), from whichever tail
    is the smaller, so that neither a tiny upper tail nor a tiny lower one loses precision."""
    if log_upper <= log_lower:
        return _isf_log(log_upper)
    return -_isf_log(log_lower)


def _isf_log(log_p: float) -> float:
    """``Phi^-1(1 - p)`` for ``p = e^log_p <= 1/2``, also far below the smallest float."""
    if log_p == -math.inf:
        return math.inf
    if log_p >= _LOG_TINY:
        return -NormalDist().inv_cdf(math.exp(log_p))
    # log Q(z) = -z^2/2 - log(z sqrt(2 pi)) + log(1 - 1/z^2 + 3/z^4 - 15/z^6 + 105/z^8 - ...)
    # (z > 37 here, so the series' error is below 1e-13); Newton from the leading terms.
    z = math.sqrt(-2.0 * log_p)
    for _ in range(50):
        y = 1.0 / (z * z)
        series = 1.0 - y * (1.0 - 3.0 * y * (1.0 - 5.0 * y * (1.0 - 7.0 * y)))
        g = -0.5 * z * z - math.log(z * math.sqrt(2.0 * math.pi)) + math.log(series) - log_p
        step = g / (z + 1.0 / z)  # d/dz log Q(z) ~ -(z + 1/z)
        z += step
        if abs(step) <= 1e-15 * z:
            break
    return z
