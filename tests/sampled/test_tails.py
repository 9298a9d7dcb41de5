"""The tail diagnostic of the ratios a value averages (klest.sampled.tails): which values carry
one, the warning above k-hat = 0.7, and that it costs no extra host read (nothing at all with
validation off)."""

from __future__ import annotations

import math
import statistics
import warnings

import pytest
import torch

import klest
import klest._checks
import klest.sampled.tails
from klest.pareto import MIN_SAMPLES, PARETO_K_THRESHOLD, pareto_k
from klest.sampled.tails import TAIL_WARNING
from klest.testbeds import make_generator
from tests._stats import RATE, Z, assert_failures_consistent, t_for, z_for
from tests._tolerance import assert_close_to_rounding
from tests.test_host_syncs import counted_host_reads


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The once-per-process warnings as if none had been given yet (and restored after)."""
    monkeypatch.setattr(klest._checks, "_WARNED_ONCE", set())


def _tail_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "heavy upper tail" in str(w.message)]


def quantile_log_ratios(n: int, k: float) -> torch.Tensor:
    """The n quantiles ``(i + 1/2) / n`` of a generalized Pareto ratio with shape ``k``
    (``r = (U^-k - 1) / k``; ``k = 0``: exponential), as log-ratios, shuffled: a sample without
    sampling noise, so its k-hat is near ``k`` deterministically."""
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    r = -torch.log(u) if k == 0 else torch.expm1(-k * torch.log(u)) / k
    return r.log()[torch.randperm(n, generator=make_generator(n))]


# -- the Gaussian sweep: q = N(mu, sigma^2 I) in 16 dimensions, prior N(0, I) -----------------

D = 16
MU_NORM2 = 11.89  # ||mu||^2: KL(q || prior) = 9.93 at sigma = 0.55
N_SWEEP = 16384
FIRES = [(MU_NORM2, 0.55), (MU_NORM2, 0.3), (MU_NORM2, 0.1)]
QUIET = [(0.0, 0.95), (0.0, 0.9)]
# One-sided, Bonferroni over the five k-hats and the three k1 values of the sweep test.
SWEEP_COMPARISONS = len(FIRES) + len(QUIET) + len(FIRES)


def gaussian_batch(mu_norm2: float, sigma: float, n: int, g: torch.Generator):
    """``(log q(z), log prior(z), exact KL)`` at n reparameterized draws z = mu + sigma eps
    (float32, through a trainable mu), ``mu = sqrt(mu_norm2 / D) (1, ..., 1)``."""
    mu = torch.full((D,), math.sqrt(mu_norm2 / D), requires_grad=True)
    z = mu + sigma * torch.randn(n, D, generator=g)
    log_q = torch.distributions.Normal(mu, sigma).log_prob(z).sum(-1)
    log_prior = torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1)
    exact = 0.5 * (mu_norm2 + D * (sigma**2 - 1 - 2 * math.log(sigma)))
    return log_q, log_prior, exact


def sweep_point(mu_norm2: float, sigma: float, seed: int):
    """At one point of the sweep: Chimera's k-hat, whether it warned, k1's value and its
    standard error, k3's value, the exact KL."""
    log_q, log_prior, exact = gaussian_batch(mu_norm2, sigma, N_SWEEP, make_generator(seed))
    klest._checks._WARNED_ONCE.discard(TAIL_WARNING)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        k3, details = klest.kl_penalty(
            log_q,
            log_prior,
            estimator="k3",
            grad="pathwise",
            reparameterized=True,
            return_details=True,
        )
    _, k1 = klest.kl_estimate(
        log_q.detach(), log_prior.detach(), estimator="k1", density=True, return_details=True
    )
    return (
        details.diagnostics.pareto_k,
        bool(_tail_warnings(record)),
        k1.diagnostics.mean,
        k1.diagnostics.stderr,
        float(k3.detach()),
        exact,
    )


def test_chimera_warns_where_k3s_value_is_low_and_not_where_it_is_fine(fresh_warnings):
    """Claim: with 16384 draws, Chimera's value (k3) warns at sigma = 0.55, 0.3 and 0.1 with
    ``||mu||^2 = 11.89`` (where k3's batch value sits about a nat below the exact KL), and not at
    sigma = 0.95 and 0.9 with mu = 0 (finite-variance ratios; true tail shapes 0.10 and 0.19);
    and k1's value, which the warning recommends, is within its standard error of the exact KL
    there. Threshold: the library's 0.7; k1 at the Bonferroni z for 8 comparisons at RATE.
    Margin (calibration below): over seeds, k-hat's mean sits 6.1 to 10 of its standard
    deviations from 0.7, on the expected side (the one-sided Bonferroni z is 4.3)."""
    z_k1 = z_for(RATE, SWEEP_COMPARISONS)
    for i, (mu_norm2, sigma) in enumerate(FIRES + QUIET):
        k_hat, warned, k1, k1_se, _, exact = sweep_point(mu_norm2, sigma, seed=100 + i)
        fires = (mu_norm2, sigma) in FIRES
        assert (k_hat > PARETO_K_THRESHOLD) == fires == warned, (sigma, k_hat, warned)
        if fires:
            assert abs(k1 - exact) <= z_k1 * k1_se, (sigma, k1, exact, k1_se)


