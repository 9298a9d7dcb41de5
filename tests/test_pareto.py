"""The Pareto k-hat of :mod:`klest.pareto` against ArviZ's ``psislw``, the reference PSIS code."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import klest
from klest.pareto import MIN_SAMPLES, pareto_k
from klest.testbeds import make_generator
from tests._tolerance import assert_close_to_rounding


def arviz_k(log_ratios: torch.Tensor) -> float:
    """``arviz.psislw``'s shape estimate for one sample of log-ratios (float64)."""
    with warnings.catch_warnings():  # the import's FutureWarning, psislw's own warnings
        warnings.simplefilter("ignore")
        import arviz

        _, k = arviz.psislw(log_ratios.detach().double().numpy().copy())
    return float(k)


def _sample(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    """Log-ratios of ``n`` draws: log-normal ``ln<sigma>``, generalized Pareto ``gp<k>``
    (``r = ((U^-k - 1) / k)``), uniform ``r ~ U(0, 1)`` (a bounded tail, k = -1)."""
    u = torch.rand(n, generator=g, dtype=torch.float64)
    if kind.startswith("ln"):
        return float(kind[2:]) * torch.randn(n, generator=g, dtype=torch.float64)
    if kind.startswith("gp"):
        k = float(kind[2:])
        return torch.log(torch.expm1(-k * u.log()) / k)
    assert kind == "uniform"
    return u.log()


KINDS = ["ln0.5", "ln1", "ln2", "gp0.3", "gp0.9", "gp1.5", "uniform"]
SIZES = [50, 257, 4096]


def _ulps(n: int) -> float:
    """The rounding budget of k-hat, in float64 ulps of 1 (k-hat and the logs it averages are
    O(1)): the profile over the grid, M (log(-b/k) - k - 1) with M = min(n/5, 3 sqrt n) tail
    values, is a sum of M logs, so each carries M ulps of its O(1) terms; the weights are
    exponentials of their differences, so they carry that as relative error, and so do the
    posterior b and k-hat: 16 M ulps (a few ulps per operation, twice for two orders of the
    sums)."""
    return 16 * math.ceil(min(n / 5, 3 * math.sqrt(n)))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_pareto_k_is_arviz_psislw_shape(kind, n):
    """The same estimator as ArviZ (Zhang and Stephens' fit on the M largest ratios, PSIS's
    prior): equal up to the rounding of the two orders of the same float64 sums."""
    x = _sample(kind, n, make_generator(n))
    assert_close_to_rounding(
        pareto_k(x), torch.tensor(arviz_k(x), dtype=torch.float64), ulps=_ulps(n), scale=1.0
    )


def test_float32_ratios_are_selected_in_float32_and_fitted_in_float64():
    """float32 log-ratios give ArviZ's k-hat of the same (exactly widened) values: selecting
    the largest in float32 loses nothing."""
    g = make_generator(3)
    x = (2 * torch.randn(1000, generator=g)).float()
    k = pareto_k(x)
    assert k.dtype == torch.float64
    assert_close_to_rounding(
        k, torch.tensor(arviz_k(x.double()), dtype=torch.float64), ulps=_ulps(1000), scale=1.0
    )


def test_batched_and_masked_samples_are_each_their_own():
    """Each leading index is its own sample, and a mask keeps only its True ratios (the masked
    ones may hold anything, +inf included)."""
    g = make_generator(4)
    x = 1.5 * torch.randn(3, 600, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 600, generator=g) > 0.3
    mask[2, :500] = False  # 100 ratios or fewer left: a smaller tail
    poisoned = torch.where(mask, x, math.inf)
    k = pareto_k(poisoned, mask=mask)
    for i in range(3):
        want = torch.tensor(arviz_k(x[i][mask[i]]), dtype=torch.float64)
        assert_close_to_rounding(k[i], want, ulps=_ulps(600), scale=1.0, what=f"row {i}")


def test_too_few_or_tied_ratios_give_nan():
    """Below MIN_SAMPLES valid ratios, or with fewer than 5 strictly above the tail's cut
    (ArviZ's "not enough tail samples"), there is no fit: NaN. So is a NaN or +inf ratio."""
    g = make_generator(5)
    x = torch.randn(2, 400, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 400, dtype=torch.bool)
    mask[0, MIN_SAMPLES - 1 :] = False  # MIN_SAMPLES - 1 valid ratios in row 0
    k = pareto_k(x, mask=mask)
    assert math.isnan(k[0]) and math.isfinite(k[1])
    assert math.isnan(pareto_k(x[0, : MIN_SAMPLES - 1]))
    assert math.isfinite(pareto_k(x[0, :MIN_SAMPLES]))
    assert math.isnan(pareto_k(torch.zeros(1000)))  # one ratio, 1000 times: no tail
    assert math.isnan(pareto_k(torch.cat([x[1], torch.tensor([math.nan])])))
    assert math.isnan(pareto_k(torch.cat([x[1], torch.tensor([math.inf])])))
    assert pareto_k(torch.randn(4, 0)).shape == (4,)


def test_ratios_of_zero_sit_in_the_body():
    """A log-ratio of -inf is a ratio of 0 (a sample pi cannot produce, off-policy): it counts
    as a sample and never reaches the tail. ArviZ agrees once -inf is a ratio tiny enough."""
    g = make_generator(6)
    x = torch.randn(500, generator=g, dtype=torch.float64)
    x[::7] = -math.inf
    want = arviz_k(torch.where(torch.isinf(x), -1e4, x))
    assert_close_to_rounding(pareto_k(x), torch.tensor(want), ulps=_ulps(500), scale=1.0)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="log_ratios"):
        pareto_k(torch.arange(100))
    with pytest.raises(ValueError, match=r"log_ratios must be \[\.\.\., n\]"):
        pareto_k(torch.tensor(1.0))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        pareto_k(torch.randn(100), mask=torch.ones(100))
    with pytest.raises(ValueError, match="min_samples"):
        pareto_k(torch.randn(100), min_samples=0)


def test_pareto_k_is_public():
    assert klest.pareto_k is pareto_k


def test_it_reads_nothing_back_to_the_host():
    """On the ``meta`` device (shapes, no data) every host read of a value raises, so a k-hat
    computed there, masked or not, batched or not, was computed without one."""
    x = torch.empty(3, 1000, device="meta")
    mask = torch.empty(3, 1000, dtype=torch.bool, device="meta")
    assert pareto_k(x).shape == (3,) and pareto_k(x, mask=mask).shape == (3,)
    assert pareto_k(x[0]).shape == ()
