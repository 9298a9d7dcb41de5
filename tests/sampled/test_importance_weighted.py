"""iwae_bound / renyi_bound: values and gradient means against closed forms and quadrature.

The model: pi = N(mean, exp(log_std)^2) per dimension (trainable, reparameterized samples) and
ref = Z N(mean_ref, exp(log_std_ref)^2) with Z = 3 known, mean_ref trainable too (ref's
parameter theta), from a Gaussian testbed: the ELBO is log Z - KL(pi||ref) in closed form, and
in one dimension the exact E[L_{alpha,2}] and its gradient are a 2-D Gauss-Hermite quadrature.

Statistical rule (``tests/_stats.py``): each test states its comparisons and splits ``RATE``
over them (Bonferroni, ``z_for``); a gradient mean is compared with ``klest.audit.mean_shift_z``
(one-sided, approximately N(0, 1) under the null); where a test asserts a difference *is*
detected, the expected statistic is far above the threshold (stated there). Seeds are fixed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import klest
from klest.audit import mean_shift_z
from klest.testbeds import GaussianTestbed, make_generator
from klest.testbeds.gaussian import gaussian_log_density
from tests._stats import RATE, assert_failures_consistent, z_for
from tests._tolerance import assert_close_to_rounding

LOG_Z = math.log(3.0)
GRADS = ("pathwise", "stl", "dreg")


def _testbed(dim: int = 1, *, optimum: bool = False) -> GaussianTestbed:
    """pi wider than ref (log-weights bounded above: every moment below is finite); with
    ``optimum`` pi is ref's normalized density, the exact posterior."""
    if optimum:
        tb = GaussianTestbed(mean=0.3, log_std=-0.1, mean_ref=0.3, log_std_ref=-0.1, dim=dim)
    else:
        tb = GaussianTestbed(mean=0.5, log_std=0.2, mean_ref=0.0, log_std_ref=0.0, dim=dim)
    tb.mean_ref.requires_grad_(True)  # ref's parameter theta
    return tb


def _params(tb: GaussianTestbed) -> list[torch.Tensor]:
    return [tb.mean, tb.log_std, tb.mean_ref]


def _draw(
    tb: GaussianTestbed, n: int, k: int, gen: torch.Generator, params: list | None = None
) -> dict:
    """n data points' K samples z [..., n, K, D] from pi, and the log-densities [..., n, K];
    ``params``: (mean, log_std, theta) to use instead of the testbed's, with leading dims."""
    mean, log_std, theta = params or _params(tb)
    lead = mean.shape[:-1]
    eps = torch.randn(*lead, n, k, tb.dim, generator=gen, dtype=torch.float64)
    mean, log_std, theta = (p[..., None, None, :] for p in (mean, log_std, theta))
    z = mean + torch.exp(log_std) * eps
    return {
        "logp": gaussian_log_density(z, mean, log_std),
        "logp_ref": gaussian_log_density(z, theta, tb.log_std_ref) + LOG_Z,
        "logp_stl": gaussian_log_density(z, mean.detach(), log_std.detach()),
        "samples": z,
    }


def _bound(d: dict, alpha: float, grad: str, **kw) -> torch.Tensor:
    return klest.renyi_bound(
        d["logp"],
        d["logp_ref"],
        alpha=alpha,
        grad=grad,
        **kw,
        **{k: d[k] for k in ("samples", "logp_stl")},
    )


def _elbo_grad(tb: GaussianTestbed) -> torch.Tensor:
    """The closed-form gradient of the ELBO = log Z - KL(pi||ref) w.r.t. (mean, log_std, theta)."""
    return -torch.cat([g.reshape(-1) for g in torch.autograd.grad(tb.exact_kl(), _params(tb))])


