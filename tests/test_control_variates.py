"""Fitted control-variate coefficients against brute-force refits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from klest.control_variates import AlphaEMA, fit_alpha
from klest.testbeds import make_generator


def brute_alpha(a: np.ndarray, b: np.ndarray) -> float:
    """-Cov(a, b) / Var(b) over a pooled set, by numpy."""
    if a.size < 2 or np.var(b) == 0:
        return 0.0
    return -np.cov(a, b, ddof=1)[0, 1] / np.var(b, ddof=1)


def case(rows, t, seed):
    g = make_generator(seed)
    a = torch.randn(rows, t, generator=g, dtype=torch.float64)
    b = torch.randn(rows, t, generator=g, dtype=torch.float64) + 0.3 * a
    valid = torch.rand(rows, t, generator=g) > 0.3
    valid[:, 0] = True
    return a, b, valid


@pytest.mark.parametrize("shape", [(5, 1), (6, 4), (9, 3)])
def test_loo_matches_refit_without_each_row(shape):
    a, b, valid = case(*shape, seed=1)
    got = fit_alpha(a, b, valid, "loo")
    for i in range(shape[0]):
        others = [j for j in range(shape[0]) if j != i]
        aa = a[others][valid[others]].numpy()
        bb = b[others][valid[others]].numpy()
        assert float(got[i]) == pytest.approx(brute_alpha(aa, bb), rel=1e-9)


def test_crossfit_uses_the_other_fold_and_in_sample_uses_all():
    a, b, valid = case(7, 3, seed=2)
    cross = fit_alpha(a, b, valid, "crossfit")
    for i in range(7):
        other = [j for j in range(7) if j % 2 != i % 2]
        expected = brute_alpha(a[other][valid[other]].numpy(), b[other][valid[other]].numpy())
        assert float(cross[i]) == pytest.approx(expected, rel=1e-9)
    whole = fit_alpha(a, b, valid, "in-sample")
    assert torch.allclose(
        whole,
        torch.full((7,), brute_alpha(a[valid].numpy(), b[valid].numpy()), dtype=torch.float64),
    )


def test_groups_fit_separately():
    a, b, valid = case(8, 2, seed=3)
    group = torch.tensor([5, 5, 9, 9, 5, 9, 5, 9])
    got = fit_alpha(a, b, valid, "loo", group=group)
    for g_id in (5, 9):
        rows = (group == g_id).nonzero().squeeze(1)
        alone = fit_alpha(a[rows], b[rows], valid[rows], "loo")
        assert torch.allclose(got[rows], alone, rtol=1e-12)
    cross = fit_alpha(a, b, valid, "crossfit", group=group)
    for g_id in (5, 9):
        rows = (group == g_id).nonzero().squeeze(1)
        assert torch.allclose(
            cross[rows], fit_alpha(a[rows], b[rows], valid[rows], "crossfit"), rtol=1e-12
        )


def test_constant_control_variate_gives_alpha_zero_not_rounding_noise():
    a = torch.tensor([[0.3], [1.7], [-0.2], [0.9]], dtype=torch.float64)
    b = torch.tensor([[0.1], [0.1], [0.1], [5.0]], dtype=torch.float64)
    valid = torch.ones_like(a, dtype=torch.bool)
    got = fit_alpha(a, b, valid, "loo")
    assert float(got[3]) == 0.0  # the other three rows have equal b: no variance to fit


def test_loo_needs_two_rows_per_group():
    a, b, valid = case(3, 2, seed=4)
    with pytest.raises(ValueError, match="at least 2 rows per group"):
        fit_alpha(a, b, valid, "loo", group=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="unknown alpha"):
        fit_alpha(a, b, valid, "best")


def test_fitted_alpha_is_detached():
    a, b, valid = case(4, 2, seed=5)
    a.requires_grad_(True)
    assert not fit_alpha(a, b, valid, "loo").requires_grad


def test_ema_uses_only_past_batches_and_matches_a_brute_force_average():
    ema = AlphaEMA(decay=0.5, init=0.7)
    assert ema.alpha == 0.7
    batches = [case(4, 3, seed=s) for s in range(3)]
    moments = np.zeros(4)
    weight = 0.0
    for a, b, valid in batches:
        ema.update(a, b, valid)
        x, y = a[valid].numpy(), b[valid].numpy()
        moments = 0.5 * moments + 0.5 * np.array(
            [x.mean(), y.mean(), (x * y).mean(), (y * y).mean()]
        )
        weight = 0.5 * weight + 0.5
        ea, eb, eab, ebb = moments / weight
        assert ema.alpha == pytest.approx(-(eab - ea * eb) / (ebb - eb * eb), rel=1e-10)
    with pytest.raises(ValueError, match="decay"):
        AlphaEMA(decay=1.0)
