"""Fitted control-variate coefficients against brute-force refits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from klest.sampled.control_variates import AlphaEMA, fit_alpha
from klest.sampled.groups import group_keys
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
    got = fit_alpha(a, b, valid, "loo", keys=group_keys(group))
    for g_id in (5, 9):
        rows = (group == g_id).nonzero().squeeze(1)
        alone = fit_alpha(a[rows], b[rows], valid[rows], "loo")
        assert torch.allclose(got[rows], alone, rtol=1e-12)
    cross = fit_alpha(a, b, valid, "crossfit", keys=group_keys(group))
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


def test_a_group_of_one_row_gets_alpha_zero():
    """No other row to fit on: k1 itself (alpha 0), which keeps the estimate unbiased."""
    a, b, valid = case(5, 2, seed=4)
    keys = group_keys(torch.tensor([0, 0, 1, 0, 2]))
    for method in ("loo", "crossfit"):
        got = fit_alpha(a, b, valid, method, keys=keys)
        assert float(got[2]) == 0.0 and float(got[4]) == 0.0
    with pytest.raises(ValueError, match="unknown alpha"):
        fit_alpha(a, b, valid, "best")


def test_fitted_alpha_is_detached():
    a, b, valid = case(4, 2, seed=5)
    a.requires_grad_(True)
    assert not fit_alpha(a, b, valid, "loo").requires_grad


def brute_ema_alpha(batches, decay, init):
    """The coefficient fitted on the decayed, bias-corrected moments of ``batches``."""
    if not batches:
        return init
    moments, weight = np.zeros(4), 0.0
    for a, b, valid in batches:
        x, y = a[valid].numpy(), b[valid].numpy()
        batch = np.array([x.mean(), y.mean(), (x * y).mean(), (y * y).mean()])
        moments = decay * moments + (1 - decay) * batch
        weight = decay * weight + (1 - decay)
    ea, eb, eab, ebb = moments / weight
    return -(eab - ea * eb) / (ebb - eb * eb)


def test_ema_uses_only_past_batches_and_matches_a_brute_force_average():
    ema = AlphaEMA(decay=0.5, init=0.7)
    assert float(ema.alpha) == 0.7
    batches = [case(4, 3, seed=s) for s in range(4)]
    for k, (a, b, valid) in enumerate(batches):
        used = ema(a, b, valid)  # fitted on the batches before this one
        assert float(used) == pytest.approx(brute_ema_alpha(batches[:k], 0.5, 0.7), rel=1e-10)
        assert float(ema.alpha) == pytest.approx(
            brute_ema_alpha(batches[: k + 1], 0.5, 0.7), rel=1e-10
        )
    with pytest.raises(ValueError, match="decay"):
        AlphaEMA(decay=1.0)


def test_ema_state_lives_in_buffers_and_survives_a_checkpoint():
    ema = AlphaEMA(decay=0.8)
    for s in range(3):
        ema(*case(5, 2, seed=10 + s))
    restored = AlphaEMA(decay=0.8)
    restored.load_state_dict(ema.state_dict())
    assert float(restored.alpha) == float(ema.alpha) != 1.0
    a, b, valid = case(5, 2, seed=20)
    assert float(restored(a, b, valid)) == float(ema(a, b, valid))


def test_an_all_invalid_batch_leaves_the_ema_unchanged():
    ema = AlphaEMA(decay=0.5)
    ema(*case(4, 3, seed=1))
    before = {k: v.clone() for k, v in ema.state_dict().items()}  # state_dict shares storage
    a, b, valid = case(4, 3, seed=2)
    ema(a, b, torch.zeros_like(valid))
    after = ema.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("c", [0.1, 0.3, 0.7])
def test_constant_control_variate_beside_a_large_one_gives_alpha_zero(c):
    """The leave-one-out set of the last row has equal b values, so Var(b) = 0 and alpha = 0
    exactly. Centred on a mean that the left-out b = 3e4 pulls far off, the sums leave rounding
    noise of order eps * sum(b^2) in that variance: the threshold must scale with sum(b^2)."""
    a = torch.tensor([[0.3], [1.7], [-0.2], [0.9], [0.4]], dtype=torch.float64)
    b = torch.tensor([[c], [c], [c], [c], [3e4]], dtype=torch.float64)
    got = fit_alpha(a, b, torch.ones_like(a, dtype=torch.bool), "loo")
    assert float(got[4]) == 0.0


def test_crossfit_folds_alternate_over_the_rows_with_tokens_only():
    """An empty row (a sequence with no valid token) takes no place in the alternation: the
    folds are the even and odd positions among the rows that have tokens."""
    a, b, valid = case(7, 3, seed=5)
    valid[2] = False
    cross = fit_alpha(a, b, valid, "crossfit")
    with_tokens = [i for i in range(7) if bool(valid[i].any())]
    fold = {row: k % 2 for k, row in enumerate(with_tokens)}
    for i in with_tokens:
        other = [j for j in with_tokens if fold[j] != fold[i]]
        expected = brute_alpha(a[other][valid[other]].numpy(), b[other][valid[other]].numpy())
        assert float(cross[i]) == pytest.approx(expected, rel=1e-9)