def _exact_k2(tb: GaussianTestbed, alpha: float, nodes: int = 80) -> tuple[float, torch.Tensor]:
    """E[L_{alpha,2}] in one dimension by a ``nodes``-squared Gauss-Hermite quadrature over the
    two samples' noises, and its gradient w.r.t. (mean, log_std, theta) by autodiff of it."""
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    x = torch.as_tensor(x)
    w = torch.as_tensor(w) / math.sqrt(2 * math.pi)
    eps = torch.stack(torch.meshgrid(x, x, indexing="ij"), -1)[..., None]  # [n, n, 2, 1]
    z = tb.mean + torch.exp(tb.log_std) * eps
    lw = gaussian_log_density(z, tb.mean_ref, tb.log_std_ref) + LOG_Z
    lw = lw - gaussian_log_density(z, tb.mean, tb.log_std)
    b = 1.0 - alpha
    bound = (torch.logsumexp(b * lw, -1) - math.log(2)) / b
    value = (w[:, None] * w[None, :] * bound).sum()
    grads = torch.autograd.grad(value, _params(tb))
    return float(value.detach()), torch.cat([g.reshape(-1) for g in grads])


def _gradient_draws(
    tb: GaussianTestbed, *, k: int, alpha: float, grads: tuple[str, ...], trials: int, seed: int
) -> dict[str, torch.Tensor]:
    """Per trial (a batch of 8 data points, K samples each), each estimator's gradient of the
    batch-mean bound w.r.t. (mean, log_std, theta): ``[trials, 3 D]``; the same draws for every
    estimator. Each trial has its own copy of the parameters, so one backward pass of the sum
    over trials gives every trial's gradient."""
    copies = [p.detach().expand(trials, tb.dim).clone().requires_grad_(True) for p in _params(tb)]
    d = _draw(tb, 8, k, make_generator(seed), copies)
    out = {}
    for g in grads:
        total = _bound(d, alpha, g, reduction="none").mean(-1).sum()
        out[g] = torch.cat(torch.autograd.grad(total, copies, retain_graph=True), -1)
    return out


# -- values, deterministic --------------------------------------------------------------------


def test_values_are_the_formulas_of_the_log_weights():
    """K = 1: every order's bound is the log-weight; alpha = 1: the mean log-weight; alpha = 0:
    log of the mean weight, against float64 log-sum-exp (one row spread so far that klest takes
    its log-sum-exp branch). Tolerance: a mean of K <= 5 terms, an exp, a log and a division in
    each computation, at the scale of the largest log-weight plus log K: 4 (K + 4) ulps."""
    lw = torch.tensor(
        [[0.3, -1.2, 2.0, 0.1, -0.4], [5.0, -3.0, 0.0, 1.0, 2.5], [0.0, 80.0, -80.0, 1.0, 2.0]],
        dtype=torch.float64,
    )
    logp = -torch.linspace(0.5, 3.0, lw.numel(), dtype=torch.float64).reshape(lw.shape)
    k = lw.shape[-1]
    scale = float(lw.abs().max()) + math.log(k)
    ulps = 4 * (k + 4)
    for alpha in (0.0, 0.5, 1.0, -2.0):
        one = klest.renyi_bound(logp[:, :1], logp[:, :1] + lw[:, :1], alpha=alpha, reduction="none")
        assert torch.equal(one, lw[:, 0]), alpha
    got = klest.renyi_bound(logp, logp + lw, alpha=1.0, reduction="none")
    assert_close_to_rounding(got, lw.mean(-1), ulps=ulps, scale=scale, what="alpha = 1")
    got = klest.iwae_bound(logp, logp + lw, reduction="none")
    want = torch.logsumexp(lw, -1) - math.log(k)
    assert_close_to_rounding(got, want, ulps=ulps, scale=scale, what="IWAE")
    got = klest.renyi_bound(logp, logp + lw, alpha=0.5, reduction="none")
    want = (torch.logsumexp(0.5 * lw, -1) - math.log(k)) / 0.5
    assert_close_to_rounding(got, want, ulps=2 * ulps, scale=scale, what="alpha = 0.5")


