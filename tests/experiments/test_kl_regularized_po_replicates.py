"""Replicate studies of the KL-regularized PO frontier: the interval and the pooled frontier."""

from __future__ import annotations

import math

import pytest
import scipy.stats

from klest.experiments.kl_regularized_po_replicates import replicate_frontier, t_quantile_975


def test_t_quantile_matches_scipy():
    for df in (1, 2, 5, 10, 29, 30, 31, 60, 200):
        assert abs(t_quantile_975(df) - scipy.stats.t.ppf(0.975, df)) < 1e-3, df


def _study(seed, points):
    """A study whose frontier is ``points``: (estimator, reward, kl)."""
    import numpy as np

    from klest.experiments.kl_regularized_po import frontier_share

    reward = np.array([p[1] for p in points])
    kl = np.array([p[2] for p in points])
    labels = [p[0] for p in points]
    return {
        "seed": seed,
        "quick": False,
        "frontier": {
            "points": [{"estimator": e, "reward": r, "kl": k} for e, r, k in points],
            "share": {
                "all": frontier_share(reward, kl, labels),
                "kl<5": frontier_share(reward, kl, labels, kl_below=5.0),
            },
        },
    }


def test_interval_is_the_t_interval_over_studies():
    # Three studies whose frontiers are two, three and four points (every point on its frontier).
    studies = [
        _study(0, [("rb", 0.1, 1.0), ("mc", 0.2, 2.0)]),
        _study(5, [("rb", 0.1, 1.0), ("rb", 0.2, 2.0), ("mc", 0.3, 6.0)]),
        _study(10, [("mc", 0.1, 1.0), ("rb", 0.2, 2.0), ("rb", 0.3, 3.0), ("rb", 0.4, 4.0)]),
    ]
    report = replicate_frontier(studies)
    shares = [0.5, 2 / 3, 0.75]
    mean = sum(shares) / 3
    sd = math.sqrt(sum((s - mean) ** 2 for s in shares) / 2)
    half = scipy.stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    iv = report.results["interval"]["all"]
    assert iv["mean"] == pytest.approx(mean, rel=1e-12)
    assert iv["low"] == pytest.approx(mean - half, rel=1e-3)
    assert iv["high"] == pytest.approx(mean + half, rel=1e-3)
    assert iv["excludes_half"] is (not (mean - half <= 0.5 <= mean + half))
    # Pooled: the (0.1, 1.0) rb points dominate the mc one at (0.1, 1.0)? equal: both stay.
    assert report.results["pooled"]["all"]["points"] >= 3
    assert "95% interval" in report.table and "frontier_shares" in report.figures


def test_refuses_quick_or_repeated_studies():
    s = _study(0, [("rb", 0.1, 1.0)])
    with pytest.raises(ValueError, match="distinct seeds"):
        replicate_frontier([s, s])
    with pytest.raises(ValueError, match="empty"):
        replicate_frontier([])
