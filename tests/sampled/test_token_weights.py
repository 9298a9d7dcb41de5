"""iw_opd_weights: IW-OPD's per-token weights against a hand computation, and its bad input."""

from __future__ import annotations

import pytest
import torch

import klest
from tests._tolerance import assert_close_to_rounding


def test_iw_opd_weights_by_hand():
    """Row 0: |rho| = 0.5, 0.25, 0, 1 (total 1.75, before each token 0, 0.5, 0.75, 0.75), so
    w = 1 + 0.5 (1 - before / 1.75) = 3/2, 19/14, 9/7, 9/7. Row 1: the last two tokens masked
    (their log-ratios of 7 count nowhere): |rho| = 1, 0.5, w = 3/2, 7/6, 0, 0. Row 2: every
    log-ratio 0, the total floored at epsilon: w = 3/2 throughout. Tolerance: a few roundings
    of numbers below 2 (cumsum, division, one multiply-add), 8 ulps of float64."""
    logp = torch.tensor(
        [[-1.0, -0.5, -2.0, -0.25], [-1.0, -1.0, -1.0, -1.0], [-0.5, -0.5, -0.5, -0.5]],
        dtype=torch.float64,
    )
    logp_ref = torch.tensor(
        [[-1.5, -0.25, -2.0, -1.25], [-2.0, -1.5, -8.0, -8.0], [-0.5, -0.5, -0.5, -0.5]],
        dtype=torch.float64,
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    expected = torch.tensor(
        [[3 / 2, 19 / 14, 9 / 7, 9 / 7], [3 / 2, 7 / 6, 0, 0], [3 / 2] * 4], dtype=torch.float64
    )
    got = klest.iw_opd_weights(logp, logp_ref, mask=mask, gain=0.5)
    assert not got.requires_grad
    assert_close_to_rounding(got, expected, ulps=8)
    # gain 0: every valid token weighs 1
    zero = klest.iw_opd_weights(logp, logp_ref, mask=mask, gain=0.0)
    assert torch.equal(zero, mask.to(torch.float64))


def test_iw_opd_weights_are_detached_and_keep_the_batch_shape():
    logp = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = klest.iw_opd_weights(logp, torch.zeros(2, 3, 5, dtype=torch.float64))
    assert w.shape == (2, 3, 5) and not w.requires_grad
    assert torch.all(w[..., 0] == 1.5)


def test_iw_opd_weights_bad_input():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"logp has shape \(2, 3\) but logp_ref has shape"):
        klest.iw_opd_weights(lp, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="logp must have a floating-point dtype"):
        klest.iw_opd_weights(lp.long(), lp)
    with pytest.raises(ValueError, match="gain must be"):
        klest.iw_opd_weights(lp, lp, gain=-0.5)
    with pytest.raises(ValueError, match="epsilon must be"):
        klest.iw_opd_weights(lp, lp, epsilon=0.0)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\)"):
        klest.iw_opd_weights(lp, lp, mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="NaN or infinite"):
        klest.iw_opd_weights(torch.tensor([[0.0, float("nan")]]), torch.zeros(1, 2))
    # a non-finite log-prob at a masked-out token is padding, not an error
    masked = torch.tensor([[-1.0, float("-inf")]])
    w = klest.iw_opd_weights(masked, torch.zeros(1, 2), mask=torch.tensor([[True, False]]))
    assert w.tolist() == [[1.5, 0.0]]
