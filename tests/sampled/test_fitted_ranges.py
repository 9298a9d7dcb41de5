"""The fitted coefficients' documented ranges and edge cases, against answers written by hand.

- ``mix_coefficient`` (``grad="adaptive"``): :math:`c_i = -\\sum_{j\\ne i} ab / \\sum_{j\\ne i}
  b^2`; for KL(pi||ref) at most :math:`e^{-\\hat\\sigma^2_{-i}}` with :math:`\\hat\\sigma^2`
  the *sample* variance (divisor n - 1) of the other rows' log-ratios, a cap that needs two of
  them (one log-ratio has no variance); no cap for KL(ref||pi); 0 without another valid row.
- ``baseline_scale`` (``"loo-fitted"``) and :class:`klest.LooScaleEMA`: a regression clipped
  to [0, 1]: 0 for targets that anti-correlate with their leave-one-out means, at most 1 where
  rounding of a ratio whose exact value is just below 1 lands above it.
"""

from __future__ import annotations

import math

import pytest
import torch

from klest import LooScaleEMA
from klest.sampled.baselines import baseline_scale, mix_coefficient
from tests._tolerance import assert_close_to_rounding


def _col(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)[:, None]


# -- the k1/k3 mix coefficient ----------------------------------------------------------------


def test_mix_coefficient_with_a_single_other_log_ratio_is_not_capped():
    """Two rows of one token: c_0 = sum r / sum r^2 over row 1 = e^{delta_1} (r = e^{-delta});
    one log-ratio has no sample variance, so no cap, even where c > 1."""
    delta = _col(-0.3, 0.5)
    c = mix_coefficient(delta, None, "pi||ref")
    want = _col(math.exp(0.5), math.exp(-0.3))
    assert_close_to_rounding(c, want, ulps=8)
    assert float(c[0]) > 1.0


def test_mix_coefficient_cap_uses_the_sample_variance():
    """Three rows of one token, log-ratios (0, 1, -1). Row 0: the others' sum r / sum r^2 =
    (e + e^-1) / (e^2 + e^-2) = 0.41 is capped by e^{-var} with the sample variance of (1, -1),
    2 (the population variance 1 would give e^-1 = 0.37); row 2: 1.20 capped by e^-0.5 (not
    e^-0.25); row 1: 0.44, below its cap."""
    delta = _col(0.0, 1.0, -1.0)
    c = mix_coefficient(delta, None, "pi||ref")
    r = [math.exp(-d) for d in (0.0, 1.0, -1.0)]

    def fit(others):
        return sum(r[j] for j in others) / sum(r[j] ** 2 for j in others)

    def sample_var(others):
        ds = [(0.0, 1.0, -1.0)[j] for j in others]
        m = sum(ds) / len(ds)
        return sum((d - m) ** 2 for d in ds) / (len(ds) - 1)

    want = [min(fit(o), math.exp(-sample_var(o))) for o in ((1, 2), (0, 2), (0, 1))]
    assert want == [math.exp(-2.0), fit((0, 2)), math.exp(-0.5)]  # the cap binds at rows 0, 2
    assert_close_to_rounding(c, _col(*want), ulps=8)


def test_mix_coefficient_for_kl_ref_pi_is_never_capped():
    """KL(ref||pi): (a, b) = (r (delta - 1), r), so c_i = -sum r^2 (delta - 1) / sum r^2 over
    the other rows, above any variance cap here (row 0: 1.96 against e^-2)."""
    deltas = (0.0, 1.0, -1.0)
    c = mix_coefficient(_col(*deltas), None, "ref||pi")
    want = []
    for i in range(3):
        others = [d for j, d in enumerate(deltas) if j != i]
        num = sum(math.exp(-2 * d) * (d - 1) for d in others)
        want.append(-num / sum(math.exp(-2 * d) for d in others))
    assert want[0] > 1.9
    assert_close_to_rounding(c, _col(*want), ulps=8)


def test_mix_coefficient_counts_valid_tokens_only():
    """A masked token (even a NaN there) is neither in the fit nor in the variance: a row whose
    only valid other token is one log-ratio gets e^{delta} uncapped."""
    delta = torch.tensor([[0.2, math.nan], [0.7, 3.0]], dtype=torch.float64)
    valid = torch.tensor([[True, False], [True, False]])
    c = mix_coefficient(delta, valid, "pi||ref")
    assert_close_to_rounding(c, _col(math.exp(0.7), math.exp(0.2)), ulps=8)


# -- the baseline scales: [0, 1] -------------------------------------------------------------


def _near_equal(rows: int, seed: int) -> torch.Tensor:
    """Targets 1 + 1e-8 noise: the regression of A on its leave-one-out mean is 1 - O(1e-16)
    exactly (Cauchy-Schwarz: never above 1), and rounds to either side of 1."""
    g = torch.Generator().manual_seed(seed)
    return 1.0 + 1e-8 * torch.randn(rows, 1, generator=g, dtype=torch.float64)


