"""VariationalGaussian: its samples, its closed-form KLs, and the quadrature of the K-sample
bounds' means (against the ELBO where they equal it, against scipy's adaptive integration, and
against itself at more nodes)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import integrate

from klest.testbeds import GaussianTestbed, VariationalGaussian, make_generator
from klest.testbeds.gaussian import gaussian_log_density
from tests._tolerance import assert_close_to_rounding


def _testbed(k: int) -> VariationalGaussian:
    return VariationalGaussian(k=k, mean=0.5, log_std=0.2, mean_ref=-0.1, log_std_ref=0.1)


def test_samples_are_k_reparameterized_draws_per_data_point():
    tb = _testbed(3)
    s = tb.sample(5, generator=make_generator(0))
    assert s.logp.shape == s.logp_ref.shape == s.logp_stl.shape == (5, 3)
    assert s.x.shape == (5, 3, 1) and s.reparameterized and s.density
    eps = torch.randn(5, 3, 1, generator=make_generator(0), dtype=torch.float64)
    z = 0.5 + math.exp(0.2) * eps
    # Tolerance: the same few operations in either order, at the terms' scale: 8 ulps.
    assert_close_to_rounding(s.x.detach(), z, ulps=8)
    log_std_ref = torch.tensor([0.1], dtype=torch.float64)
    want = gaussian_log_density(
        z, torch.tensor([-0.1], dtype=torch.float64), log_std_ref
    ) + math.log(3.0)
    assert_close_to_rounding(s.logp_ref.detach(), want, ulps=8)
    (g,) = torch.autograd.grad(s.logp_stl.sum(), tb.mean)  # through the samples only
    assert float(g.abs().max()) > 0
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        VariationalGaussian(k=0)


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_kls_are_the_gaussian_pairs(direction):
    """ref normalized is the posterior: the KLs are GaussianTestbed's of the same pair (the
    same formula: 4 ulps)."""
    tb = _testbed(2)
    pair = GaussianTestbed(mean=0.5, log_std=0.2, mean_ref=-0.1, log_std_ref=0.1)
    got, want = tb.exact_kl(direction).detach(), pair.exact_kl(direction).detach()
    assert_close_to_rounding(got, want, ulps=4)


def test_quadrature_is_the_elbo_where_the_bound_is_the_mean_log_weight():
    """K = 1 (any order) and alpha = 1 (any K): the bound's mean is the ELBO, log Z - KL, and
    the quadrature's gradient the closed form's. Tolerance: a sum of up to 60^3 nonnegative
    weights times terms of size about 10 (the log-weights at the outer nodes): 1e-12 of the
    ELBO's scale (observed about 1e-15)."""
    for k, alpha in ((1, 0.0), (1, 0.5), (1, -1.0), (3, 1.0)):
        tb = _testbed(k)
        elbo = tb.elbo()
        want = torch.cat(torch.autograd.grad(elbo, tb.parameters()))
        got = tb.exact_bound_grad(alpha)
        assert float(tb.exact_bound(alpha).detach()) == pytest.approx(
            float(elbo.detach()), abs=1e-12
        )
        assert float((got - want).abs().max()) <= 1e-12, (k, alpha, got, want)


def test_quadrature_matches_adaptive_integration_and_converges():
    """E[IWAE_2] and E[L_{0.5,2}] at 60 nodes against scipy's dblquad over the two noises
    (independent: adaptive, error bound 1e-11); 60 and 80 nodes agree to 1e-11 relative for
    K = 2 and K = 3 (values and gradients; observed 1e-12 or less). The means rise with K
    (ELBO < IWAE_2 < IWAE_3 < log Z)."""
    tb2, tb3 = _testbed(2), _testbed(3)
    mean, std = 0.5, math.exp(0.2)
    for alpha in (0.0, 0.5):

        def integrand(e1: float, e2: float, alpha: float = alpha) -> float:
            lw = []
            for e in (e1, e2):
                z = mean + std * e
                lr = -0.5 * ((z + 0.1) / math.exp(0.1)) ** 2 - 0.1 + math.log(3.0)
                lw.append(lr - (-0.5 * e * e - 0.2))  # the 1/sqrt(2 pi) cancel
            b = 1 - alpha
            top = max(lw)
            bound = top + math.log(sum(math.exp(b * (x - top)) for x in lw) / 2) / b
            return bound * math.exp(-0.5 * (e1 * e1 + e2 * e2)) / (2 * math.pi)

        want, err = integrate.dblquad(integrand, -12, 12, -12, 12, epsabs=1e-11, epsrel=1e-11)
        assert err < 1e-10
        got = float(tb2.exact_bound(alpha).detach())
        assert got == pytest.approx(want, abs=1e-9), alpha
    for tb, alpha in ((tb2, 0.0), (tb2, 0.5), (tb3, 0.0)):
        coarse, fine = tb.exact_bound_grad(alpha, nodes=60), tb.exact_bound_grad(alpha, nodes=80)
        assert float((fine - coarse).norm() / fine.norm()) < 1e-11, (tb.k, alpha)
        v60 = float(tb.exact_bound(alpha, nodes=60).detach())
        assert v60 == pytest.approx(float(tb.exact_bound(alpha, nodes=80).detach()), rel=1e-11)
    values = [float(v.detach()) for v in (tb2.elbo(), tb2.exact_bound(0.0), tb3.exact_bound(0.0))]
    assert values[0] < values[1] < values[2] < math.log(3.0), values
    with pytest.raises(ValueError, match="quadrature points is too many"):
        VariationalGaussian(k=4).exact_bound(0.0, nodes=60)
