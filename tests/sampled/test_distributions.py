"""``torch.distributions`` objects in place of log-probs (klest.sampled.distributions): the
closed form against hand-written formulas (value and gradient), the Monte Carlo draw against
quadrature, and the errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.distributions import (
    Independent,
    MultivariateNormal,
    Normal,
    Poisson,
    StudentT,
)

import klest
import klest._checks
from klest.testbeds import make_generator
from tests._stats import RATE, assert_failures_consistent, z_for
from tests._tolerance import assert_close_to_rounding

DIRECTIONS = ("pi||ref", "ref||pi")


def normal_kl(m1, s1, m2, s2):
    """KL(N(m1, s1^2) || N(m2, s2^2)), elementwise."""
    return torch.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5


def mvn_kl(m1, c1, m2, c2):
    """KL(N(m1, c1) || N(m2, c2)) for batches of means ``[N, D]`` and covariances."""
    d = m1.shape[-1]
    inv2 = torch.linalg.inv(c2)
    diff = (m2 - m1).unsqueeze(-1)
    trace = torch.diagonal(inv2 @ c1, dim1=-2, dim2=-1).sum(-1)
    quad = (diff.transpose(-1, -2) @ inv2 @ diff)[..., 0, 0]
    return 0.5 * (trace + quad - d + torch.logdet(c2) - torch.logdet(c1))


def _params(g, n=6, d=3):
    mu = torch.randn(n, d, generator=g, dtype=torch.float64).requires_grad_()
    sigma = (0.3 + torch.rand(n, d, generator=g, dtype=torch.float64)).requires_grad_()
    return mu, sigma


def _check_value_and_gradient(got, want, params, ulps, scale, what):
    """klest's loss against the hand formula's batch mean: values, and the gradients of each
    with respect to ``params``."""
    assert_close_to_rounding(got, want, ulps=ulps, scale=scale, what=what)
    g_got = torch.autograd.grad(got, params, retain_graph=True)
    g_want = torch.autograd.grad(want, params)
    for a, b, p in zip(g_got, g_want, params, strict=True):
        assert_close_to_rounding(a, b, ulps=ulps, what=f"{what}: gradient of {tuple(p.shape)}")


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_normal_pairs_are_the_closed_form_summed_over_the_last_dimension(direction):
    """Normal over ``[N, D]`` (no Independent): N rows of D coordinates whose KLs add up, the
    diagonal Gaussian's KL, averaged over N; its gradient is the formula's. Tolerance: a sum of
    D = 3 terms of a few roundings each, then a mean of N: 8 (D + N) ulps of the largest term."""
    g = make_generator(0)
    mu, sigma = _params(g)
    m2 = torch.randn(3, generator=g, dtype=torch.float64)
    s2 = 0.5 + torch.rand(3, generator=g, dtype=torch.float64)
    pi, ref = Normal(mu, sigma), Normal(m2, s2)
    loss, details = klest.kl_penalty(pi, ref, direction=direction, return_details=True)
    args = (mu, sigma, m2, s2) if direction == "pi||ref" else (m2, s2, mu, sigma)
    terms = normal_kl(*args)
    want = terms.sum(-1).mean()
    scale = float(terms.detach().abs().max()) + 1
    _check_value_and_gradient(loss, want, (mu, sigma), 8 * (3 + 6), scale, direction)
    assert details.method == "closed-form" and details.diagnostics.pareto_k is None
    est, est_details = klest.kl_estimate(pi, ref, direction=direction, return_details=True)
    assert_close_to_rounding(est, want, ulps=8 * (3 + 6), scale=scale)
    assert est_details.method == "closed-form"


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_multivariate_normal_is_the_closed_form(direction):
    """MultivariateNormal (event dimension 3), batch [N]: the textbook formula with explicit
    inverses and log-determinants. Tolerance: a 3 x 3 solve and log-determinant round to about
    D^3 ulps of the entries' size (the covariances are well conditioned here), and the mean
    over N adds N: 8 (27 + 6) ulps."""
    g = make_generator(1)
    mu = torch.randn(6, 3, generator=g, dtype=torch.float64).requires_grad_()
    a = torch.randn(6, 3, 3, generator=g, dtype=torch.float64)
    base = a @ a.transpose(-1, -2) + 3 * torch.eye(3, dtype=torch.float64)
    factor = torch.linalg.cholesky(base).requires_grad_()
    scale_tril = torch.tril(factor)  # the parameter's lower triangle, for both computations
    m2 = torch.randn(3, generator=g, dtype=torch.float64)
    c2 = torch.tensor([[2.0, 0.3, 0.0], [0.3, 1.0, 0.2], [0.0, 0.2, 1.5]], dtype=torch.float64)
    pi = MultivariateNormal(mu, scale_tril=scale_tril)
    ref = MultivariateNormal(m2, covariance_matrix=c2)
    loss = klest.kl_penalty(pi, ref, direction=direction)
    c1 = scale_tril @ scale_tril.transpose(-1, -2)
    args = (mu, c1, m2, c2) if direction == "pi||ref" else (m2, c2, mu, c1)
    per_row = mvn_kl(*args)
    want = per_row.mean()
    scale = float(per_row.detach().abs().max()) + 1
    _check_value_and_gradient(loss, want, (mu, factor), 8 * (27 + 6), scale, direction)


def test_independent_normals_with_a_broadcast_prior_and_a_mask():
    """``Independent(Normal(mu, sigma), 1)`` against a prior ``Independent(Normal(0, 1), 1)``
    whose batch shape is () (broadcast over the N posteriors): one KL per data point; a mask
    leaves data points out of the value and the gradient, and the named estimators take the
    same inputs (the closed form, whatever the estimator)."""
    g = make_generator(2)
    mu, sigma = _params(g)
    prior = Independent(Normal(torch.zeros(3, dtype=torch.float64), 1.0), 1)
    pi = Independent(Normal(mu, sigma), 1)
    mask = torch.tensor([True, False, True, True, False, True])
    loss = klest.kl_penalty(pi, prior, mask=mask)
    per_point = normal_kl(mu, sigma, 0.0, torch.ones((), dtype=torch.float64)).sum(-1)
    want = per_point[mask].mean()
    scale = float(per_point.detach().abs().max()) + 1
    _check_value_and_gradient(loss, want, (mu, sigma), 8 * (3 + 6), scale, "masked")
    for fn in (klest.k1, klest.k2, klest.k3, klest.k_abs):
        assert_close_to_rounding(fn(pi, prior, mask=mask), want, ulps=8 * 9, scale=scale)
    none = klest.kl_estimate(pi, prior, mask=mask, reduction="none")
    assert none.shape == (6,) and torch.equal(none[~mask], torch.zeros(2, dtype=none.dtype))


def _quadrature_kl(mu: float, sigma: float, df: float) -> float:
    """KL(N(mu, sigma^2) || StudentT(df)) by the trapezoid rule over mu +- 14 sigma (float64;
    the integrand's tails beyond are below 1e-40, the grid's error below 1e-10)."""
    x = torch.linspace(mu - 14 * sigma, mu + 14 * sigma, 400001, dtype=torch.float64)
    q = Normal(torch.tensor(mu, dtype=torch.float64), sigma)
    p = StudentT(torch.tensor(df, dtype=torch.float64))
    lq = q.log_prob(x)
    return float(torch.trapezoid(lq.exp() * (lq - p.log_prob(x)), x))


N_DRAWS, MU, SIGMA, DF = 20000, 0.7, 0.6, 4.0


def _drawn(seed: int):
    """k1's per-draw values and pathwise gradients w.r.t. mu of Normal(MU, SIGMA) against
    StudentT(DF), ``N_DRAWS`` draws through the adapter at the global seed ``seed``, and its
    details."""
    mu = torch.full((N_DRAWS,), MU, dtype=torch.float64, requires_grad=True)
    pi, ref = Normal(mu, SIGMA), StudentT(torch.tensor(DF, dtype=torch.float64))
    torch.manual_seed(seed)
    loss, details = klest.kl_penalty(
        pi, ref, estimator="k1", reduction="per-sequence", return_details=True
    )
    (grad,) = torch.autograd.grad(loss.sum(), mu)
    return pi, ref, mu, loss, grad, details


def _mc_z_scores(loss: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    """(value, gradient): the distance of the means from the quadrature's KL and its derivative
    (central difference, h = 1e-4: error ~1e-8, far below the standard errors ~1e-2), in
    standard errors."""
    exact = _quadrature_kl(MU, SIGMA, DF)
    h = 1e-4
    slope = (_quadrature_kl(MU + h, SIGMA, DF) - _quadrature_kl(MU - h, SIGMA, DF)) / (2 * h)
    value = loss.detach()
    root_n = math.sqrt(N_DRAWS)
    return (
        (float(value.mean()) - exact) / (float(value.std()) / root_n),
        (float(grad.mean()) - slope) / (float(grad.std()) / root_n),
    )


def test_a_pair_without_a_closed_form_is_one_reparameterized_draw_each():
    """Normal against StudentT (no registered KL): one ``pi.rsample()`` per batch element, the
    log-prob path with the pathwise gradient. The same numbers as drawing by hand with the same
    seed; over 20000 draws k1's value and the mean pathwise gradient with respect to mu are
    within the Bonferroni z (2 comparisons at RATE) of their standard errors of the
    quadrature's KL and its derivative."""
    pi, ref, mu, loss, grad, details = _drawn(seed=0)
    torch.manual_seed(0)
    x = pi.rsample()
    by_hand = klest.kl_penalty(
        pi.log_prob(x), ref.log_prob(x), estimator="k1", grad="pathwise", reparameterized=True,
        reduction="per-sequence",
    )  # fmt: skip
    (grad_by_hand,) = torch.autograd.grad(by_hand.sum(), mu)
    assert torch.equal(loss, by_hand) and torch.equal(grad, grad_by_hand)
    assert details.method == "monte-carlo"
    z_value, z_grad = _mc_z_scores(loss, grad)
    assert max(abs(z_value), abs(z_grad)) <= z_for(RATE, 2), (z_value, z_grad)


