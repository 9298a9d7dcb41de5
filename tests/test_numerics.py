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
from klest._numerics import exp_neg_tail, exp_tail, xexp_tail

mpmath.mp.dps = 50


def ratio(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (<= 0) whose difference is exactly ``delta``: min(delta, 0), min(-delta, 0)."""
    return delta.clamp(max=0), (-delta).clamp(max=0)


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
    got = klest.k3(*ratio(delta), reduction="none")
    expected = torch.tensor([_ref_exp_tail(-float(d)) for d in delta], dtype=torch.float64)
    # the README's "relative error ~1e-16 at delta = 1e-6": a few units of float64 roundoff
    assert float(((got - expected).abs() / expected).max()) <= 4 * torch.finfo(torch.float64).eps


def test_k3_float32_never_negative_and_beats_naive_formula():
    delta = torch.logspace(-7, -1, 400, dtype=torch.float32)
    delta = torch.cat([delta, -delta])
    got = klest.k3(*ratio(delta), reduction="none")
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
    klest.k3(*ratio(delta), reduction="sum").backward()
    expected = -torch.expm1(-delta.detach())  # d/d delta of e^{-delta} - 1 + delta
    assert float(((delta.grad - expected).abs() / expected.abs()).max()) < 1e-12


finite64 = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=64)
# Log-probs: their differences, the log-ratios, cover [-1e4, 1e4].
finite32 = st.floats(min_value=-1e4, max_value=0.0, allow_nan=False, width=32)


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
@given(lp=st.lists(finite32, min_size=1, max_size=8), lq=st.lists(finite32, min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_no_nan_for_finite_input_and_inf_only_past_range(direction, estimator, lp, lq):
    n = min(len(lp), len(lq))
    logp = torch.tensor(lp[:n], dtype=torch.float32)
    logp_ref = torch.tensor(lq[:n], dtype=torch.float32)
    out = klest.kl_estimate(
        logp, logp_ref, estimator=estimator, direction=direction, reduction="none"
    )
    assert not bool(torch.isnan(out).any())
    # +inf only where the true value (here: float64 arithmetic) is past float32's range.
    wide = klest.kl_estimate(
        logp.double(), logp_ref.double(), estimator=estimator, direction=direction, reduction="none"
    )
    overflow = torch.isinf(out)
    assert bool((wide[overflow].abs() > torch.finfo(torch.float32).max).all())


F32_MAX = float(torch.finfo(torch.float32).max)
EPS32 = float(torch.finfo(torch.float32).eps)
EPS64 = float(torch.finfo(torch.float64).eps)
TINY32 = 2.0**-149  # the smallest float32 subnormal


def _exact_cv(delta: float, alpha: float, direction: str) -> tuple[mpmath.mpf, mpmath.mpf]:
    """cv = k1 + alpha * u at log-ratio ``delta`` in 50 digits, and the sum of its terms' sizes.

    The size ``|k1| + |alpha| (r + 1)`` bounds what rounding of the terms can cost: a correct
    float32 evaluation is within a few ulps of it (times ``1 + |log r|``, the amplification of
    exp's argument rounding).
    """
    x = -mpmath.mpf(delta)  # log r
    r = mpmath.exp(x)
    if direction == "pi||ref":
        naive, u = -x, r - 1
    else:
        naive, u = x * r, 1 - r
    return naive + alpha * u, abs(naive) + abs(alpha) * (r + 1)


def _check_against_exact(out: torch.Tensor, exact: list, size: list, log_r: list) -> None:
    """No NaN; inf only past float32's range with the right sign; finite values accurate."""
    assert not bool(torch.isnan(out).any()), out
    for got, e, sz, lr in zip(out.tolist(), exact, size, log_r, strict=True):
        if math.isinf(got):
            # Rounds to inf only from at least the largest float32 (less half an ulp).
            assert abs(e) >= F32_MAX * (1 - EPS32) and (e > 0) == (got > 0), (got, e)
        else:
            # Plus subnormal ulps (absolute), which x e^x can multiply by |x|.
            tol = 16 * (1 + abs(lr)) * (EPS32 * float(sz) + TINY32)
            assert abs(got - float(e)) <= tol, (got, float(e), tol)


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
@pytest.mark.parametrize("alpha", [0.5, 2.0, "loo"])
@given(lp=st.lists(finite32, min_size=2, max_size=8), lq=st.lists(finite32, min_size=2, max_size=8))
@settings(max_examples=60, deadline=None)
def test_control_variate_no_nan_and_inf_only_past_range(direction, alpha, lp, lq):
    """cv against 50-digit arithmetic: the overflowing ratio r gives +-inf or the finite value.

    For ``alpha="loo"`` the exact value uses the coefficients the estimator fitted (recomputed
    with ``fit_alpha`` on the same terms): what is tested is the combination, not the fit.
    """
    from klest.sampled.control_variates import fit_alpha
    from klest.sampled.terms import ratio_terms

    n = min(len(lp), len(lq))
    logp = torch.tensor(lp[:n], dtype=torch.float32)
    logp_ref = torch.tensor(lq[:n], dtype=torch.float32)
    delta = logp - logp_ref  # the float32 log-ratio the estimator sees: the reference's input
    out = klest.cv(logp, logp_ref, alpha=alpha, direction=direction, reduction="none")
    if alpha == "loo":
        terms = ratio_terms(delta.reshape(-1, 1), direction)
        valid = torch.ones(n, 1, dtype=torch.bool)
        alphas = fit_alpha(terms.naive, terms.u, valid, "loo").float().tolist()
    else:
        alphas = [alpha] * n
    pairs = [_exact_cv(d, a, direction) for d, a in zip(delta.tolist(), alphas, strict=True)]
    _check_against_exact(
        out, [e for e, _ in pairs], [s for _, s in pairs], [-d for d in delta.tolist()]
    )


def test_control_variate_far_values_examples():
    """The reviewer's cases: finite inputs whose ratio overflows, and a finite far value."""
    one = torch.zeros(1)
    assert float(klest.cv(torch.tensor([-100.0]), one, alpha=0.5)) == math.inf
    assert float(klest.cv(torch.tensor([-100.0]), one, alpha=-0.5)) == -math.inf
    assert float(klest.cv(torch.tensor([-100.0]), one, alpha=2.0, direction="ref||pi")) == (
        math.inf
    )
    d64 = torch.tensor([-800.0], dtype=torch.float64)
    assert float(klest.cv(*ratio(d64), alpha=0.5)) == math.inf
    # e^{800} overflows float64 but 1e-300 e^{800} = e^{109.2} does not.
    tiny = klest.cv(*ratio(d64), alpha=1e-300)
    a = mpmath.mpf(1e-300)  # the float64 value
    expected = a * mpmath.exp(800) - 800 - a
    # The log form's documented error: about |x| = 800 ulps.
    assert float(tiny) == pytest.approx(float(expected), rel=1e-12)
    # ref||pi at r = e^86 with alpha = 86: (x - alpha) e^x + alpha = 86 exactly.
    assert float(klest.cv(torch.tensor([-86.0]), one, alpha=86.0, direction="ref||pi")) == 86.0
    loo = klest.cv(*ratio(torch.tensor([-100.0, 0.1, 0.2, -0.3])), alpha="loo", reduction="none")
    assert not bool(torch.isnan(loo).any())


def test_control_variate_gradient_is_finite_where_the_value_is():
    delta = torch.tensor([-100.0, -90.0, 0.1], requires_grad=True)
    klest.cv(*ratio(delta), alpha=-1e-40, reduction="sum").backward()
    # d/d delta of delta + alpha (e^{-delta} - 1) = 1 - alpha e^{-delta}.
    expected = [1 + 1e-40 * math.exp(100), 1 + 1e-40 * math.exp(90), 1 + 1e-40 * math.exp(-0.1)]
    assert delta.grad.tolist() == pytest.approx(expected, rel=1e-5)


def test_nonfinite_alpha_is_rejected():
    with pytest.raises(ValueError, match="alpha must be finite"):
        klest.cv(torch.zeros(2), torch.zeros(2), alpha=math.nan)
    with pytest.raises(ValueError, match="alpha must be finite"):
        klest.cv(torch.zeros(2), torch.zeros(2), alpha=torch.tensor(math.inf))


F_DIVERGENCES = {
    # name: (f, f' as a function of r, f'(1)); exact in mpmath via the same expressions
    "KL(pi||ref)": (lambda r: -torch.log(r), lambda r: -1 / r, -1.0, lambda r: -mpmath.log(r)),
    "KL(ref||pi)": (
        lambda r: torch.xlogy(r, r),
        lambda r: mpmath.log(r) + 1 if r > 0 else 0,
        1.0,
        lambda r: r * mpmath.log(r) if r > 0 else mpmath.mpf(0),
    ),
    "chi-squared": (lambda r: (r - 1) ** 2, lambda r: 2 * (r - 1), 0.0, lambda r: (r - 1) ** 2),
}


@pytest.mark.parametrize("name", list(F_DIVERGENCES))
@given(lp=st.lists(finite32, min_size=1, max_size=8), lq=st.lists(finite32, min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_f_divergence_no_nan_and_inf_only_past_range_or_a_clear_error(name, lp, lq):
    """Against 50 digits; a ValueError is allowed only where r is outside float64's range."""
    f, f_prime, slope, f_exact = F_DIVERGENCES[name]
    n = min(len(lp), len(lq))
    logp = torch.tensor(lp[:n], dtype=torch.float32)
    logp_ref = torch.tensor(lq[:n], dtype=torch.float32)
    delta = (logp - logp_ref).tolist()
    r64 = torch.exp(-(logp - logp_ref).double())
    out_of_range = bool(((r64 == 0) | torch.isinf(r64)).any())
    try:
        out = klest.f_divergence(logp, logp_ref, f=f, reduction="none")
    except ValueError as err:
        assert out_of_range and "outside float64's range" in str(err), err
        return
    exact, size = [], []
    for d in delta:
        r = mpmath.exp(-mpmath.mpf(d))
        exact.append(f_exact(r) - slope * (r - 1))
        # f is evaluated in float64 on a rounded r: a few float64 ulps of each term, and of
        # r f'(r) for r's own rounding; then one rounding to float32 (in _check's tolerance).
        size.append(
            (abs(f_exact(r)) + abs(r * f_prime(r)) + abs(slope) * (r + 1)) * EPS64 / EPS32
            + abs(f_exact(r) - slope * (r - 1))
        )
    _check_against_exact(out, exact, size, [0.0] * n)


def test_f_divergence_far_values_and_errors():
    one = torch.zeros(1)
    chi2 = F_DIVERGENCES["chi-squared"][0]
    kl = F_DIVERGENCES["KL(pi||ref)"][0]
    # Computed in float64: r = e^{100} is fine, the results are past float32's range.
    assert float(klest.f_divergence(torch.tensor([-100.0]), one, f=chi2)) == math.inf
    assert float(klest.f_divergence(torch.tensor([-100.0]), one, f=kl)) == math.inf
    assert float(klest.f_divergence(*ratio(torch.tensor([100.0])), f=kl)) == pytest.approx(99.0)
    with pytest.raises(ValueError, match=r"outside float64's range .* use klest.kl_estimate"):
        klest.f_divergence(*ratio(torch.tensor([1e4])), f=kl)  # -log(0) is not the limit
    with pytest.raises(ValueError, match="outside float64's range"):
        klest.f_divergence(torch.tensor([-1e4]), one, f=chi2)  # inf - inf
    with pytest.raises(ValueError, match="f returned NaN"):
        klest.f_divergence(
            *ratio(torch.tensor([0.5])), f=lambda r: torch.log(r - 1), f_prime_at_1=0
        )


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 2e-7), (torch.float64, 1e-10)])
def test_f_divergence_precision_for_moderate_log_ratios(dtype, bound):
    """The documented precision for |delta| >= 1e-3 (f = -log, against 50 digits).

    Float32 inputs are computed in float64, so they meet float32's own precision (the float32
    computation this replaces had relative error 2e-2 at delta = 1e-3).
    """
    delta = torch.tensor([1e-3, -1e-3, 3e-2, -0.4, 2.0, -7.0], dtype=dtype)
    got = klest.f_divergence(*ratio(delta), f=lambda r: -torch.log(r), reduction="none")
    expected = torch.tensor([_ref_exp_tail(-float(d)) for d in delta], dtype=torch.float64)
    assert max_rel(got.double(), expected) <= bound


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs()).max())