def test_the_order_one_limit_is_the_elbo_and_accurate_near_it():
    """As alpha -> 1 the bound tends to the mean log-weight m, with
    L_{1 - d} = m + d v / 2 + O(d^2) (v: the variance of the K log-weights; the remainder is at
    most d^2 max|l - m|^3). In float32 at d = 1e-4 the value must be within that remainder plus
    64 ulps of max|l| (log K / d = 1.6e4 ulps would be the error of subtracting log K)."""
    lw = torch.tensor([[0.3, -1.2, 2.0, 0.1, -0.4], [1.5, 1.0, 0.0, 1.0, -2.5]])
    logp = torch.full_like(lw, -1.0)
    d = 1e-4
    got = klest.renyi_bound(logp, logp + lw, alpha=1.0 - d, reduction="none").double()
    lw64 = lw.double()
    mean, var = lw64.mean(-1), lw64.var(-1, unbiased=False)
    spread = (lw64 - mean[:, None]).abs().max(-1).values
    want = mean + d * var / 2
    tol = d * d * spread**3 + 64 * torch.finfo(torch.float32).eps * lw64.abs().max()
    assert bool(((got - want).abs() <= tol).all()), (got - want, tol)


# -- values, statistical ----------------------------------------------------------------------

# (alpha, K, what the mean of the statistic is): E[e^{(1-alpha) L}] = E_pi[w^{1-alpha}] at any
# K, and E[L_{1,K}] = E[IWAE_1] = the ELBO.
VALUE_CASES = [(0.0, 1, "elbo"), (1.0, 3, "elbo"), (0.0, 4, "moment"), (0.5, 3, "moment"),
               (-1.0, 2, "moment")]  # fmt: skip
Z_VALUE = z_for(RATE, len(VALUE_CASES))  # two-sided, 5 comparisons: 4.42


def _moment(tb: GaussianTestbed, beta: float) -> float:
    """E_pi[(ref / pi)^beta] in closed form: Z^beta times the integral of N(m_r, s_r)^beta
    N(m, s)^(1 - beta), per dimension exp(-beta (1 - beta) (m - m_r)^2 / (2 v)) sqrt(s_r^(2 (1 -
    beta)) s^(2 beta) / v) with v = beta s^2 + (1 - beta) s_r^2."""
    with torch.no_grad():
        s2, r2 = torch.exp(2 * tb.log_std), torch.exp(2 * tb.log_std_ref)
        v = beta * s2 + (1 - beta) * r2
        log = -beta * (1 - beta) * (tb.mean - tb.mean_ref) ** 2 / (2 * v)
        log = log + 0.5 * ((1 - beta) * torch.log(r2) + beta * torch.log(s2) - torch.log(v))
    return math.exp(beta * LOG_Z + float(log.sum()))


def _value_zs(seed: int, n: int = 4000) -> dict[str, float]:
    tb = _testbed(dim=2)
    gen = make_generator(seed)
    elbo = LOG_Z - float(tb.exact_kl().detach())
    zs = {}
    for alpha, k, what in VALUE_CASES:
        with torch.no_grad():
            bounds = _bound(_draw(tb, n, k, gen), alpha, "pathwise", reduction="none")
        if what == "elbo":
            draws, exact = bounds, elbo
        else:
            draws, exact = torch.exp((1 - alpha) * bounds), _moment(tb, 1 - alpha)
        se = float(draws.std()) / math.sqrt(n)
        zs[f"alpha={alpha} K={k}"] = abs(float(draws.mean()) - exact) / se
    return zs


def test_bound_values_match_the_closed_forms():
    """On a 2-D Gaussian model, 4000 data points per case: the means of IWAE_1 and L_{1,3} are
    the ELBO, and those of e^{(1-alpha) L} (IWAE_4, L_{0.5,3}, L_{-1,2}) are E_pi[w^{1-alpha}]
    (e^{IWAE_K}: Z = 3). Five two-sided comparisons at family rate RATE: |z| <= 4.42."""
    zs = _value_zs(seed=11)
    assert max(zs.values()) <= Z_VALUE, zs


@pytest.mark.calibration
def test_bound_values_match_the_closed_forms_over_seeds():
    """The value test at 30 seeds: no failure expected (30 x 6.3e-5 = 1.9e-3)."""
    stats = [max(_value_zs(seed).values()) for seed in range(30)]
    assert_failures_consistent(stats, Z_VALUE, RATE, "bound values")


