"""Named testbeds shared by the tests: each name is one fixed configuration.

``make(name)`` builds a fresh one (their parameters are leaves that tests differentiate).
"""

from __future__ import annotations

from collections.abc import Callable

from klest.testbeds import (
    CategoricalTestbed,
    GaussianTestbed,
    OffPolicyTestbed,
    ScoreFunctionGaussian,
    TabularAutoregressive,
    Testbed,
)


def _gaussian() -> GaussianTestbed:
    return GaussianTestbed(mean=[0.3, -0.2], log_std=[0.1, -0.15], mean_ref=0.0, log_std_ref=0.0)


def _gaussian_wide() -> GaussianTestbed:
    """As ``_gaussian`` with pi wider than ref in every dimension: r = ref / pi is bounded, so
    every moment of every estimator and gradient is finite (on ``_gaussian``, pi is narrower in
    the second dimension and E_pi[r^k] is finite only for k < 3.86)."""
    return GaussianTestbed(mean=[0.3, -0.2], log_std=[0.1, 0.15], mean_ref=0.0, log_std_ref=0.0)


def _tabular() -> TabularAutoregressive:
    return TabularAutoregressive.random(3, 3, eos=2, seed=4, scale=0.8)


def _off_policy() -> OffPolicyTestbed:
    target = _tabular()
    behavior = TabularAutoregressive(target.logits_ref * 0.7, target.logits_ref, horizon=3, eos=2)
    return OffPolicyTestbed(target, behavior)


FACTORIES: dict[str, Callable[[], Testbed]] = {
    # Gaussians: analytic KLs; reparameterized samples unless "-sf" (score function).
    "gaussian": _gaussian,
    "gaussian-sf": lambda: ScoreFunctionGaussian(_gaussian()),
    "gaussian-wide": _gaussian_wide,
    "gaussian-wide-sf": lambda: ScoreFunctionGaussian(_gaussian_wide()),
    "gaussian-3d": lambda: GaussianTestbed(
        mean=[0.2, -0.1, 0.3], log_std=[0.1, -0.2, 0.0], mean_ref=0.0, log_std_ref=0.0
    ),
    "schulman-0.7": lambda: GaussianTestbed.schulman(0.7),
    # One categorical draw: exact by summation.
    "categorical": lambda: CategoricalTestbed.random(5, seed=2),
    "categorical-6": lambda: CategoricalTestbed.random(6, seed=3),
    # Sequences (V = 3 tokens): exact by enumeration or, Markov, dynamic programming.
    "tabular": _tabular,
    "tabular-T4": lambda: TabularAutoregressive.random(3, 4, eos=2, seed=4, scale=0.7),
    "tabular-fixed-length": lambda: TabularAutoregressive.random(3, 3, seed=4, scale=0.8),
    "markov": lambda: TabularAutoregressive.random(3, 5, eos=0, markov=True, seed=6, scale=0.7),
    "markov-T6": lambda: TabularAutoregressive.random(3, 6, eos=0, markov=True, seed=5, scale=0.7),
    "off-policy": _off_policy,
}


def make(name: str) -> Testbed:
    """A fresh testbed by name (see ``FACTORIES``)."""
    return FACTORIES[name]()
