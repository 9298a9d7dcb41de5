"""k3 and its ref||pi analogue: precision near 0, no NaN for finite input, overflow only past range.

References are computed with mpmath at 50 significant digits.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import klest
from klest._numerics import exp_tail, xexp_tail

mpmath.mp.dps = 50


def _ref_exp_tail(x: float) -> float:
    x = mpmath.mpf(x)
    return float(mpmath.exp(x) - 1 - x)


def _ref_xexp_tail(x: float) -> float:
    x = mpmath.mpf(x)
    return float(x * mpmath.exp(x) - mpmath.exp(x) + 1)


def _grid() -> list[float]:
    mags = [10.0**e for e in range(-12, 3)] + [0.3, 0.49, 0.5, 0.51, 0.7, 3.0, 30.0, 80.0]
    return sorted({s * m for m in mags for s in (-1.0, 1.0)})


@pytest.mark.parametrize(("fn", "ref"), [(exp_tail, _ref_exp_tail), (xexp_tail, _ref_xexp_tail)])
def test_tail_functions_match_high_precision_float64(fn, ref):
    xs = torch.tensor(_grid(), dtype=torch.float64)
    expected = torch.tensor([ref(float(x)) for x in xs], dtype=torch.float64)
    got = fn(xs)
    rel = ((got - expected).abs() / expected.abs()).max()
    assert rel < 1e-14, f"max relative error {float(rel):.3g}"


@pytest.mark.parametrize(("fn", "ref"), [(exp_tail, _ref_exp_tail), (xexp_tail, _ref_xexp_tail)])
def test_tail_functions_float32_relative_error(fn, ref):
    xs = torch.tensor([x for x in _grid() if abs(x) <= 80], dtype=torch.float32)
    expected = torch.tensor([ref(float(x)) for x in xs], dtype=torch.float64)
    got = fn(xs).double()
    rel = ((got - expected).abs() / expected.abs()).max()
    assert rel < 2e-6, f"max relative error {float(rel):.3g}"
    assert bool((got >= 0).all())


def test_k3_relative_error_near_delta_1e_6_float64():
    delta = torch.tensor([1e-6, -1e-6, 3e-7, 1e-8], dtype=torch.float64)
    got = klest.k3(delta, torch.zeros_like(delta))
    expected = torch.tensor([_ref_exp_tail(-float(d)) for d in delta], dtype=torch.float64)
    assert float(((got - expected).abs() / expected).max()) <= 1e-6


def test_k3_float32_never_negative_and_beats_naive_formula():
    delta = torch.logspace(-7, -1, 400, dtype=torch.float32)
    delta = torch.cat([delta, -delta])
    got = klest.k3(delta, torch.zeros_like(delta))
    assert bool((got >= 0).all())
    expected = torch.tensor([_ref_exp_tail(-float(d)) for d in delta], dtype=torch.float64)
    ours = float(((got.double() - expected).abs() / expected).median())
    # The formula peers use: exp(x) - x - 1 in float32 cancels catastrophically near 0.
    x = -delta
    naive = (torch.exp(x) - x - 1).double()
    theirs = float(((naive - expected).abs() / expected).median())
    assert ours < 1e-6 < 1e-2 < theirs, (ours, theirs)


def test_k3_gradient_is_accurate_near_zero():
    delta = torch.tensor(
        [1e-9, -1e-7, 1e-4, 0.3, -0.6, 5.0], dtype=torch.float64, requires_grad=True
    )
    klest.k3(delta, torch.zeros_like(delta)).sum().backward()
    expected = -torch.expm1(-delta.detach())  # d/d delta of e^{-delta} - 1 + delta
    assert float(((delta.grad - expected).abs() / expected.abs()).max()) < 1e-12


finite64 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=64)
finite32 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@given(lp=st.lists(finite32, min_size=1, max_size=8), lq=st.lists(finite32, min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_no_nan_for_finite_input_and_inf_only_past_range(direction, estimator, lp, lq):
    n = min(len(lp), len(lq))
    logp = torch.tensor(lp[:n], dtype=torch.float32)
    logp_ref = torch.tensor(lq[:n], dtype=torch.float32)
    out = klest.kl_estimate(logp, logp_ref, estimator=estimator, direction=direction)
    assert not bool(torch.isnan(out).any())
    # +inf only where the true value (here: float64 arithmetic) is past float32's range.
    wide = klest.kl_estimate(
        logp.double(), logp_ref.double(), estimator=estimator, direction=direction
    )
    overflow = torch.isinf(out)
    assert bool((wide[overflow].abs() > torch.finfo(torch.float32).max).all())


@given(d=finite64)
@settings(max_examples=200, deadline=None)
def test_k3_both_directions_nonnegative_float64(d):
    delta = torch.tensor([d], dtype=torch.float64)
    for direction in ("pi||ref", "ref||pi"):
        value = klest.k3(delta, torch.zeros_like(delta), direction=direction)
        assert float(value) >= 0.0


def test_large_log_ratios_up_to_1e4():
    delta = torch.tensor([1e4, 5e3, 700.0, -1e4], dtype=torch.float64)
    pr = klest.k3(delta, torch.zeros_like(delta))
    assert torch.allclose(pr[:3], delta[:3] - 1.0, rtol=1e-15)
    assert math.isinf(float(pr[3]))  # e^{1e4}: the true value is past float64's range
    rp = klest.k3(delta, torch.zeros_like(delta), direction="ref||pi")
    assert torch.allclose(
        rp[:3], torch.ones(3, dtype=torch.float64)
    )  # r -> 0: r log r - r + 1 -> 1


def test_logp_ref_minus_inf_gives_inf_for_pi_ref_and_finite_for_ref_pi():
    logp = torch.tensor([-1.0, -2.0])
    logp_ref = torch.tensor([float("-inf"), -2.0])
    assert math.isinf(float(klest.k3(logp, logp_ref)[0]))
    assert math.isinf(float(klest.k1(logp, logp_ref)[0]))
    rp = klest.k3(logp, logp_ref, direction="ref||pi")
    assert float(rp[0]) == 1.0 and float(rp[1]) == 0.0
    assert float(klest.k1(logp, logp_ref, direction="ref||pi")[0]) == 0.0