@given(d=finite64)
@settings(max_examples=200, deadline=None)
def test_k3_both_directions_nonnegative_float64(d):
    delta = torch.tensor([d], dtype=torch.float64)
    for direction in ("pi||ref", "ref||pi"):
        value = klest.k3(*ratio(delta), direction=direction, reduction="none")
        assert float(value) >= 0.0


def test_large_log_ratios_up_to_1e4():
    delta = torch.tensor([1e4, 5e3, 700.0, -1e4], dtype=torch.float64)
    pr = klest.k3(*ratio(delta), reduction="none")
    assert torch.allclose(pr[:3], delta[:3] - 1.0, rtol=1e-15)
    assert math.isinf(float(pr[3]))  # e^{1e4}: the true value is past float64's range
    rp = klest.k3(*ratio(delta), direction="ref||pi", reduction="none")
    assert torch.allclose(
        rp[:3], torch.ones(3, dtype=torch.float64)
    )  # r -> 0: r log r - r + 1 -> 1


def test_weighted_zero_stays_zero_when_the_importance_weight_overflows():
    """w k with k = 0 and w = e^{1e4}: 0 (the weight is finite in exact arithmetic), not NaN."""
    out = klest.k3(
        torch.tensor([0.0]),
        torch.tensor([0.0]),
        logp_behavior=torch.tensor([-1e4]),
    )
    assert float(out) == 0.0


