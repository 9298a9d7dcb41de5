"""Statistics helpers of the statistical tests, and the rule they follow.

The rule: every statistical test states its false-fail rate, the probability that a correct
implementation fails it at a seed chosen blindly, and derives its thresholds from that rate.

- One comparison: a Monte Carlo mean is compared with an exact answer within ``Z`` standard
  errors, ``Z = 4``: a two-sided false-fail rate of ``RATE = 6.3e-5`` under the normal
  approximation.
- Several comparisons in one test: Bonferroni. For ``m`` comparisons at family rate ``RATE``
  each uses the normal quantile at ``RATE / (2 m)`` (two-sided) or ``RATE / m`` (one-sided):
  :func:`z_for`; :func:`t_for` does the same with Student's t where a standard deviation is
  estimated from few independent replicates.
- Power: where a test asserts that something *is* detected, its sample size is chosen so that
  the expected statistic is well above the threshold (each such test says by how much).

Every statistical test draws through a fixed seed, so it is deterministic; its ``calibration``
companion (a pytest marker: ``make calibration`` runs them, ``make test`` does not) reruns the
test's computation over many seeds and checks the failures it sees against the stated rate
(:func:`assert_failures_consistent`): the evidence for the threshold, not a check of the code
that the test itself lacks.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

Z = 4.0
RATE = 2 * NormalDist().cdf(-Z)
"""The false-fail rate of one test: that of one two-sided comparison at ``Z`` (6.3e-5)."""


def z_for(family_rate: float = RATE, comparisons: int = 1, *, two_sided: bool = True) -> float:
    """The Bonferroni threshold of one of ``comparisons`` normal comparisons whose family-wise
    false-fail rate is ``family_rate``: the normal quantile at ``family_rate / comparisons``,
    split over both tails when ``two_sided``. ``z_for(RATE, 1) == Z``."""
    if not 0 < family_rate < 1 or comparisons < 1:
        raise ValueError(f"need 0 < family_rate < 1 and comparisons >= 1, got {family_rate}")
    tail = family_rate / comparisons / (2 if two_sided else 1)
    return -NormalDist().inv_cdf(tail)


def t_for(
    family_rate: float = RATE, comparisons: int = 1, *, dof: int, two_sided: bool = True
) -> float:
    """As :func:`z_for`, with Student's t on ``dof`` degrees of freedom (a mean over its
    standard error when that error is estimated from ``dof + 1`` normal replicates)."""
    import mpmath

    tail = family_rate / comparisons / (2 if two_sided else 1)

    def upper_tail(t: float) -> float:  # P(T > t) = I_{dof / (dof + t^2)}(dof / 2, 1 / 2) / 2
        x = dof / (dof + t * t)
        return float(mpmath.betainc(dof / 2, 0.5, 0, x, regularized=True)) / 2

    lo, hi = 0.0, 1.0
    while upper_tail(hi) > tail:
        lo, hi = hi, 2 * hi
    for _ in range(100):  # bisection: 100 halvings reach float precision
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if upper_tail(mid) > tail else (lo, mid)
    return hi


def assert_failures_consistent(stats: list[float], threshold: float, rate: float, what: str):
    """A ``calibration`` companion's verdict: ``stats`` are one test statistic per seed (larger is
    worse), ``threshold`` the test's, ``rate`` its false-fail rate per seed.

    With ``rate * len(stats) << 1`` a correct implementation shows no failure at all (the
    companion's own false-fail rate is about ``rate * len(stats)``); the message reports how
    close the worst seed came to the threshold.
    """
    n = len(stats)
    assert rate * n < 0.01, f"{what}: {n} seeds at rate {rate:.2g} expect failures; use fewer"
    worst = max(stats)
    fails = sum(s > threshold for s in stats)
    assert fails == 0, (
        f"{what}: {fails} of {n} seeds fail (expected {rate * n:.1e} at the stated false-fail "
        f"rate {rate:.2g}); worst statistic {worst:.3g} vs threshold {threshold:.3g}"
    )
    return worst


def mean_z(draws: torch.Tensor, exact: float) -> float:
    """``|mean(draws) - exact|`` in standard errors ``std(draws) / sqrt(n)`` (``inf`` when the
    draws do not vary and miss ``exact`` by more than 1e-12, 0 when they match it)."""
    draws = draws.detach().double().reshape(-1)
    gap = abs(float(draws.mean()) - exact)
    se = float(draws.std()) / math.sqrt(draws.numel())
    if se == 0:
        return 0.0 if gap <= 1e-12 else math.inf
    return gap / se


def binomial_tail(k: int, n: int, p: float) -> float:
    """The smaller tail of Binomial(n, p) at ``k``, min(P(X <= k), P(X >= k)), summed exactly
    (in log space): a frequency's two-sided test without the normal approximation, whose
    tails are too thin when n p is small (at n p = 130 a z of 4.25 fails at 1.5 times its
    normal rate)."""
    log_p, log_q = math.log(p), math.log1p(-p)
    top = math.lgamma(n + 1)

    def pmf(j: int) -> float:
        return math.exp(
            top - math.lgamma(j + 1) - math.lgamma(n - j + 1) + j * log_p + (n - j) * log_q
        )

    return min(sum(map(pmf, range(k + 1))), sum(map(pmf, range(k, n + 1))))


def assert_mean_close(draws: torch.Tensor, exact: float, *, z: float = Z, what: str = "") -> None:
    """Assert ``|mean(draws) - exact| <= z * std(draws) / sqrt(n)``."""
    draws = draws.detach().double().reshape(-1)
    n = draws.numel()
    mean = float(draws.mean())
    se = float(draws.std()) / math.sqrt(n)
    assert abs(mean - exact) <= z * se + 1e-12, (
        f"{what}: mean {mean:.6g} vs exact {exact:.6g}; |diff| = {abs(mean - exact):.3g} "
        f"> {z} se = {z * se:.3g} (n = {n})"
    )


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp(min=1e-300)).max())
