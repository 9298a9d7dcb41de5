"""The audit: it must flag a biased estimator and clear an unbiased one, with honest errors."""

from __future__ import annotations

import math

import pytest
import torch

from klest.audit import EstimatorSpec, audit_value, format_value_audits
from klest.testbeds import GaussianTestbed


def test_flags_k2_bias_and_clears_k3_on_schulman_mu_1():
    tb = GaussianTestbed.schulman(1.0)
    k2 = audit_value("k2", tb, batch_size=100_000, n_trials=1, seed=0)
    k3 = audit_value("k3", tb, batch_size=100_000, n_trials=1, seed=0)
    assert k2.significant and k2.expected == pytest.approx(0.625, rel=1e-10)
    assert not k3.significant and k3.expected == pytest.approx(0.5, rel=1e-10)
    # k1's per-sample stdev is exactly mu = 1 here (delta ~ N(1/2, 1)).
    k1 = audit_value("k1", tb, batch_size=100_000, n_trials=1, seed=0)
    assert abs(k1.std - 1.0) <= 4 * k1.se_std


def test_trial_loop_and_vectorized_paths_agree():
    """The vectorized path (trials as fitting groups) draws the same distribution as a loop."""
    tb = GaussianTestbed.schulman(0.5)
    spec = EstimatorSpec.parse("cv:loo")
    vectorized = audit_value("cv:loo", tb, batch_size=8, n_trials=4000, seed=3)
    looped = audit_value(spec.build("pi||ref"), tb, batch_size=8, n_trials=4000, seed=4)
    se = math.hypot(vectorized.se_bias, looped.se_bias)
    assert abs(vectorized.mean - looped.mean) <= 4 * se
    assert abs(vectorized.std - looped.std) <= 4 * math.hypot(vectorized.se_std, looped.se_std)
    assert vectorized.n_draws == looped.n_draws == 4000


def test_function_estimator_and_std_standard_error():
    tb = GaussianTestbed.schulman(0.3)

    def half_k1(sample):
        return 0.5 * (sample.logp - sample.logp_ref)

    a = audit_value(half_k1, tb, batch_size=20_000, n_trials=5, seed=1, name="half")
    assert a.estimator == "half" and a.n_draws == 100_000
    # Biased by exactly -KL/2: significant with this many draws.
    assert a.significant and a.expected is None
    # For a normal variable, se(std) = std / sqrt(2 n).
    assert a.se_std == pytest.approx(a.std / math.sqrt(2 * a.n_draws), rel=0.05)


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


def test_mean_shift_z_is_calibrated_under_the_null_and_detects_a_shift():
    from klest.audit import mean_shift_z

    g = torch.Generator().manual_seed(0)
    dim, n = 30, 200
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64) / dim**0.5
    zs = []
    for _ in range(300):
        draws = torch.randn(n, dim, generator=g, dtype=torch.float64) @ mix
        zs.append(mean_shift_z(draws, torch.zeros(dim, dtype=torch.float64)))
    zs = torch.tensor(zs)
    # 300 null replicates: mean within 4 se (se = 1/sqrt(300)) of 0, sd near 1, no z above 4.
    assert abs(float(zs.mean())) < 4 / 300**0.5
    assert 0.8 < float(zs.std()) < 1.2
    assert float(zs.max()) < 4
    shifted = torch.randn(n, dim, generator=g, dtype=torch.float64) @ mix + 0.2
    assert mean_shift_z(shifted, torch.zeros(dim, dtype=torch.float64)) > 4


def _bonferroni_z(m: int, z: float = 4.0) -> float:
    """The per-coordinate threshold that keeps the family-wise false-fail rate of m two-sided
    comparisons at that of one comparison at ``z`` (6e-5 for z = 4)."""
    from statistics import NormalDist

    p = 2 * (1 - NormalDist().cdf(z))
    return NormalDist().inv_cdf(1 - p / (2 * m))


def test_grad_audit_reports_the_mean_gradient_and_the_bias_vector():
    from klest.audit import GradSpec, audit_grad, gradient_draws
    from klest.testbeds import TabularAutoregressive

    tb = TabularAutoregressive.random(3, 3, eos=2, seed=4, scale=0.8)
    exact = torch.cat([g.reshape(-1) for g in tb.exact_kl_grad("pi||ref")]).double()
    a = audit_grad("k3/cumulative", tb, batch_size=8, n_trials=400, seed=7)
    assert a.mean_grad.shape == a.bias.shape == a.se.shape == exact.shape
    assert not (a.mean_grad.requires_grad or a.bias.requires_grad)
    # The same draws recomputed outside the audit.
    draws = gradient_draws(
        GradSpec.parse("k3/cumulative").build("pi||ref"), tb, batch_size=8, n_trials=400, seed=7
    )
    torch.testing.assert_close(a.mean_grad, draws.mean(0), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(a.bias, a.mean_grad - exact, rtol=0, atol=1e-15)
    assert float(a.bias.norm()) == pytest.approx(a.bias_norm, rel=1e-12)
    # Unbiased (cumulative): every coordinate within the Bonferroni-corrected Z standard errors.
    # Coordinates of prefixes after eos are never reached: exactly 0 in draws and exact gradient.
    varies = a.se > 0
    z = _bonferroni_z(int(varies.sum()))
    assert bool((a.bias[varies].abs() <= z * a.se[varies]).all()), (a.bias / a.se).abs().max()
    assert bool((a.bias[~varies] == 0).all())
    # The token-level gradient is biased on sequences: some coordinate is far outside.
    b = audit_grad("k3/token", tb, batch_size=8, n_trials=400, seed=7)
    assert bool((b.bias.abs() > z * b.se).any())
    assert set(a.as_dict()) >= {"mean_grad", "bias", "se"}
    assert "mean_grad" not in repr(a)