@pytest.mark.calibration
def test_calibration_the_drawn_value_and_gradient_over_seeds():
    """The Monte Carlo comparison above over 100 seeds: no seed fails (normal z-scores of means
    of 20000 draws: the rate holds)."""
    worst = [max(map(abs, _mc_z_scores(*_drawn(seed)[3:5]))) for seed in range(100, 200)]
    assert_failures_consistent(worst, z_for(RATE, 2), RATE, "drawn KL and gradient")


def test_monte_carlo_values_get_the_tail_diagnostic(monkeypatch):
    """A drawn k3 carries r = ref/pi like any other: its k-hat is in the details (StudentT over
    Normal has an unbounded ratio: it may warn, which is left out of the process's record)."""
    monkeypatch.setattr(klest._checks, "_WARNED_ONCE", set())
    mu = torch.zeros(500, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, details = klest.kl_estimate(
            Normal(mu, 1.0), StudentT(torch.tensor(3.0, dtype=torch.float64)), return_details=True
        )
    assert details.method == "monte-carlo" and math.isfinite(details.diagnostics.pareto_k)


def test_bad_pairs_say_what_to_do():
    """A distribution with a tensor, unequal event shapes, no closed form and no rsample, or an
    option that needs log-probs: a TypeError / ValueError naming the problem and showing the
    two lines that pass log-probs instead."""
    q = Independent(Normal(torch.zeros(4, 3), 1.0), 1)
    with pytest.raises(TypeError, match=r"(?s)got Independent and Tensor.*x = pi.rsample\(\)"):
        klest.kl_penalty(q, torch.zeros(4))
    with pytest.raises(TypeError, match=r"(?s)Tensor and Normal.*pi.log_prob\(x\)"):
        klest.kl_estimate(torch.zeros(4), Normal(0.0, 1.0))
    with pytest.raises(ValueError, match=r"event shape \(3,\) but ref .* has \(\).*Independent"):
        klest.kl_penalty(q, Normal(0.0, 1.0))
    with pytest.raises(ValueError, match=r"(?s)no closed-form KL.*no rsample.*x = pi.sample\(\)"):
        klest.kl_estimate(Poisson(torch.ones(4)), Normal(0.0, 1.0))
    with pytest.raises(ValueError, match=r"(?s)logp_behavior applies to log-probs.*rsample"):
        klest.kl_penalty(q, q, logp_behavior=torch.zeros(4))
    with pytest.raises(ValueError, match="do not broadcast"):
        klest.kl_estimate(Normal(torch.zeros(4), 1.0), Normal(torch.zeros(3), 1.0))
