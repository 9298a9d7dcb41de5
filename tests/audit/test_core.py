"""The audit: it must flag a biased estimator and clear an unbiased one, with honest errors.

Statistical thresholds follow ``tests/_stats.py``: each test's false-fail rate is ``RATE``
(6.3e-5), Bonferroni over its comparisons; the ``calibration`` companions rerun them over many
seeds.
"""

from __future__ import annotations

import contextlib
import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

import klest
from klest.audit import EstimatorSpec, GradSpec, audit_value, format_value_audits
from klest.testbeds import GaussianTestbed, make_generator
from tests._stats import RATE, assert_failures_consistent, z_for


def _schulman_mu_1_checks(seed: int) -> dict[str, float]:
    """|statistic| / threshold of the two null checks of the next test (a check fails above 1),
    and the detection of k2's bias as threshold / z (fails above 1)."""
    tb = GaussianTestbed.schulman(1.0)
    z = z_for(RATE, 2)
    audits = {
        e: audit_value(e, tb, batch_size=100_000, n_trials=1, seed=seed, z_threshold=z)
        for e in ("k1", "k2", "k3")
    }
    assert audits["k3"].significant == (abs(audits["k3"].z) > z)
    return {
        "k3 bias": abs(audits["k3"].z) / z,
        "k1 std": abs(audits["k1"].std - 1.0) / audits["k1"].se_std / z,
        "k2 bias detected": z / abs(audits["k2"].z),
    }


def test_flags_k2_bias_and_clears_k3_on_schulman_mu_1():
    """Two null comparisons (k3's bias, k1's stdev against its exact value), two-sided,
    Bonferroni at ``RATE`` (6.3e-5) for both: ``z_for(RATE, 2)`` = 4.15, passed to the audit as
    its threshold (the audit's default, 3, is a 2.7e-3 rate per comparison). Power: k2's bias
    is mu^2/8 = 0.125 with stdev sqrt(3) mu^2/2 = 0.87, so 1e5 draws put it 46 standard errors
    out."""
    tb = GaussianTestbed.schulman(1.0)
    z = z_for(RATE, 2)
    k2 = audit_value("k2", tb, batch_size=100_000, n_trials=1, seed=0, z_threshold=z)
    k3 = audit_value("k3", tb, batch_size=100_000, n_trials=1, seed=0, z_threshold=z)
    assert k2.significant and k2.expected == pytest.approx(0.625, rel=1e-10)
    assert not k3.significant and k3.expected == pytest.approx(0.5, rel=1e-10)
    # k1's per-sample stdev is exactly mu = 1 here (delta ~ N(1/2, 1)).
    k1 = audit_value("k1", tb, batch_size=100_000, n_trials=1, seed=0)
    assert abs(k1.std - 1.0) <= z * k1.se_std


@pytest.mark.calibration
def test_schulman_mu_1_checks_hold_over_seeds():
    """The checks above at 50 seeds: no failure expected (50 x 6.3e-5 = 3e-3)."""
    stats: dict[str, list[float]] = {}
    for seed in range(1, 51):
        for key, value in _schulman_mu_1_checks(seed).items():
            stats.setdefault(key, []).append(value)
    for key, values in stats.items():
        assert_failures_consistent(values, 1.0, RATE, key)


def test_trial_loop_and_vectorized_paths_agree():
    """The vectorized path (trials as fitting groups) draws the same distribution as a loop."""
    tb = GaussianTestbed.schulman(0.5)
    spec = EstimatorSpec.parse("cv:loo")
    vectorized = audit_value("cv:loo", tb, batch_size=8, n_trials=4000, seed=3)
    looped = audit_value(spec.build("pi||ref"), tb, batch_size=8, n_trials=4000, seed=4)
    # Two two-sided comparisons of independent runs: Bonferroni at RATE.
    z = z_for(RATE, 2)
    se = math.hypot(vectorized.se_bias, looped.se_bias)
    assert abs(vectorized.mean - looped.mean) <= z * se
    assert abs(vectorized.std - looped.std) <= z * math.hypot(vectorized.se_std, looped.se_std)
    assert vectorized.n_draws == looped.n_draws == 4000