def test_kl_penalty_names_logp_ref_when_it_is_minus_inf():
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    logp_ref = torch.tensor([[float("-inf"), -2.0], [-1.0, -2.0]])
    for grad in ("cumulative", "score"):
        with pytest.raises(
            ValueError, match=r"logp_ref is -inf at 1 position\(s\) \(first at index \(0, 0\)\)"
        ):
            klest.kl_penalty(logp, logp_ref, grad=grad)
    # KL(ref||pi) is finite there (r = 0): no error.
    assert math.isfinite(float(klest.kl_penalty(logp, logp_ref, direction="ref||pi").detach()))


def test_logp_ref_minus_inf_gives_inf_for_pi_ref_and_finite_for_ref_pi():
    logp = torch.tensor([-1.0, -2.0])
    logp_ref = torch.tensor([float("-inf"), -2.0])
    assert math.isinf(float(klest.k3(logp, logp_ref, reduction="none")[0]))
    assert math.isinf(float(klest.k1(logp, logp_ref, reduction="none")[0]))
    rp = klest.k3(logp, logp_ref, direction="ref||pi", reduction="none")
    assert float(rp[0]) == 1.0 and float(rp[1]) == 0.0
    assert float(klest.k1(logp, logp_ref, direction="ref||pi", reduction="none")[0]) == 0.0