def test_bounds_increase_with_k_toward_the_log_evidence():
    """E[IWAE_K] rises with K toward log Z: the ELBO < E[IWAE_2] < E[IWAE_8] < E[IWAE_32] on
    the 1-D model, 16000 data points whose IWAE_2 and IWAE_8 use the first 2 and 8 of their 32
    samples (paired differences), with E[IWAE_8] below log Z and E[IWAE_32] not above it. Six
    comparisons, each at z_for(RATE, 6, one-sided) = 4.37 (the sampled E[IWAE_2] against the
    quadrature's: two-sided at that threshold); the gaps asserted are 8 to 40 standard errors
    (observed, in the commit message)."""
    tb = _testbed(dim=1)
    threshold = z_for(RATE, 6, two_sided=False)
    exact_k2, _ = _exact_k2(tb, 0.0)
    elbo = LOG_Z - float(tb.exact_kl().detach())
    with torch.no_grad():
        d = _draw(tb, 16000, 32, make_generator(5))
        b = [
            klest.iwae_bound(d["logp"][:, :k], d["logp_ref"][:, :k], reduction="none")
            for k in (2, 8, 32)
        ]

    def z(x: torch.Tensor, than: float = 0.0) -> float:
        return (float(x.mean()) - than) / (float(x.std()) / math.sqrt(len(x)))

    assert abs(z(b[0], exact_k2)) <= threshold, (float(b[0].mean()), exact_k2)
    assert z(b[0], elbo) > threshold and exact_k2 > elbo, (elbo, exact_k2)
    assert z(b[1] - b[0]) > threshold, z(b[1] - b[0])
    assert z(b[2] - b[1]) > threshold, z(b[2] - b[1])
    assert z(-b[1], -LOG_Z) > threshold, (float(b[1].mean()), LOG_Z)
    assert z(b[2], LOG_Z) <= threshold, (float(b[2].mean()), LOG_Z)


# -- gradients, statistical -------------------------------------------------------------------

Z_GRAD = z_for(RATE, 9, two_sided=False)  # the 9 null comparisons of the next test: 4.13


def _gradient_zs(seed: int, trials: int = 300) -> dict[str, float]:
    """mean_shift_z of each unbiased case against its exact gradient (mean, log_std, theta)."""
    zs = {}
    # K = 1 (any order) and alpha = 1 (any K): the ELBO's closed-form gradient, all three.
    for alpha, k in ((0.0, 1), (1.0, 3)):
        tb = _testbed(dim=2)
        exact = _elbo_grad(tb)
        draws = _gradient_draws(tb, k=k, alpha=alpha, grads=GRADS, trials=trials, seed=seed)
        zs.update({f"{g} alpha={alpha} K={k}": mean_shift_z(draws[g], exact) for g in GRADS})
    # K = 2: the quadrature's gradient, pathwise and DReG.
    for alpha in (0.0, 0.5):
        tb = _testbed(dim=1)
        _, exact = _exact_k2(tb, alpha)
        draws = _gradient_draws(tb, k=2, alpha=alpha, grads=("pathwise", "dreg"), trials=trials,
                                seed=seed)  # fmt: skip
        zs.update({f"{g} alpha={alpha} K=2": mean_shift_z(draws[g], exact) for g in draws})
    return zs


def test_gradient_means_are_the_exact_gradients():
    """The gradient w.r.t. (mean, log_std, theta), 300 batches of 8 data points each: every
    estimator for K = 1 (alpha = 0) and for alpha = 1 (K = 3) against the ELBO's closed-form
    gradient; pathwise and DReG for K = 2 (alpha = 0 and 0.5) against the quadrature's. Nine
    one-sided comparisons at family rate RATE: z <= 4.13."""
    zs = _gradient_zs(seed=3)
    assert max(zs.values()) <= Z_GRAD, zs