def test_function_estimator_and_std_standard_error():
    tb = GaussianTestbed.schulman(0.3)

    def half_k1(sample):
        return 0.5 * (sample.logp - sample.logp_ref)

    z = z_for(RATE, 1)
    a = audit_value(half_k1, tb, batch_size=20_000, n_trials=5, seed=1, name="half", z_threshold=z)
    assert a.estimator == "half" and a.n_draws == 100_000
    # Biased by exactly -KL/2 = -0.0225 with stdev mu / 2 = 0.15: 47 standard errors.
    assert a.significant and a.expected is None
    # The draws are exactly normal (delta = mu^2/2 - mu x), for which se(std) = std / sqrt(2 n).
    # The audit's se(std) is sqrt((k - 1) / 2) times that, k the sample kurtosis, whose sd is
    # sqrt(24 / n) for normal draws: so the ratio's sd is sqrt(24 / n) / 4 (delta method).
    ratio = a.se_std / (a.std / math.sqrt(2 * a.n_draws))
    assert abs(ratio - 1) <= z * math.sqrt(24 / a.n_draws) / 4, ratio


def test_format_table_lists_every_audit():
    tb = GaussianTestbed.schulman(0.3)
    audits = [audit_value(s, tb, batch_size=100, n_trials=10) for s in ("k1", "k3")]
    table = format_value_audits(audits)
    assert table.count("\n") == 2 + len(audits)
    assert "| k3 | gaussian | KL(pi||ref) |" in table


def test_spec_labels():
    assert EstimatorSpec.parse("cv:0.5").alpha == 0.5
    assert EstimatorSpec.parse("cv:loo", level="sequence").label() == "cv:loo@sequence"
    assert EstimatorSpec.parse("cv:ema").fitted
    assert not EstimatorSpec.parse("k1").fitted
    assert torch.is_tensor(GaussianTestbed.schulman(0.1).exact_kl())


# mean_shift_z's null takes the covariance's spectrum from the same draws, which makes it a
# little conservative: here (30 coordinates, 200 draws) the deviate's mean is 0.02 and its sd
# 0.97 under the null. The calibration checks allow for that, on top of their statistical
# tolerance.
NULL_MEAN_ALLOWANCE, NULL_SD_ALLOWANCE = 0.03, 0.05


def _mean_shift_z_checks(seed: int) -> dict[str, float]:
    """|statistic| / threshold of the calibration checks (a check fails above 1) and the
    detection of the shift as threshold / z (fails above 1)."""
    from klest.audit import mean_shift_z

    g = torch.Generator().manual_seed(seed)
    dim, n, reps = 30, 200, 300
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64) / dim**0.5
    zero = torch.zeros(dim, dtype=torch.float64)
    zs = torch.tensor(
        [
            mean_shift_z(torch.randn(n, dim, generator=g, dtype=torch.float64) @ mix, zero)
            for _ in range(reps)
        ]
    )
    shifted = torch.randn(n, dim, generator=g, dtype=torch.float64) @ mix + 0.2
    # Three null checks, each at RATE / 3: two two-sided, and the max of 300 one-sided.
    z = z_for(RATE / 3, 1)
    mean, sd = float(zs.mean()), float(zs.std())
    return {
        "mean": max(abs(mean) - NULL_MEAN_ALLOWANCE, 0) / (sd / reps**0.5) / z,
        # se of a normal sample's sd: sd / sqrt(2 (reps - 1)).
        "sd": max(abs(sd - 1) - NULL_SD_ALLOWANCE, 0) / (1 / (2 * (reps - 1)) ** 0.5) / z,
        "max": float(zs.max()) / z_for(RATE / 3, reps, two_sided=False),
        "shift detected": z_for(RATE, 1, two_sided=False) / mean_shift_z(shifted, zero),
    }


def test_mean_shift_z_is_calibrated_under_the_null_and_detects_a_shift():
    """300 null replicates (30-dimensional correlated normal draws, n = 200 each): their mean
    is 0 and their sd 1 within their standard errors (plus the approximation's own error,
    ``NULL_*_ALLOWANCE``), and their max below the one-sided Bonferroni threshold of 300
    comparisons (5.27); each of the three at ``RATE / 3``, so the test's false-fail rate is
    ``RATE`` (6.3e-5). Power: a shift of 0.2 per coordinate gives z well above the one-sided
    threshold 3.83."""
    stats = _mean_shift_z_checks(0)
    assert all(v <= 1 for v in stats.values()), stats