@pytest.mark.parametrize(("fn", "ref"), [(exp_tail, _ref_exp_tail), (xexp_tail, _ref_xexp_tail)])
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 2e-6), (torch.float64, 1e-14)])
def test_tail_functions_on_a_dense_grid_across_the_series_radius(fn, ref, dtype, bound):
    """The radius and degree trade truncation against the direct formula's cancellation; both
    sides of every radius (0.2 and 0.5), densely, against 50 digits."""
    grid = torch.cat(
        [torch.linspace(-1.0, 1.0, 2001, dtype=torch.float64), torch.logspace(-8, 0.5, 400)]
    )
    xs = torch.cat([grid, -grid]).to(dtype)
    expected = torch.tensor([ref(float(x)) for x in xs], dtype=torch.float64)
    keep = expected != 0
    rel = ((fn(xs).double() - expected).abs() / expected.abs())[keep].max()
    assert rel < bound, f"max relative error {float(rel):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_neg_tail_is_exp_tail_of_the_negation_bit_for_bit(dtype):
    """k3 of KL(pi||ref) takes the log-ratio itself (no negating pass): the series' terms only
    change sign, so values and gradients equal exp_tail(-x) exactly, on both sides of the
    radius, at 0 and at the infinities."""
    grid = torch.tensor(_grid(), dtype=torch.float64)
    xs = torch.cat([grid, torch.linspace(-1, 1, 401, dtype=torch.float64)]).to(dtype)
    xs = torch.cat([xs, torch.tensor([0.0, -0.0, math.inf, -1e4, 1e4], dtype=dtype)])
    assert torch.equal(exp_neg_tail(xs), exp_tail(-xs))
    finite = xs[xs.abs() < 80]
    a = finite.clone().requires_grad_()
    b = finite.clone().requires_grad_()
    exp_neg_tail(a).sum().backward()
    exp_tail(-b).sum().backward()
    assert torch.equal(a.grad, b.grad)
    expected = torch.tensor([_ref_exp_tail(-float(x)) for x in finite], dtype=torch.float64)
    keep = expected != 0
    rel = ((exp_neg_tail(finite).double() - expected).abs() / expected.abs())[keep].max()
    assert rel < (2e-6 if dtype == torch.float32 else 1e-14)


