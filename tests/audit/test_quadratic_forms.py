"""The tail of a linear combination of chi-squares (the audit's null distribution), against
closed forms (scipy's F and normal distributions) and an independent inversion (Imhof's
integral in mpmath at 30 digits), and the mean-shift deviate end to end against Student's t.

Tolerances: the inversion stops when two halvings of its step agree to 1e-12 relative, so its
tail probabilities are compared at 1e-10 relative (measured: 2.4e-13 at worst); beyond
``FAR_TAIL`` (1e-15) the saddlepoint approximation is compared at its stated 20% (measured:
up to 14%, for one dominant chi-square with one degree of freedom).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from scipy import stats

from klest.audit import mean_shift_z
from klest.audit._quadratic_forms import (
    FAR_TAIL,
    chi2_combination_log_tails,
    normal_upper_deviate,
)

RTOL = 1e-10


def _f_weights(k: int, n: int, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """``chi^2_k - ratio chi^2_{k (n-1)} / (n - 1) > 0`` is ``F(k, k (n - 1)) > ratio``, as k
    equal numerator weights with 1 degree of freedom and k denominator ones with n - 1."""
    weights = np.r_[np.ones(k), np.full(k, -ratio / (n - 1))]
    return weights, np.r_[np.ones(k), np.full(k, n - 1.0)]


@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("n", [2, 5, 100, 1000])
def test_both_tails_match_the_f_distribution(k, n):
    """k = 1 is one dominant direction (R = t^2, F(1, n - 1)); ratios from the centre to the
    far tail: each tail at 1e-10 relative where both it and scipy's are above 1e-15, at 20%
    beyond."""
    for ratio in (0.05, 0.5, 1.0, 1.7, 4.0, 12.0, 40.0, 150.0):
        weights, df = _f_weights(k, n, ratio)
        upper, lower = chi2_combination_log_tails(weights, df)
        exact = (stats.f.logsf(ratio, k, k * (n - 1)), stats.f.logcdf(ratio, k, k * (n - 1)))
        for got, want in zip((upper, lower), exact, strict=True):
            if not want > -700:  # scipy underflows
                continue
            rtol = RTOL if want >= FAR_TAIL else 0.2
            assert abs(math.expm1(got - want)) <= rtol, (k, n, ratio, got, want)


def _imhof(weights, df) -> mpmath.mpf:
    """P(sum w_i chi^2_{nu_i} > 0) = 1/2 + (1/pi) int_0^inf sin(theta(t)) / (t rho(t)) dt with
    theta = sum nu_i atan(w_i t) / 2, rho = prod (1 + w_i^2 t^2)^(nu_i / 4) (Imhof, 1961), in
    mpmath at 30 digits."""
    pairs = [(mpmath.mpf(w), mpmath.mpf(v)) for w, v in zip(weights, df, strict=True)]

    def integrand(t):
        theta = sum(v * mpmath.atan(w * t) for w, v in pairs) / 2
        log_rho = sum(v * mpmath.log1p((w * t) ** 2) for w, v in pairs) / 4
        return mpmath.sin(theta) * mpmath.exp(-log_rho) / t

    with mpmath.workdps(30):
        return mpmath.mpf(1) / 2 + mpmath.quad(integrand, [0, 1, 10, 100, mpmath.inf]) / mpmath.pi


@pytest.mark.parametrize(
    ("numerator", "ratio", "n"),
    [
        ([1.0, *[0.02] * 10], 3.0, 100),  # one dominant eigenvalue over a flat bulk
        ([1.0, *[0.02] * 10], 20.0, 100),
        ([1.0, *[0.02] * 10], 60.0, 20),
        ([3.1, 1.7, 0.9, 0.4, 0.22, 0.05], 4.0, 30),  # a spread spectrum
    ],
)
def test_unequal_weights_match_imhofs_integral(numerator, ratio, n):
    """Numerator weights with 1 degree of freedom each, the mean-shift statistic's denominator
    (-ratio w / (n - 1), n - 1 degrees of freedom): at 1e-10 relative. The reference merges
    equal weights into one chi-square (10 x chi^2_1 = chi^2_10), klest sees them one by one."""
    lam = np.array(numerator)
    weights = np.r_[lam, -ratio * lam / (n - 1)]
    df = np.r_[np.ones(lam.size), np.full(lam.size, n - 1.0)]
    merged: dict[float, float] = {}
    for w, v in zip(weights, df, strict=True):
        merged[w] = merged.get(w, 0.0) + v
    want = _imhof(list(merged), list(merged.values()))
    upper, lower = chi2_combination_log_tails(weights, df)
    assert float(want) > 1e-15
    assert abs(float(mpmath.exp(upper) / want - 1)) <= RTOL
    assert abs(float(mpmath.exp(lower) / (1 - want) - 1)) <= RTOL


def test_one_signed_and_degenerate_combinations():
    assert chi2_combination_log_tails(np.array([1.0, 2.0])) == (0.0, -math.inf)
    assert chi2_combination_log_tails(np.array([-1.0, 0.0])) == (-math.inf, 0.0)
    with pytest.raises(ValueError, match="degrees of freedom"):
        chi2_combination_log_tails(np.array([1.0, -1.0]), np.array([1.0, 0.0]))


def test_normal_deviate_of_a_log_tail():
    """Phi^-1(1 - p) from log p: against scipy's isf while p is a float (1e-12 relative), and
    against mpmath's erfc far below the smallest float (log p = -2000: z = 63.2)."""
    for p in (0.7, 0.5, 0.1, 1e-3, 4.3e-7, 1e-100, 1e-300):
        got = normal_upper_deviate(math.log(p), math.log1p(-p))
        assert got == pytest.approx(stats.norm.isf(p), rel=1e-12, abs=1e-12)
        got_lower = normal_upper_deviate(math.log1p(-p), math.log(p))
        assert got_lower == pytest.approx(-stats.norm.isf(p), rel=1e-12, abs=1e-12)
    z = normal_upper_deviate(-2000.0, 0.0)
    with mpmath.workdps(40):
        log_tail = mpmath.log(mpmath.erfc(mpmath.mpf(z) / mpmath.sqrt(2)) / 2)
    assert float(log_tail) == pytest.approx(-2000.0, rel=1e-12)


@pytest.mark.parametrize("coordinates", [1, 50])
def test_mean_shift_z_of_draws_along_one_direction_is_a_t_test(coordinates):
    """Draws along one fixed direction (the covariance has rank 1; with 50 coordinates and 30
    draws through the Gram matrix): the statistic is t^2 on n - 1 = 29 degrees of freedom, so
    z = Phi^-1(1 - P(F(1, 29) > t^2)) exactly (at 1e-9 in z: the tail's 1e-10)."""
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(coordinates, generator=g, dtype=torch.float64)
    for shift in (0.0, 0.3, 0.8, 1.5):
        x = torch.randn(30, generator=g, dtype=torch.float64) + shift
        draws = x[:, None] * direction
        t2 = float(x.mean() ** 2 / (x.var() / 30))
        want = stats.norm.isf(stats.f.sf(t2, 1, 29))
        assert mean_shift_z(draws, torch.zeros(coordinates, dtype=torch.float64)) == (
            pytest.approx(want, rel=1e-9, abs=1e-9)
        )