@pytest.mark.calibration
def test_gradient_means_are_the_exact_gradients_over_seeds():
    """The gradient test at 20 seeds: no failure expected (20 x 6.3e-5 = 1.3e-3)."""
    stats = [max(_gradient_zs(seed).values()) for seed in range(20)]
    assert_failures_consistent(stats, Z_GRAD, RATE, "gradient means")


def test_dreg_mean_equals_the_iwae_gradient_mean_and_stl_is_biased():
    """On a 2-D model with K = 8 (no quadrature there): the paired differences DReG - pathwise
    have mean zero (z <= z_for(RATE, 2, one-sided) = 4.0), and STL - pathwise do not, for
    IWAE (Tucker et al.'s bias of STL at K > 1): z > 4.0, observed far above it (recorded in
    the commit message)."""
    tb = _testbed(dim=2)
    draws = _gradient_draws(tb, k=8, alpha=0.0, grads=GRADS, trials=300, seed=4)
    threshold = z_for(RATE, 2, two_sided=False)
    zero = torch.zeros(draws["pathwise"].shape[1], dtype=torch.float64)
    z_dreg = mean_shift_z(draws["dreg"] - draws["pathwise"], zero)
    z_stl = mean_shift_z(draws["stl"] - draws["pathwise"], zero)
    assert z_dreg <= threshold, z_dreg
    assert z_stl > threshold, z_stl
    # DReG's point: less noise w.r.t. pi's parameters than the IWAE gradient's.
    var = {g: float(draws[g][:, :4].var(0).sum()) for g in ("pathwise", "dreg")}
    assert var["dreg"] < var["pathwise"], var


# -- gradients, exact -------------------------------------------------------------------------


@pytest.mark.parametrize(("alpha", "k"), [(0.0, 1), (0.0, 4), (0.5, 4), (1.0, 4), (-1.0, 3)])
def test_stl_and_dreg_are_exactly_zero_at_the_optimum(alpha, k):
    """With pi equal to the posterior every log-weight with pi's parameters stopped is log Z
    exactly, so STL's and DReG's gradients w.r.t. pi's parameters are exactly 0 on every draw;
    pathwise's carries the score term and is not."""
    tb = _testbed(dim=2, optimum=True)
    d = _draw(tb, 5, k, make_generator(0))
    pi = [tb.mean, tb.log_std]
    for grad in ("stl", "dreg"):
        grads = torch.autograd.grad(_bound(d, alpha, grad), pi, retain_graph=True)
        assert all(bool((g == 0).all()) for g in grads), (grad, grads)
    grads = torch.autograd.grad(_bound(d, alpha, "pathwise"), pi)
    assert any(bool((g != 0).any()) for g in grads), grads


def test_dreg_weights_pi_and_ref_apart():
    """The per-sample weights of one data point, read off the gradients: w.r.t. ref's theta (a
    direct input) all three estimators weight sample k by w_k; w.r.t. the samples' path DReG
    weights by alpha w_k + (1 - alpha) w_k^2. Checked through a model whose log-weight is
    l_k = theta * a_k + z_k (z_k = phi + eps_k), so the gradients are sums of the weights.
    Tolerance: K = 4 terms of size <= 1 in float64: 16 ulps."""
    theta = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    phi = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    a = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=torch.float64)
    eps = torch.tensor([[0.4, -1.1, 0.3, 0.9]], dtype=torch.float64)
    z = (phi + eps).unsqueeze(-1)  # [1, K, 1]
    logp = torch.full_like(eps, -1.0)  # no score term through pi's parameters
    logp_ref = theta * a + z[..., 0] - 1.0
    for alpha in (0.0, 0.5):
        w = torch.softmax((1 - alpha) * (logp_ref - logp).detach(), -1)
        got = torch.autograd.grad(
            klest.renyi_bound(logp, logp_ref, alpha=alpha, grad="dreg", samples=z, logp_stl=logp),
            [theta, phi],
            retain_graph=True,
        )
        assert_close_to_rounding(got[0], (w * a).sum(), ulps=16, scale=float(a.abs().max()))
        want_phi = (alpha * w + (1 - alpha) * w * w).sum()
        assert_close_to_rounding(got[1], want_phi, ulps=16, scale=1.0)