@pytest.mark.calibration
def test_mean_shift_z_checks_hold_over_seeds():
    """The checks above at 40 seeds: no failure expected (40 x 6.3e-5 = 2.5e-3)."""
    stats: dict[str, list[float]] = {}
    for seed in range(1, 41):
        for key, value in _mean_shift_z_checks(seed).items():
            stats.setdefault(key, []).append(value)
    for key, values in stats.items():
        assert_failures_consistent(values, 1.0, RATE, key)


def _penalty_gradient_draws(tb, grad: str, *, n_trials: int, seed: int) -> torch.Tensor:
    """``[n_trials, n_params]`` float64: batch after batch of 8 from one generator seeded with
    ``seed``, each batch's gradient of kl_penalty(k3, ``grad``)."""
    g = make_generator(seed)
    rows = []
    for _ in range(n_trials):
        s = tb.sample(8, generator=g)
        loss = klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, grad=grad)
        (grad_,) = torch.autograd.grad(loss, tb.parameters())
        rows.append(grad_.reshape(-1).double())
    return torch.stack(rows)


def _imhof_deviate(lam: np.ndarray, n: int, ratio: float) -> float:
    """Phi^-1(1 - p), p = P(sum_j lam_j (chi^2_1 - ratio chi^2_{n-1} / (n - 1)) > 0) by Imhof's
    formula 1/2 + (1/pi) int_0^inf sin(theta(t)) / (t rho(t)) dt, integrated by scipy."""
    from scipy import integrate, stats

    w = np.r_[lam, -ratio * lam / (n - 1)]
    nu = np.r_[np.ones(lam.size), np.full(lam.size, n - 1.0)]

    def integrand(t: float) -> float:
        theta = 0.5 * float((nu * np.arctan(w * t)).sum())
        log_rho = 0.25 * float((nu * np.log1p((w * t) ** 2)).sum())
        return math.sin(theta) * math.exp(-log_rho) / t

    value, _ = integrate.quad(integrand, 0, np.inf, epsabs=1e-13, epsrel=1e-12, limit=500)
    return float(stats.norm.isf(0.5 + value / math.pi))