@pytest.mark.calibration
def test_calibration_chimera_sweep_k_hat_margins_and_k3s_bias():
    """Over 150 seeds of the sweep: k-hat's distance from 0.7 in standard deviations (normal
    approximation) clears the one-sided Bonferroni z of the CI test, no seed fails it, and k3's
    value is below the exact KL in most batches where the test expects the warning (the bias
    the warning is about) and centred on it where it expects none."""
    seeds = range(1000, 1150)
    z_needed = z_for(RATE, SWEEP_COMPARISONS, two_sided=False)
    for mu_norm2, sigma in FIRES + QUIET:
        points = [sweep_point(mu_norm2, sigma, seed) for seed in seeds]
        k_hats = [p[0] for p in points]
        fires = (mu_norm2, sigma) in FIRES
        sign = 1 if fires else -1
        margin = sign * (statistics.mean(k_hats) - PARETO_K_THRESHOLD) / statistics.stdev(k_hats)
        assert margin >= z_needed, (sigma, margin, z_needed)
        assert_failures_consistent(
            [-sign * (k - PARETO_K_THRESHOLD) for k in k_hats], 0.0, RATE, f"k-hat at {sigma}"
        )
        below = sum(p[4] < p[5] for p in points) / len(points)
        if fires:
            assert below >= 0.9, (sigma, below)
        else:
            k3 = torch.tensor([p[4] for p in points], dtype=torch.float64)
            se = float(k3.std()) / math.sqrt(len(points))
            assert abs(float(k3.mean()) - points[0][5]) <= Z * se, (sigma, float(k3.mean()))


EDGE = (0.0, 0.8)  # sigma = 0.8, mu = 0: tail shape 1 - 0.64 = 0.36, k3's variance finite
EDGE_BATCHES = 32


def edge_margin(seeds: range) -> float:
    """At ``EDGE``: how far the mean k-hat of Chimera's batches at ``seeds`` sits below 0.7, in
    its standard errors (from the batches' spread)."""
    k_hats = torch.tensor([sweep_point(*EDGE, seed)[0] for seed in seeds], dtype=torch.float64)
    se = float(k_hats.std()) / math.sqrt(k_hats.numel())
    return (PARETO_K_THRESHOLD - float(k_hats.mean())) / se


def test_at_sigma_0_8_k_hat_sits_below_the_threshold(fresh_warnings):
    """Claim: at sigma = 0.8 (mu = 0; the ratio's tail shape is 0.36) Chimera's k-hat over 32
    batches of 16384 averages below 0.7. Threshold: one-sided Student t at RATE with 31 degrees
    of freedom (4.4 standard errors). Margin: one batch's k-hat is about 0.53 +- 0.07 (biased up
    from 0.36 at this n), so the mean sits about 13 standard errors below 0.7 (calibration
    below). One batch alone is not held to RATE: about 1% of single batches exceed 0.7 here."""
    seeds = range(300, 300 + EDGE_BATCHES)
    margin = edge_margin(seeds)
    assert margin >= t_for(RATE, 1, dof=EDGE_BATCHES - 1, two_sided=False), margin


@pytest.mark.calibration
def test_calibration_the_sigma_0_8_margin():
    """The test above over 40 disjoint sets of 32 seeds: none fails."""
    margins = [
        -edge_margin(range(2000 + EDGE_BATCHES * i, 2000 + EDGE_BATCHES * (i + 1)))
        for i in range(40)
    ]
    t_needed = t_for(RATE, 1, dof=EDGE_BATCHES - 1, two_sided=False)
    assert_failures_consistent(margins, -t_needed, RATE, "k-hat at sigma 0.8")


# -- which values carry a ratio -------------------------------------------------------------