# -- shapes and errors ------------------------------------------------------------------------


def test_shapes_reductions_and_dtype():
    """``[..., K]`` in: one bound per leading index with "none", their mean / sum otherwise, the
    mean of none 0; float32 in, float32 out; under no_grad no surrogate is built."""
    gen = make_generator(1)
    lw = torch.randn(2, 3, 5, generator=gen)
    logp = torch.full_like(lw, -1.0)
    none = klest.iwae_bound(logp, logp + lw, reduction="none")
    assert none.shape == (2, 3) and none.dtype == torch.float32
    assert torch.equal(klest.iwae_bound(logp, logp + lw, reduction="sum"), none.sum())
    assert torch.equal(klest.iwae_bound(logp, logp + lw), none.sum() / 6)
    empty = torch.zeros(0, 4)
    assert float(klest.iwae_bound(empty, empty)) == 0.0
    tb = _testbed(dim=2)
    d = _draw(tb, 3, 4, gen)
    with torch.no_grad():
        assert not _bound(d, 0.0, "dreg").requires_grad


def test_bad_input_names_the_argument():
    tb = _testbed(dim=2)
    d = _draw(tb, 3, 4, make_generator(2))
    lp, lr = d["logp"], d["logp_ref"]
    with pytest.raises(ValueError, match=r"logp has shape \(3, 4\) but logp_ref has shape"):
        klest.iwae_bound(lp, lr[:, :2])
    with pytest.raises(ValueError, match=r"expected \[..., K\] with K >= 1"):
        klest.iwae_bound(lp[:, :0], lr[:, :0])
    with pytest.raises(ValueError, match="unknown grad 'iwae'"):
        klest.iwae_bound(lp, lr, grad="iwae")
    with pytest.raises(ValueError, match="unknown reduction"):
        klest.iwae_bound(lp, lr, reduction="token-mean")
    with pytest.raises(TypeError, match="alpha must be a real number"):
        klest.renyi_bound(lp, lr, alpha=torch.tensor(0.5))
    with pytest.raises(ValueError, match="alpha must be finite"):
        klest.renyi_bound(lp, lr, alpha=math.inf)
    with pytest.raises(TypeError, match=r"logp_ref must be a torch\.Tensor"):
        klest.iwae_bound(lp, [1.0])
    with pytest.raises(ValueError, match="grad='dreg' needs logp_stl"):
        klest.iwae_bound(lp, lr, grad="dreg", samples=d["samples"])
    with pytest.raises(ValueError, match="needs samples"):
        klest.iwae_bound(lp, lr, grad="dreg", logp_stl=d["logp_stl"])
    with pytest.raises(ValueError, match=r"samples has shape \(3, 2, 2\) but logp has shape"):
        klest.iwae_bound(lp, lr, grad="dreg", logp_stl=d["logp_stl"], samples=d["samples"][:, :2])
    with pytest.raises(ValueError, match="samples is not an input"):
        klest.iwae_bound(lp, lr, grad="dreg", logp_stl=d["logp_stl"], samples=d["samples"] + 0)
    bad = lp.detach().clone()
    bad[1, 2] = math.nan
    with pytest.raises(
        ValueError, match=r"logp contains NaN at 1 position\(s\) \(first at index \(1, 2\)\)"
    ):
        klest.iwae_bound(bad, lr)
    bad[1, 2] = -math.inf
    with pytest.raises(ValueError, match="logp is -inf"):
        klest.iwae_bound(bad, lr)
    # ref may give a sample density 0: its weight is 0, and the bound stays finite
    ok = lr.detach().clone()
    ok[0, 0] = -math.inf
    assert bool(torch.isfinite(klest.iwae_bound(lp, ok, reduction="none")).all())
    for grad in GRADS:
        bound = klest.iwae_bound(lp, ok, grad=grad, samples=d["samples"], logp_stl=d["logp_stl"])
        (g,) = torch.autograd.grad(bound, tb.log_std, retain_graph=True)
        assert bool(torch.isfinite(g).all()), (grad, g)