def test_grad_audit_reports_the_mean_gradient_and_the_bias_vector():
    from klest.audit import audit_grad
    from klest.testbeds import TabularAutoregressive

    tb = TabularAutoregressive.random(3, 3, eos=2, seed=4, scale=0.8)
    exact = torch.cat([g.reshape(-1) for g in tb.exact_kl_grad("pi||ref")]).double()
    a = audit_grad("k3/cumulative", tb, batch_size=8, n_trials=400, seed=7)
    assert a.mean_grad.shape == a.bias.shape == a.se.shape == exact.shape
    assert not (a.mean_grad.requires_grad or a.bias.requires_grad)
    # The same draws recomputed here without the audit's code.
    draws = _penalty_gradient_draws(tb, "cumulative", n_trials=400, seed=7)
    mean = draws.mean(0)
    torch.testing.assert_close(a.mean_grad, mean, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(a.bias, mean - exact, rtol=0, atol=1e-15)
    torch.testing.assert_close(a.se, draws.std(0) / 20, rtol=1e-12, atol=1e-15)
    assert a.bias_norm == pytest.approx(float((mean - exact).norm()), rel=1e-12)
    cov = torch.cov(draws.T)
    assert a.variance == pytest.approx(float(cov.trace()), rel=1e-10)
    # z of "the mean is the exact gradient" from the full covariance's spectrum (the audit uses
    # a Gram matrix) and Imhof's integral (scipy's quad; the audit inverts through the
    # saddlepoint): R = n |d|^2 / tr S exceeds r when sum_j lam_j (chi^2_1 - r chi^2_{n-1} /
    # (n - 1)) > 0. p is about 0.66 here, so quad's 1e-11 absolute error is 1e-10 in z.
    lam = torch.linalg.eigvalsh(cov).numpy()
    lam = lam[lam > 1e-13 * lam.max()]
    r = 400 * float(((mean - exact) ** 2).sum()) / lam.sum()
    assert a.z_target == pytest.approx(_imhof_deviate(lam, 400, r), rel=1e-8, abs=1e-8)
    # Unbiased (cumulative): every coordinate within the Bonferroni-corrected standard errors
    # (family rate RATE over the coordinates that vary, two-sided).
    # Coordinates of prefixes after eos are never reached: exactly 0 in draws and exact gradient.
    varies = a.se > 0
    z = z_for(RATE, int(varies.sum()))
    assert bool((a.bias[varies].abs() <= z * a.se[varies]).all()), (a.bias / a.se).abs().max()
    assert bool((a.bias[~varies] == 0).all())
    # The token-level gradient is biased on sequences: some coordinate is far outside.
    b = audit_grad("k3/token", tb, batch_size=8, n_trials=400, seed=7)
    assert bool((b.bias.abs() > z * b.se).any())
    assert set(a.as_dict()) >= {"mean_grad", "bias", "se"}
    assert "mean_grad" not in repr(a)


def test_grad_audit_summaries_match_a_regression_written_here():
    """``rel_bias``, ``rel_bias_debiased``, the cosines and the regression coefficients with
    their standard errors, recomputed in float64 from the same draws (recomputed here) with
    the normal equations solved here: each draw regressed on the two exact gradients, the
    coefficients averaged over draws, their se the sd over draws / sqrt(n)."""
    from klest.audit import audit_grad
    from klest.testbeds import TabularAutoregressive

    tb = TabularAutoregressive.random(3, 3, eos=2, seed=4, scale=0.8)
    a = audit_grad("k3/score", tb, batch_size=8, n_trials=200, seed=5)
    draws = _penalty_gradient_draws(tb, "score", n_trials=200, seed=5)
    e1 = torch.cat([g.reshape(-1) for g in tb.exact_kl_grad("pi||ref")]).double()
    e2 = torch.cat([g.reshape(-1) for g in tb.exact_kl_grad("ref||pi")]).double()
    mean = draws.mean(0)
    bias2 = float(((mean - e1) ** 2).sum())
    trace_cov = float(torch.cov(draws.T).trace())
    assert a.rel_bias == pytest.approx(math.sqrt(bias2) / float(e1.norm()), rel=1e-9)
    debiased = math.sqrt(max(bias2 - trace_cov / 200, 0.0)) / float(e1.norm())
    assert a.rel_bias_debiased == pytest.approx(debiased, rel=1e-9, abs=1e-15)
    assert a.cos_ref_pi == pytest.approx(float(mean @ e2 / (mean.norm() * e2.norm())), rel=1e-9)
    gram = torch.tensor([[e1 @ e1, e1 @ e2], [e2 @ e1, e2 @ e2]], dtype=torch.float64)
    per_draw = torch.linalg.solve(gram, torch.stack([draws @ e1, draws @ e2]))  # [2, n]
    coefs, ses = per_draw.mean(1), per_draw.std(1) / math.sqrt(200)
    got = [a.coef_pi_ref, a.coef_ref_pi, a.coef_pi_ref_se, a.coef_ref_pi_se]
    got = torch.tensor(got, dtype=torch.float64)  # float64 numbers, kept float64
    torch.testing.assert_close(got, torch.cat([coefs, ses]), rtol=1e-7, atol=1e-12)


def test_grad_audit_calls_a_zero_mean_gradient_zero():
    """k1's autodiff gradient is the score, whose expectation is exactly 0 (sum of grad pi):
    600 batches of 8 are far from both exact gradients (z about 17 to 20, against 4) and within
    the audit's threshold 4 of 0 (z(zero) is about N(0, 1) under the
    null: one-sided false-fail rate 3.2e-5 < RATE)."""
    from klest.audit import audit_grad
    from klest.testbeds import TabularAutoregressive

    tb = TabularAutoregressive.random(3, 3, eos=2, seed=4, scale=0.8)
    a = audit_grad("k1/autodiff", tb, batch_size=8, n_trials=600, seed=1)
    assert a.verdict == "mean gradient zero", a


def test_mean_shift_z_of_constant_draws_at_the_target_is_zero():
    """Draws that never vary and equal the target: z is 0 exactly, even when everything is 0
    (a gradient that vanishes at pi = ref); a constant draw away from the target gives inf."""
    from klest.audit import mean_shift_z

    assert mean_shift_z(torch.zeros(10, 3, dtype=torch.float64), torch.zeros(3)) == 0.0
    assert mean_shift_z(torch.ones(10, 3, dtype=torch.float64), torch.ones(3)) == 0.0
    assert mean_shift_z(torch.ones(10, 3, dtype=torch.float64), torch.zeros(3)) == math.inf


def test_value_audit_rounding_floor_is_relative_to_the_kl():
    """A deterministic estimator (no spread: se = 0) off by a rounding-level relative 5e-13 of
    a KL of 8 (mu = 4: KL = mu^2 / 2) is not significant; off by 1e-9 relative it is. The floor
    on se is 1e-12 times the KL's magnitude."""
    tb = GaussianTestbed.schulman(4.0)
    exact = float(tb.exact_kl("pi||ref").detach())
    assert exact == pytest.approx(8.0)

    def constant(rel):
        return lambda s: torch.full((s.logp.shape[0],), exact * (1 + rel), dtype=torch.float64)

    near = audit_value(constant(5e-13), tb, batch_size=4, n_trials=3, z_threshold=3.0)
    assert abs(near.z) < 1.0 and not near.significant, near
    far = audit_value(constant(1e-9), tb, batch_size=4, n_trials=3, z_threshold=3.0)
    assert far.significant, far


# -- the mean-shift statistic's null on the pitfalls policies ---------------------------------


SPECS = ("k1/autodiff", "k3/score", "k3/cumulative", "rb/rb", "k3/cumulative+exact-kl")
"""The pitfalls estimators whose batch loss is a mean over independent sequences (the mean
gradient's covariance is then exact by enumeration): their null is the exact gradient (0 for
k1's autodiff)."""
COVARIANCES, MEANS = 25, 4000


def _per_sequence_covariance(testbed, spec: str) -> tuple[np.ndarray, torch.Tensor]:
    """The covariance of one sequence's gradient of ``spec``'s loss under pi, by enumerating
    every sequence (for estimators whose batch loss is a mean over independent sequences, a
    batch of b has b times less of it), and that gradient's exact mean."""
    from klest.audit import GradSpec

    tokens, _ = testbed.all_sequences()
    loss_fn = GradSpec.parse(spec).build("pi||ref")
    grads, log_probs = [], []
    for i in range(tokens.shape[0]):
        sample = testbed.evaluate(tokens[i : i + 1])
        (g,) = torch.autograd.grad(loss_fn(sample), testbed.parameters())
        grads.append(g.reshape(-1).double())
        log_probs.append(sample.logp.detach().sum())
    grads, prob = torch.stack(grads), torch.stack(log_probs).double().exp()
    mean = prob @ grads
    centred = grads - mean
    return (centred.T @ (centred * prob[:, None])).numpy(), mean


def _threshold_ratio(eig: np.ndarray, n: int, z: float) -> float:
    """The ratio at which :func:`klest.audit.mean_shift_z`'s deviate crosses ``z`` (it increases
    with the ratio), by regula falsi (Illinois) on ``deviate - z``."""
    from klest.audit.core import _mean_shift_deviate

    def f(r: float) -> float:
        return _mean_shift_deviate(eig, n, r) - z

    a, fa, b = 1.0, f(1.0), 2.0
    fb = f(b)
    while fb < 0:
        a, fa, b = b, fb, 2 * b
        fb = f(b)
    side = 0
    for _ in range(100):
        c = (a * fb - b * fa) / (fb - fa)
        fc = f(c)
        if abs(fc) < 1e-7 or b - a < 1e-10 * b:
            return c
        if fc < 0:
            a, fa = c, fc
            fb, side = (fb / 2 if side == 1 else fb), 1
        else:
            b, fb = c, fc
            fa, side = (fa / 2 if side == -1 else fa), -1
    return c


def _simulated_false_alarms(lam, n, alphas, tiny, *, covariances, means, rng):
    """Gaussian draws with covariance diag(``lam``) (the statistic is rotation invariant):
    ``covariances`` sample covariances of ``n`` draws, each with ``means`` independent sample
    means (independent of the covariance for Gaussian draws, so each pair is one null). Counts
    of deviates above the normal quantiles of ``alphas``; for ``tiny``, the conditional
    probability given the covariance by importance sampling (the draws' chi-squares tilted to
    put the threshold at their mean), averaged."""
    lam = lam[lam > 1e-12 * lam.max()]
    counts = np.zeros(len(alphas))
    tiny_sum = 0.0
    for _ in range(covariances):
        x = rng.standard_normal((n, lam.size)) * np.sqrt(lam)
        x -= x.mean(0)
        small = x @ x.T if n <= lam.size else x.T @ x
        eig = np.linalg.eigvalsh(small) / (n - 1)
        eig = eig[eig > 1e-13 * eig.max()]
        trace = eig.sum()
        # n |mean|^2 of Gaussian means: sum_j lam_j chi^2_1.
        y = (rng.standard_normal((means, lam.size)) ** 2) @ lam
        for k, alpha in enumerate(alphas):
            r = _threshold_ratio(eig, n, -NormalDist().inv_cdf(alpha))
            counts[k] += (y > r * trace).sum()
        x_tiny = _threshold_ratio(eig, n, -NormalDist().inv_cdf(tiny)) * trace
        lo, hi = 0.0, 0.5 / lam.max()
        for _ in range(200):  # the tilt theta whose chi-squares have mean x_tiny in total
            theta = 0.5 * (lo + hi)
            lo, hi = (theta, hi) if (lam / (1 - 2 * theta * lam)).sum() < x_tiny else (lo, theta)
        shrink = 1 - 2 * theta * lam
        y_tilted = (rng.standard_normal((means, lam.size)) ** 2 / shrink) @ lam
        weight = np.exp(-theta * y_tilted - 0.5 * np.log(shrink).sum())
        tiny_sum += float(np.where(y_tilted > x_tiny, weight, 0.0).mean())
    return counts, tiny_sum / covariances


@pytest.mark.calibration
def test_mean_shift_z_false_alarm_rate_on_the_pitfalls_policies():
    """Under the null, P(z > Phi^-1(1 - alpha)) is within 2x of alpha at alpha = 1e-3 and 1e-4
    (2e6 simulated nulls per size) and at the per-test rate of the pitfalls tables (by importance
    sampling); margin: measured ratios 0.9 to 1.1 at 1e-3 and 1e-4 (the counts' sd about 7% of
    nominal), 1.3 to 1.7 at the tables' rate."""
    from klest.experiments.pitfalls import REGIMES, _testbed
    from klest.experiments.runner import table_threshold

    rng = np.random.default_rng(0)
    alphas = (1e-3, 1e-4)
    spectra = []
    for scale in REGIMES.values():
        for policy in (0, 1):
            testbed = _testbed(scale, 100 * policy)
            exact = torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad("pi||ref")])
            for spec in SPECS:
                cov, mean = _per_sequence_covariance(testbed, spec)
                null = torch.zeros_like(exact) if spec == "k1/autodiff" else exact
                torch.testing.assert_close(mean, null.double(), rtol=0, atol=1e-12)
                spectra.append(np.linalg.eigvalsh(cov).clip(min=0))
    report = {}
    for n, comparisons in ((100, 144), (500, 864)):  # pitfalls' --quick and full tables
        tiny = NormalDist().cdf(-table_threshold(comparisons, two_sided=False))
        total, nulls, tiny_rates = np.zeros(2), 0, []
        for lam in spectra:
            counts, tiny_rate = _simulated_false_alarms(
                lam, n, alphas, tiny, covariances=COVARIANCES, means=MEANS, rng=rng
            )
            total += counts
            nulls += COVARIANCES * MEANS
            tiny_rates.append(tiny_rate)
        ratios = [*(total / nulls / np.array(alphas)), float(np.mean(tiny_rates)) / tiny]
        report[n] = ratios
    for ratios in report.values():
        assert all(0.5 <= r <= 2 for r in ratios), report