def test_cross_fitted_scale_is_at_most_one_where_rounding_says_more():
    """Near-equal targets: lambda <= 1 on every row of 40 batches (and within 1e-12 of it); the
    unclipped ratio rounds above 1 on some of them."""
    valid = torch.ones(6, 1, dtype=torch.bool)
    keys = torch.zeros(6, dtype=torch.int64)
    lams = torch.cat([baseline_scale(_near_equal(6, s), valid, keys) for s in range(40)])
    assert (lams <= 1.0).all(), float(lams.max())
    assert (lams > 1.0 - 1e-12).all()


def test_cross_fitted_scale_is_zero_for_anti_correlated_targets():
    """Within each fold the two rows of a group have opposite targets (1, -1): sum A B' = -2 <
    0 on each fold, so lambda = 0 (no baseline) on every row, not a negative scale."""
    targets = _col(1.0, 2.0, -1.0, -2.0)  # folds {0, 2} and {1, 3}
    lam = baseline_scale(targets, torch.ones(4, 1, dtype=torch.bool), torch.zeros(4).long())
    assert torch.equal(lam, torch.zeros(4, 1, dtype=torch.float64))


@pytest.mark.parametrize("per_position", [True, False])
def test_moving_average_scale_stays_in_the_unit_interval(per_position):
    """LooScaleEMA: after a batch of near-equal targets its scale is in (1 - 1e-12, 1] (the
    unclipped ratio rounds above 1 on some of 40 batches), after anti-correlated targets
    (rows of a group (1, -1, 1, -1): sum A B = -4/3 * 4 < 0) exactly 0, and the baseline is
    then 0."""
    keys = torch.zeros(3, dtype=torch.int64)
    valid = torch.ones(3, 1, dtype=torch.bool)
    for seed in range(40):
        fit = LooScaleEMA(decay=0.0, per_position=per_position)
        fit(_near_equal(3, seed), valid, keys)
        lam = fit.scales(1)
        assert float(lam) <= 1.0 and float(lam) > 1.0 - 1e-12, float(lam)
    fit = LooScaleEMA(decay=0.0, per_position=per_position)
    four = torch.zeros(4, dtype=torch.int64)
    fit(_col(1.0, -1.0, 1.0, -1.0), torch.ones(4, 1, dtype=torch.bool), four)
    assert torch.equal(fit.scales(1), torch.zeros(1, dtype=torch.float64))
    after = fit(_col(3.0, 1.0, 2.0, 5.0), torch.ones(4, 1, dtype=torch.bool), four)
    assert torch.equal(after, torch.zeros(4, 1, dtype=torch.float64))


def test_moving_average_scale_skips_a_position_without_a_mate_and_drops_a_negligible_one():
    """Per position, decay 0 (the last batch that counts decides), scales written out by the
    regression of each row's target on its leave-one-out mean. Batch 2 has a mate at the first
    token only (one row reaches the second): the second position's scale stays batch 1's.
    Batch 3: the second position's targets are 1e-9 against the first's 1, its sum of squared
    leave-one-out means below 1e-12 of the first's: scale 0 there."""
    keys = torch.zeros(4, dtype=torch.int64)
    fit = LooScaleEMA(decay=0.0)
    full = torch.ones(4, 2, dtype=torch.bool)
    a = torch.tensor([[1.5, 2.0], [1.5, 2.0], [0.5, 2.0], [1.5, 2.0]], dtype=torch.float64)
    fit(a, full, keys)

    def scale(x, valid, t):
        """sum A B / sum B^2 over the rows with a mate at column t (B: the others' mean)."""
        rows = [i for i in range(4) if valid[i, t]]
        num = den = 0.0
        for i in rows:
            others = [float(x[j, t]) for j in rows if j != i]
            if others:
                b = sum(others) / len(others)
                num, den = num + float(x[i, t]) * b, den + b * b
        return min(max(num / den, 0.0), 1.0)

    first = [scale(a, full, 0), scale(a, full, 1)]
    assert_close_to_rounding(fit.scales(2), torch.tensor(first, dtype=torch.float64), ulps=8)
    one_long = torch.tensor([[True, True], [True, False], [True, False], [True, False]])
    b = torch.tensor([[2.0, 9.0], [1.0, 0.0], [3.0, 0.0], [2.5, 0.0]], dtype=torch.float64)
    fit(b, one_long, keys)
    second = [scale(b, one_long, 0), first[1]]
    assert_close_to_rounding(fit.scales(2), torch.tensor(second, dtype=torch.float64), ulps=8)
    c = torch.tensor([[1.0, 1e-9], [1.0, 1e-9], [1.0, 1e-9], [1.0, 1e-9]], dtype=torch.float64)
    fit(c, full, keys)
    assert float(fit.scales(2)[1]) == 0.0 and float(fit.scales(2)[0]) == 1.0