# d/dx of e^x - 1 - x, e^-x - 1 + x and x e^x - e^x + 1, written independently of the code.
_TAIL_DERIVATIVES = [
    (exp_tail, torch.expm1),
    (exp_neg_tail, lambda x: -torch.expm1(-x)),
    (xexp_tail, lambda x: x * torch.exp(x)),
]


@pytest.mark.parametrize(("fn", "derivative"), _TAIL_DERIVATIVES)
def test_tail_functions_under_forward_mode_ad_and_vmap(fn, derivative):
    """The in-place fast path (``addcmul(out=)``) is one that forward-mode AD and ``vmap``
    reject: under them each function takes the graph path, on both sides of the radius."""
    xs = torch.tensor(_grid(), dtype=torch.float64)
    xs = xs[xs.abs() < 30]
    ones = torch.ones_like(xs)
    value, tangent = torch.func.jvp(fn, (xs,), (ones,))
    assert torch.equal(value, fn(xs))
    torch.testing.assert_close(tangent, derivative(xs), rtol=1e-13, atol=1e-300)
    assert torch.equal(torch.func.vmap(fn)(xs.view(2, -1)), fn(xs).view(2, -1))


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_k3_under_forward_mode_ad_equals_the_autograd_directional_derivative(direction):
    g = torch.Generator().manual_seed(11)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    logp_ref = logp + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    logp_ref = logp_ref.clamp(max=0)
    v = torch.randn(3, 5, generator=g, dtype=torch.float64)

    def f(x):
        return klest.k3(x, logp_ref, direction=direction)

    x = logp.clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(x), x)
    _, tangent = torch.func.jvp(f, (logp,), (v,))
    torch.testing.assert_close(tangent, (grad * v).sum(), rtol=1e-12, atol=1e-15)