def test_deterministic_rows_print_as_exact():
    """Draws without spread beyond rounding (a relative 1e-13 of noise) are deterministic: the
    value audit's std and se are 0 and its z 0 when the mean is the exact KL, -inf when it is
    off by 1e-6; the gradient audit's variance is 0 and its statistics 0 / inf. The tables
    print ``exact`` there, not a z of 1e11."""
    from klest.audit import audit_grad, format_grad_audits
    from klest.testbeds import CategoricalTestbed

    tb = CategoricalTestbed.random(5, seed=2)
    exact = float(tb.exact_kl("pi||ref").detach())

    def value(rel):
        def fn(s):
            noise = 1e-13 * torch.randn(s.logp.shape[0], dtype=torch.float64)
            return exact * (1 + rel + noise)

        return fn

    right = audit_value(value(0.0), tb, batch_size=4, n_trials=50, name="right")
    off = audit_value(value(-1e-6), tb, batch_size=4, n_trials=50, name="off")
    assert (right.std, right.se_bias, right.z, right.significant) == (0.0, 0.0, 0.0, False)
    assert (off.std, off.z, off.significant) == (0.0, -math.inf, True)
    table = format_value_audits([right, off])
    assert "| exact |" in table and "| -inf (deterministic) |" in table, table

    def loss(s):  # the exact KL's gradient, plus 1e-13 of a sample-dependent one
        return tb.exact_kl("pi||ref") + 1e-13 * s.logp.mean()

    a = audit_grad(loss, tb, batch_size=4, n_trials=30, name="exact loss")
    assert a.variance == 0.0 and bool((a.se == 0).all())
    assert (a.z_target, a.z_other) == (0.0, math.inf) and a.verdict == "descends KL(pi||ref)"
    row = format_grad_audits([a]).splitlines()[-1]
    assert "| 0 |" in row and "| exact | inf (deterministic) |" in row, row