def _expected_k(sets: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([pareto_k(s) for s in sets]).amax()


CASES = [  # (estimator, direction, off-policy, level): carries a ratio?
    ("k1", "pi||ref", False, "token", False),
    ("k2", "pi||ref", False, "token", False),
    ("abs", "pi||ref", False, "token", False),
    ("k3", "pi||ref", False, "token", True),
    ("cv", "pi||ref", False, "token", True),
    ("k1", "ref||pi", False, "token", True),
    ("k3", "ref||pi", False, "sequence", True),
    ("k2", "ref||pi", False, "token", False),
    ("k1", "pi||ref", True, "token", True),
    ("k3", "pi||ref", True, "sequence", True),
    ("rb", "pi||ref", False, "token", False),
    ("rb", "ref||pi", False, "token", True),
    ("rb", "pi||ref", True, "token", True),
]


@pytest.mark.parametrize(("estimator", "direction", "off_policy", "level", "carries"), CASES)
def test_the_ratios_each_value_carries(
    estimator, direction, off_policy, level, carries, fresh_warnings
):
    """``diagnostics.pareto_k``: None where the value is a function of the log-ratio only, else
    k-hat of the ratios it averages over the valid rows (tokens, or sequences at the sequence
    level): r = ref/pi on-policy; off-policy the weights w and, for values of r, w r (the larger
    k-hat); rb: the prefix weights times the prefix ratios of KL(ref||pi). Computed here from
    the log-probs directly; the same k-hat up to the rounding of two orders of the same sums."""
    g = make_generator(7)
    shape = (64, 6)
    logp = -2 * torch.rand(shape, generator=g, dtype=torch.float64)
    logp_ref = -2 * torch.rand(shape, generator=g, dtype=torch.float64)
    logp_b = -2 * torch.rand(shape, generator=g, dtype=torch.float64) if off_policy else None
    mask = torch.rand(shape, generator=g) > 0.2
    kls = torch.rand(shape, generator=g, dtype=torch.float64) if estimator == "rb" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some of these tails are heavy
        _, details = klest.kl_estimate(
            logp,
            logp_ref,
            estimator=estimator,
            direction=direction,
            level=level,
            mask=mask,
            logp_behavior=logp_b,
            alpha=0.5 if estimator == "cv" else None,
            position_kls=kls,
            reduction="seq-mean-token-sum",
            return_details=True,
        )
    k = details.diagnostics.pareto_k
    if not carries:
        assert k is None
        return
    zero = torch.zeros((), dtype=torch.float64)
    log_r = torch.where(mask, logp_ref - logp, zero)
    log_w = None if logp_b is None else torch.where(mask, logp - logp_b, zero)
    valid = mask
    if estimator == "rb":
        log = torch.zeros_like(log_r) if log_w is None else log_w
        log = log + (log_r if direction == "ref||pi" else 0)
        before = log.cumsum(-1) - log  # over the earlier tokens (all finite here)
        sets = [before[valid]]
    else:
        if level == "sequence":
            log_r, valid = log_r.sum(-1), mask.any(-1)
            log_w = None if log_w is None else log_w.sum(-1)
        on_r = estimator in ("k3", "cv") or direction == "ref||pi"
        if log_w is None:
            sets = [log_r[valid]]
        else:
            sets = [log_w[valid], (log_w + log_r)[valid]] if on_r else [log_w[valid]]
    want = _expected_k(sets)
    assert_close_to_rounding(torch.tensor(k), want, ulps=16 * 3 * math.sqrt(384), scale=1.0)


@pytest.mark.filterwarnings("ignore:kl_penalty")
def test_kl_penalty_and_f_divergence_report_it_too(fresh_warnings):
    """kl_penalty's value and f_divergence (a function of r) report the k-hat of r; k1's value
    of kl_penalty carries none."""
    log_r = quantile_log_ratios(1000, 1.0)
    logp = torch.zeros(1000, requires_grad=True)
    want = float(pareto_k(log_r))
    _, pen = klest.kl_penalty(logp, log_r.float(), density=True, return_details=True)
    _, f = klest.f_divergence(
        torch.zeros(1000),
        log_r.float(),
        f=lambda r: (r - 1) ** 2,
        density=True,
        return_details=True,
    )
    _, k1 = klest.kl_penalty(logp, log_r.float(), estimator="k1", density=True, return_details=True)
    assert pen.diagnostics.pareto_k == pytest.approx(want, rel=1e-6)
    assert f.diagnostics.pareto_k == pytest.approx(want, rel=1e-6)
    assert k1.diagnostics.pareto_k is None
    assert want > 0.9  # the quantiles of a tail of shape 1


# -- the warning --------------------------------------------------------------------------------


def test_the_warning_names_the_safer_value_and_is_given_once(fresh_warnings):
    """Above 0.7: one UserWarning per process, at the caller's line, naming k-hat, the sample
    size and the safer choice for the case (k1's value or the closed form on-policy, a smaller
    step off-policy)."""
    log_r = quantile_log_ratios(2000, 1.0).float()
    zeros = torch.zeros(2000)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        klest.k3(zeros, log_r, density=True)
        klest.k3(zeros, log_r, density=True)
    (text,) = _tail_warnings(record)
    assert record[0].filename == __file__
    assert "kl_estimate(estimator='k3')" in text and "over 2000 samples" in text
    assert "estimator='k1'" in text and "torch.distributions.kl_divergence" in text
    assert f"{PARETO_K_THRESHOLD}" in text and "once per process" in text

    klest._checks._WARNED_ONCE.discard(TAIL_WARNING)
    log_w = quantile_log_ratios(2000, 1.0).float()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        klest.k1(-torch.ones(2000), -torch.ones(2000), logp_behavior=-1 - log_w, density=True)
    (text,) = _tail_warnings(record)
    assert "importance weights" in text and "smaller step off-policy" in text


@pytest.mark.parametrize("shape", [0.65, 0.75])
def test_it_warns_exactly_above_the_threshold(shape, fresh_warnings):
    """Quantiles of generalized Pareto ratios of shape 0.65 and 0.75 (k-hat 0.64 and 0.73, no
    sampling noise): the warning is given exactly when the reported k-hat exceeds 0.7."""
    log_r = quantile_log_ratios(4000, shape)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, details = klest.k3(torch.zeros_like(log_r), log_r, density=True, return_details=True)
    k_hat = details.diagnostics.pareto_k
    assert abs(k_hat - PARETO_K_THRESHOLD) > 0.02  # clear of the threshold either way
    assert bool(_tail_warnings(record)) == (k_hat > PARETO_K_THRESHOLD) == (shape > 0.7)


def test_light_tails_and_small_batches_do_not_warn(fresh_warnings):
    """k-hat below 0.7 (exponential quantiles: k = 0), or fewer than MIN_SAMPLES valid ratios
    (k-hat NaN, however heavy the tail): no warning."""
    heavy = quantile_log_ratios(MIN_SAMPLES - 1, 2.0)
    light = quantile_log_ratios(4000, 0.0)
    mask = torch.ones(200, dtype=torch.bool)
    mask[MIN_SAMPLES - 1 :] = False
    padded = torch.cat([heavy, torch.zeros(200 - heavy.numel(), dtype=torch.float64)])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, small = klest.k3(torch.zeros_like(heavy), heavy, density=True, return_details=True)
        _, masked = klest.k3(
            torch.zeros(200, dtype=torch.float64),
            padded,
            mask=mask,
            density=True,
            return_details=True,
        )
        _, fine = klest.k3(torch.zeros_like(light), light, density=True, return_details=True)
    assert not _tail_warnings(record)
    assert math.isnan(small.diagnostics.pareto_k) and math.isnan(masked.diagnostics.pareto_k)
    assert fine.diagnostics.pareto_k < PARETO_K_THRESHOLD


# -- its cost -----------------------------------------------------------------------------------


def _calls(log_r: torch.Tensor):
    """Every call that carries a ratio, on log-ratios ``log_r`` (``[N]``)."""
    zeros = torch.zeros_like(log_r)
    logp = zeros.clone().requires_grad_()
    return {
        "k3": lambda **o: klest.k3(zeros, log_r, density=True, **o),
        "cv": lambda **o: klest.cv(zeros, log_r, alpha="loo", density=True, **o),
        "kl_penalty": lambda **o: klest.kl_penalty(logp, log_r, density=True, **o),
        "off-policy k1": lambda **o: klest.k1(
            zeros - 1, zeros - 1, logp_behavior=-1 - log_r, density=True, **o
        ),
        "f_divergence": lambda **o: klest.f_divergence(
            zeros, log_r, f=lambda r: -torch.log(r), f_prime_at_1=-1.0, density=True, **o
        ),
    }


@pytest.mark.parametrize("name", list(_calls(torch.zeros(1))))
def test_the_check_rides_on_the_one_read_even_when_it_warns(name, monkeypatch, fresh_warnings):
    """With validation on, a call whose ratios warn makes one host read (the value checks'),
    the warning's text included."""
    call = _calls(quantile_log_ratios(1000, 1.5).float())[name]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with monkeypatch.context() as counting, counted_host_reads(counting) as reads:
            call()
    assert _tail_warnings(record)
    assert len(reads) == 1, reads


@pytest.mark.parametrize("name", list(_calls(torch.zeros(1))))
def test_nothing_is_computed_unless_a_warning_or_the_details_need_it(name, monkeypatch):
    """k-hat is computed only for a warning still to give (validation on) or for the details:
    not with ``validate=False``, and not once the warning was given; with ``validate=False``
    and details it is computed, and nothing warns."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return pareto_k(*args, **kwargs)

    monkeypatch.setattr(klest.sampled.tails, "pareto_k", counting)
    monkeypatch.setattr(klest._checks, "_WARNED_ONCE", set())
    call = _calls(quantile_log_ratios(1000, 1.5).float())[name]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call(validate=False)
        assert not calls
        _, details = call(validate=False, return_details=True)
        assert calls and details.diagnostics.pareto_k > PARETO_K_THRESHOLD
        assert not _tail_warnings(record)
        klest._checks._WARNED_ONCE.add(TAIL_WARNING)
        calls.clear()
        call()
        assert not calls