def test_grad_spec_options_reach_kl_penalty():
    """``;discount=G`` and ``;power=A`` parse, label back, and build the kl_penalty call with
    them (the same loss as the direct call); anything else is refused by name."""
    from klest.testbeds import TabularAutoregressive, make_generator

    testbed = TabularAutoregressive.random(3, 3, eos=2, seed=0)
    sample = testbed.sample(6, generator=make_generator(0))
    for spec, options in (
        ("k1/cumulative;discount=0.5", {"discount": 0.5}),
        ("k1/token;power=0.5", {"power": 0.5}),
    ):
        parsed = GradSpec.parse(spec)
        assert parsed.label() == spec
        got = parsed.build("pi||ref")(sample)
        grad = spec.split("/")[1].split(";")[0]
        with pytest.warns(klest.KLGradientWarning) if grad == "token" else contextlib.nullcontext():
            want = klest.kl_penalty(
                sample.logp, sample.logp_ref, mask=sample.mask, estimator="k1", grad=grad, **options
            )
        g_got = torch.autograd.grad(got, testbed.parameters(), retain_graph=True)
        g_want = torch.autograd.grad(want, testbed.parameters(), retain_graph=True)
        assert torch.equal(got, want) and all(map(torch.equal, g_got, g_want))
    with pytest.raises(ValueError, match="'discount=G', 'power=A' or 'weights=RULE'"):
        GradSpec.parse("k1/cumulative;gamma=0.5")
    with pytest.raises(ValueError, match="unknown weights 'nope'"):
        GradSpec.parse("k1/cumulative;weights=nope")
    with pytest.raises(ValueError, match="baseline 'value' is the exact expected future"):
        GradSpec.parse("k3/cumulative+value").build("ref||pi", testbed)


def _enumerated_mean_gradient(testbed, grad: str, **options) -> torch.Tensor:
    """sum_y p(y) * the gradient of kl_penalty's surrogate on y: the exact mean gradient."""
    tokens, valid = testbed.all_sequences()
    s = testbed.evaluate(tokens)
    prob = torch.where(valid, s.logp, 0.0).sum(-1).exp().detach()
    rows = klest.kl_penalty(
        s.logp,
        s.logp_ref,
        mask=valid,
        grad=grad,
        estimator="rb" if grad == "rb" else "k1",
        logits=s.logits if grad == "rb" else None,
        logits_ref=s.logits_ref if grad == "rb" else None,
        reduction="per-sequence",
        **options,
    )
    return torch.autograd.grad((prob * rows).sum(), testbed.logits)[0].reshape(-1)


def test_weighted_and_value_baseline_rows_have_the_mean_gradients_their_verdicts_state():
    """The suite's rows with ``;weights=RULE`` and ``+value``, exactly (every sequence of its
    tabular testbed enumerated, no sampling): the rules are min(ref_t/pi_t, 2) and
    min(prod_{u<t} ref_u/pi_u, 2) written out; GradSpec.objective is the policy gradient of the
    fixed penalties sum_t w_t rho_t written out here; cumulative's mean gradient is it for both
    rules, rb's for the prefix rule only (off by more than 1e-2 of its scale for the own-token
    rule); with the future-KL baseline tensor, cumulative's mean gradient is the KL's. Each
    built loss is the direct kl_penalty call's. Tolerance: sums of about 20 sequences of 4
    positions, a few rounded factors each: 200 ulps of the largest entry."""
    from klest.audit import WEIGHT_RULES
    from klest.testbeds import TabularAutoregressive
    from tests._tolerance import assert_close_to_rounding

    testbed = TabularAutoregressive.random(3, 4, eos=2, seed=0, scale=0.7)
    tokens, valid = testbed.all_sequences()
    s = testbed.evaluate(tokens)
    lp, lr = torch.where(valid, s.logp, 0.0), torch.where(valid, s.logp_ref, 0.0)
    ratio = (lr - lp).detach().exp()
    prefix = torch.cat([torch.ones_like(ratio[:, :1]), ratio.cumprod(1)[:, :-1]], 1)
    rules = {"clipped-ratio": ratio.clamp(max=2), "clipped-prefix-ratio": prefix.clamp(max=2)}
    kl_grad = torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad("pi||ref")]).double()
    batch = testbed.sample(6, generator=make_generator(0))
    for rule, w in rules.items():
        w = torch.where(valid, w, 0.0)
        got_w = WEIGHT_RULES[rule](s.logp.detach(), s.logp_ref, valid)
        assert_close_to_rounding(got_w, w, ulps=16, what=rule)
        policy = (lp.sum(-1).exp() * (w * (lp - lr).detach()).sum(-1)).sum()
        want = torch.autograd.grad(policy, testbed.logits, retain_graph=True)[0].reshape(-1)
        label, objective = GradSpec.parse(f"k1/cumulative;weights={rule}").objective(testbed)
        assert label == "E[Σ w·ρ] (w·ρ fixed)"
        assert_close_to_rounding(objective, want, ulps=200, what=f"objective {rule}")
        cumulative = _enumerated_mean_gradient(testbed, "cumulative", weights=w)
        assert_close_to_rounding(cumulative, want, ulps=200, what=f"cumulative {rule}")
        rb = _enumerated_mean_gradient(testbed, "rb", weights=w)
        if rule == "clipped-prefix-ratio":
            assert_close_to_rounding(rb, want, ulps=200, what=f"rb {rule}")
        else:
            assert (rb - want).abs().max() > 1e-2 * want.abs().max()
        assert (want - kl_grad).abs().max() > 1e-2 * kl_grad.abs().max()  # not the KL's
        for grad in ("cumulative", "rb"):
            spec = GradSpec.parse(f"{'k1' if grad == 'cumulative' else 'rb'}/{grad};weights={rule}")
            got = spec.build("pi||ref", testbed)(batch)
            direct = klest.kl_penalty(
                batch.logp,
                batch.logp_ref,
                mask=batch.mask,
                estimator=spec.value,
                grad=grad,
                logits=batch.logits if grad == "rb" else None,
                logits_ref=batch.logits_ref if grad == "rb" else None,
                weights=WEIGHT_RULES[rule](batch.logp.detach(), batch.logp_ref, batch.mask),
            )
            g_got = torch.autograd.grad(got, testbed.logits, retain_graph=True)[0]
            g_want = torch.autograd.grad(direct, testbed.logits, retain_graph=True)[0]
            assert torch.equal(got, direct) and torch.equal(g_got, g_want), spec
    baseline = testbed.future_kl(tokens)
    valued = _enumerated_mean_gradient(testbed, "cumulative", baseline=baseline)
    assert_close_to_rounding(valued, kl_grad, ulps=200, what="cumulative+value")
    got = GradSpec.parse("k1/cumulative+value").build("pi||ref", testbed)(batch)
    direct = klest.kl_penalty(
        batch.logp,
        batch.logp_ref,
        mask=batch.mask,
        estimator="k1",
        grad="cumulative",
        baseline=testbed.future_kl(batch.x),
    )
    g_got = torch.autograd.grad(got, testbed.logits, retain_graph=True)[0]
    assert torch.equal(g_got, torch.autograd.grad(direct, testbed.logits)[0])
