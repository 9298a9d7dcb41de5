"""Testbeds against independent references: torch.distributions, slow recursion, sampling."""

from __future__ import annotations

import math

import pytest
import torch

from klest.audit import audit_value
from klest.testbeds import (
    CategoricalTestbed,
    GaussianMixtureTarget,
    GaussianTestbed,
    OffPolicyTestbed,
    SampledTestbed,
    TabularAutoregressive,
    make_generator,
)
from klest.testbeds.autoregressive import TokenLocalKL
from tests._stats import RATE, assert_failures_consistent, assert_mean_close, mean_z, z_for

DIRECTIONS = ("pi||ref", "ref||pi")


# -- Sampling ---------------------------------------------------------------------------------
# Each sampler is checked by several sample means (a coordinate's mean, a frequency, a moment)
# against its exact value, each within z_for(RATE, m) standard errors for the m comparisons of
# that sampler: one test's false-fail rate RATE (6.3e-5), Bonferroni. The functions below draw
# with a given generator seed and return {comparison: |z|}; the tests run them at one draw seed,
# and a calibration companion at 40 others.


def assert_sampling_zs(zs: dict[str, float]) -> None:
    z = z_for(RATE, len(zs))
    assert max(zs.values()) <= z, f"|z| above {z:.2f} ({len(zs)} comparisons): {zs}"


# -- Gaussian ---------------------------------------------------------------------------------
def gaussian():
    return GaussianTestbed(
        mean=[0.3, -0.2], log_std=[0.2, -0.1], mean_ref=[0.0, 0.4], log_std_ref=[-0.3, 0.1]
    )


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gaussian_kl_matches_torch_distributions(direction):
    tb = gaussian()
    pi = torch.distributions.Normal(tb.mean.detach(), tb.log_std.detach().exp())
    ref = torch.distributions.Normal(tb.mean_ref, tb.log_std_ref.exp())
    a, b = (pi, ref) if direction == "pi||ref" else (ref, pi)
    expected = torch.distributions.kl_divergence(a, b).sum()
    assert float(tb.exact_kl(direction).detach()) == pytest.approx(float(expected), rel=1e-12)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gaussian_analytic_gradient_equals_autodiff(direction):
    tb = gaussian()
    analytic = tb.exact_kl_grad(direction)
    autodiff = torch.autograd.grad(tb.exact_kl(direction), tb.parameters())
    for x, y in zip(analytic, autodiff, strict=True):
        assert torch.allclose(x, y, rtol=1e-12)


def gaussian_sampling(draw_seed: int):
    """Both coordinates' means, and KL(pi||ref) as the mean of the sampled log-ratio (3
    comparisons): the sample and the |z| of each."""
    tb = gaussian()
    s = tb.sample(100_000, generator=make_generator(draw_seed))
    zs = {f"mean[{d}]": mean_z(s.x[:, d], float(tb.mean[d].detach())) for d in range(2)}
    zs["KL"] = mean_z(s.logp - s.logp_ref, float(tb.exact_kl().detach()))
    return s, zs


def test_gaussian_samples_and_log_densities():
    """Log-densities against torch.distributions; the sampling comparisons at z_for(RATE, 3) =
    4.25."""
    tb = gaussian()
    s, zs = gaussian_sampling(0)
    assert s.reparameterized and s.x.requires_grad
    pi = torch.distributions.Normal(tb.mean.detach(), tb.log_std.detach().exp())
    assert torch.allclose(s.logp.detach(), pi.log_prob(s.x.detach()).sum(-1), rtol=1e-12)
    assert_sampling_zs(zs)


def test_gaussian_quadrature_expectation():
    tb = GaussianTestbed.schulman(0.8)
    m, s = tb.log_ratio_moments()
    assert m == pytest.approx(0.32) and s == pytest.approx(0.8)
    assert float(tb.expectation(lambda d: d)) == pytest.approx(0.32, rel=1e-12)
    assert float(tb.expectation(lambda d: d * d)) == pytest.approx(0.32**2 + 0.64, rel=1e-12)
    assert float(tb.expectation(torch.exp)) == pytest.approx(math.exp(0.32 + 0.32), rel=1e-10)
    with pytest.raises(NotImplementedError, match="equal standard deviations"):
        gaussian().expectation(lambda d: d)
    # Both means away from 0 and a standard deviation other than 1 (the settings above have
    # ref or pi centred at 0): delta is normal with mean sum (m - m_r)^2 / (2 s^2) and variance
    # twice that.
    mean, mean_ref, log_std = [0.5, -0.3], [0.2, 0.4], [0.1, -0.2]
    tb = GaussianTestbed(mean=mean, mean_ref=mean_ref, log_std=log_std, log_std_ref=log_std)
    sq = sum(
        (a - b) ** 2 / math.exp(2 * c) for a, b, c in zip(mean, mean_ref, log_std, strict=True)
    )
    m, s = tb.log_ratio_moments()
    assert m == pytest.approx(sq / 2, rel=1e-14) and s == pytest.approx(math.sqrt(sq), rel=1e-14)
    assert float(tb.expectation(lambda d: d)) == pytest.approx(sq / 2, rel=1e-12)


# -- Categorical ------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_categorical_analytic_gradient_equals_autodiff(direction):
    tb = CategoricalTestbed.random(7, seed=4, scale=1.5)
    (analytic,) = tb.exact_kl_grad(direction)
    (autodiff,) = torch.autograd.grad(tb.exact_kl(direction), tb.parameters())
    assert torch.allclose(analytic, autodiff, rtol=1e-10, atol=1e-14)


def categorical_sampling(draw_seed: int):
    """The frequency of each of the 5 categories (5 comparisons)."""
    tb = CategoricalTestbed.random(5, seed=1)
    s = tb.sample(200_000, generator=make_generator(draw_seed))
    probs = torch.softmax(tb.logits.detach(), -1)
    return s, {f"P({k})": mean_z((s.x == k).double(), float(probs[k])) for k in range(5)}


def test_categorical_sampling_frequencies():
    """At z_for(RATE, 5) = 4.37."""
    s, zs = categorical_sampling(2)
    assert s.logits.shape == (200_000, 5)
    assert_sampling_zs(zs)


# -- Tabular autoregressive ---------------------------------------------------------------------
def table_logprobs(tb: TabularAutoregressive, table: torch.Tensor, prefix: tuple[int, ...]):
    """Next-token log-probs after ``prefix``, by direct table lookup (no vectorization)."""
    t = len(prefix)
    if tb.markov:
        row = table[t, prefix[-1] if prefix else tb.vocab_size]
    else:
        code = 0
        for y in prefix:
            code = code * tb.vocab_size + y
        row = table[sum(tb.vocab_size**s for s in range(t)) + code]
    return torch.log_softmax(row.double(), -1)


def slow_kl(tb: TabularAutoregressive, a: torch.Tensor, b: torch.Tensor, prefix=()) -> float:
    """KL(a||b) over sequences by recursion over prefixes in Python floats."""
    if len(prefix) == tb.horizon:
        return 0.0
    la, lb = table_logprobs(tb, a, prefix), table_logprobs(tb, b, prefix)
    total = 0.0
    for v in range(tb.vocab_size):
        p = math.exp(float(la[v]))
        total += p * float(la[v] - lb[v])
        if v != tb.eos:
            total += p * slow_kl(tb, a, b, (*prefix, v))
    return total


CASES = [
    dict(vocab_size=3, horizon=3, eos=None, markov=False),
    dict(vocab_size=3, horizon=4, eos=1, markov=False),
    dict(vocab_size=2, horizon=5, eos=0, markov=True),
    dict(vocab_size=3, horizon=4, eos=None, markov=True),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_tabular_exact_kl_matches_slow_recursion(case, direction):
    tb = TabularAutoregressive.random(**case, seed=3, scale=1.2)
    a, b = (tb.logits, tb.logits_ref) if direction == "pi||ref" else (tb.logits_ref, tb.logits)
    expected = slow_kl(tb, a.detach(), b.detach())
    assert float(tb.exact_kl(direction).detach()) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("case", CASES)
def test_future_kl_is_the_expected_kl_from_each_prefix(case):
    """future_kl at position t of every sequence is the slow recursion's expected KL(pi||ref)
    from the prefix y_<t (0 after an eos); at t = 0 it is the sequence KL. Tolerance: both sum
    the same at most V^T products in another order, at the KL's scale: 1e-10 relative."""
    tb = TabularAutoregressive.random(**case, seed=3, scale=1.2)
    tokens, valid = tb.all_sequences()
    got = tb.future_kl(tokens)
    a, b = tb.logits.detach(), tb.logits_ref.detach()
    for row, seq in enumerate(tokens.tolist()):
        for t in range(tb.horizon):
            alive = valid is None or bool(valid[row, t])
            want = slow_kl(tb, a, b, tuple(seq[:t])) if alive else 0.0
            assert float(got[row, t]) == pytest.approx(want, rel=1e-10, abs=1e-12), (seq, t)
    assert float(got[0, 0]) == pytest.approx(float(tb.exact_kl().detach()), rel=1e-10)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_markov_dynamic_programming_equals_enumeration(direction):
    tb = TabularAutoregressive.random(3, 5, eos=2, markov=True, seed=6)
    dp = float(tb.exact_kl(direction).detach())
    tokens, valid = tb.all_sequences()
    a, b = (tb.logits, tb.logits_ref) if direction == "pi||ref" else (tb.logits_ref, tb.logits)
    idx = tokens.unsqueeze(-1)
    la = tb._next_logprobs(a.detach(), tokens).gather(-1, idx).squeeze(-1) * valid
    lb = tb._next_logprobs(b.detach(), tokens).gather(-1, idx).squeeze(-1) * valid
    enumerated = float((la.sum(-1).exp() * (la - lb).sum(-1)).sum())
    assert dp == pytest.approx(enumerated, rel=1e-12)
    assert float(la.sum(-1).exp().sum()) == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("case", CASES[1:3])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_tabular_exact_gradient_gradcheck(case, direction):
    tb = TabularAutoregressive.random(**case, seed=7)

    def kl_of(z):
        tb.logits = z
        return tb.exact_kl(direction)

    z = tb.logits.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(kl_of, (z,))


def tabular_sampling(draw_seed: int):
    """The frequency of each of the 4 sequences (V = 2, T = 3, eos = 1, padded with eos:
    [1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0]; 4 comparisons). ``draw``: the sampler without
    the log-probs (``sample`` is ``evaluate`` of it, tested below)."""
    tb = TabularAutoregressive.random(2, 3, eos=1, seed=8)
    x = tb.draw(100_000, generator=make_generator(draw_seed))
    tokens, valid = tb.all_sequences()
    idx = tokens.unsqueeze(-1)
    lp = tb._next_logprobs(tb.logits.detach(), tokens).gather(-1, idx).squeeze(-1) * valid
    probs = lp.sum(-1).exp()
    zs = {
        str(seq.tolist()): mean_z((x == seq).all(-1).double(), float(p))
        for seq, p in zip(tokens, probs, strict=True)
    }
    return x, zs


def test_tabular_sequence_frequencies_match_exact_probabilities():
    """At z_for(RATE, 4) = 4.32."""
    _, zs = tabular_sampling(9)
    assert len(zs) == 4
    assert_sampling_zs(zs)


def test_tabular_sample_fields():
    tb = TabularAutoregressive.random(4, 6, eos=3, seed=10)
    s = tb.sample(500, generator=make_generator(11))
    assert s.logits.shape == (500, 6, 4) and s.mask.shape == (500, 6)
    assert torch.allclose(s.logits.detach().logsumexp(-1), torch.zeros(500, 6, dtype=torch.float64))
    picked = s.logits.gather(-1, s.x.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(picked, s.logp)
    # Valid up to and including the first eos; nothing valid after it.
    first_eos = torch.where(s.x == 3, torch.arange(6), 6).min(-1).values
    assert torch.equal(s.mask, torch.arange(6) <= first_eos.unsqueeze(-1))
    for row in range(500):
        prefix = tuple(s.x[row, :2].tolist())
        if s.mask[row, 2]:
            expected = table_logprobs(tb, tb.logits.detach(), prefix)
            assert torch.allclose(s.logits[row, 2].detach(), expected)
            break
    s.logp[s.mask].sum().backward()
    assert tb.logits.grad is not None and torch.isfinite(tb.logits.grad).all()


def test_markov_long_horizon_is_cheap_and_matches_monte_carlo():
    tb = TabularAutoregressive.random(4, 60, eos=0, markov=True, seed=12, scale=0.5)
    exact = float(tb.exact_kl().detach())
    s = tb.sample(4000, generator=make_generator(13))
    per_seq = ((s.logp - s.logp_ref) * s.mask).sum(-1)
    assert_mean_close(per_seq, exact, what="markov T=60")


def test_tabular_constructor_errors():
    with pytest.raises(ValueError, match="a prefix table for V=3, T=3 has shape"):
        TabularAutoregressive(torch.zeros(5, 3), torch.zeros(5, 3), horizon=3)
    with pytest.raises(ValueError, match="eos must be a token id"):
        TabularAutoregressive(torch.zeros(13, 3), torch.zeros(13, 3), horizon=3, eos=3)
    with pytest.raises(ValueError, match="logits_ref has shape"):
        TabularAutoregressive(torch.zeros(13, 3), torch.zeros(12, 3), horizon=3)
    big = TabularAutoregressive.random(8, 8, markov=True)
    with pytest.raises(ValueError, match="too many to enumerate"):
        big.all_sequences()


def slow_token_local_kl(tb: TabularAutoregressive, direction: str, prefix=()) -> torch.Tensor:
    """sum over every live prefix of P_pi(prefix) (a constant) times the KL between the two
    next-token distributions there, by recursion; differentiable in pi's table."""
    if len(prefix) == tb.horizon:
        return torch.zeros((), dtype=torch.float64)
    lp, lr = table_logprobs(tb, tb.logits, prefix), table_logprobs(tb, tb.logits_ref, prefix)
    kl = (lp.exp() * (lp - lr)).sum() if direction == "pi||ref" else (lr.exp() * (lr - lp)).sum()
    rest = sum(
        math.exp(float(lp[v].detach())) * slow_token_local_kl(tb, direction, (*prefix, v))
        for v in range(tb.vocab_size)
        if v != tb.eos
    )
    return kl + rest


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_token_local_kl_matches_slow_prefix_recursion(case, direction):
    tb = TabularAutoregressive.random(**case, seed=21, scale=1.2)
    slow = slow_token_local_kl(tb, direction)
    fast = tb.token_local_kl(direction)
    assert float(fast.detach()) == pytest.approx(float(slow.detach()), rel=1e-10)
    (g_slow,) = torch.autograd.grad(slow, tb.logits)
    (g_fast,) = torch.autograd.grad(fast, tb.logits)
    torch.testing.assert_close(g_fast, g_slow, rtol=1e-9, atol=1e-12)
    if direction == "pi||ref":  # the same value as the sequence KL, another gradient
        assert float(fast.detach()) == pytest.approx(slow_kl(tb, tb.logits.detach(), tb.logits_ref))
        (g_seq,) = torch.autograd.grad(tb.exact_kl(direction), tb.logits)
        assert float((g_seq - g_fast).norm()) > 0.05 * float(g_seq.norm())


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_token_local_gradient_is_the_mean_of_per_token_losses(direction):
    """Monte Carlo mean of each token's score times its own term (pi||ref: log-ratio, the
    gradient of per-token k2; ref||pi: 1 - ref/pi, the gradient of per-token k3) against the
    exact token-local gradient, coordinate by coordinate: each of the 45 coordinates that vary
    (the rows of the 15 prefixes without eos) within z_for(RATE, 45) = 4.82 standard errors of
    400 batch means (Bonferroni, false-fail rate RATE); the others are exactly 0. The per-token
    loss is written here by hand, without klest's estimators.

    The table's scale, 0.5, keeps every (prefix, token) pair common (at least 86 expected
    visits in the 40000 sequences), so each coordinate's z is near normal; with a rare pair, a
    coordinate whose mean rests on a rare token with a large term fails whenever that token is
    not drawn (its standard error then misses it too)."""
    tb = TabularAutoregressive.random(3, 4, eos=2, seed=23, scale=0.5)
    (exact,) = torch.autograd.grad(tb.token_local_kl(direction), tb.logits)
    exact = exact.reshape(-1)
    gen = make_generator(24)
    batches = []
    for _ in range(400):
        s = tb.sample(100, generator=gen)
        delta = (s.logp - s.logp_ref).detach()
        coef = delta if direction == "pi||ref" else 1 - torch.exp(-delta)
        loss = (coef * s.logp * s.mask).sum() / 100
        batches.append(torch.autograd.grad(loss, tb.logits)[0].reshape(-1))
    draws = torch.stack(batches)
    mean, se = draws.mean(0), draws.std(0) / math.sqrt(draws.shape[0])
    varies = se > 0
    assert int(varies.sum()) == 45
    assert torch.equal(mean[~varies], exact[~varies])
    z = z_for(RATE, 45)
    bad = (mean - exact).abs() > z * se
    assert not bad.any(), f"{int(bad.sum())} coordinates off by more than {z:.2f} se"
    # ... and it is not the sequence-level gradient. Power: the exact gaps, 0.048 (pi||ref) and
    # 0.045 (ref||pi), are 24 and 17 times the norm of the standard errors (0.0020, 0.0026);
    # the Monte Carlo distance misses them by about that norm: far above the 6 asserted.
    (seq,) = torch.autograd.grad(tb.exact_kl(direction), tb.logits)
    assert float((mean - seq.reshape(-1)).norm()) > 6 * float(se.norm())


def test_token_local_view_shares_the_testbed():
    tb = TabularAutoregressive.random(3, 4, eos=2, seed=25)
    local = tb.token_local()
    assert isinstance(local, TokenLocalKL) and isinstance(local, SampledTestbed)
    assert local.parameters()[0] is tb.logits
    a = local.sample(50, generator=make_generator(26))
    b = tb.sample(50, generator=make_generator(26))
    assert torch.equal(a.x, b.x) and torch.equal(a.logp, b.logp)
    for direction in DIRECTIONS:
        assert torch.equal(local.exact_kl(direction), tb.token_local_kl(direction))
        (want,) = torch.autograd.grad(tb.token_local_kl(direction), tb.logits)
        torch.testing.assert_close(local.exact_kl_grad(direction)[0], want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="testbed must be a TabularAutoregressive"):
        TokenLocalKL(CategoricalTestbed.random(4, seed=27))


# -- The testbed protocol ---------------------------------------------------------------------
@pytest.mark.parametrize("markov", [False, True])
def test_tabular_log_probs_are_table_lookups(markov):
    tb = TabularAutoregressive.random(3, 4, eos=2, markov=markov, seed=14)
    tokens = tb.draw(50, generator=make_generator(15))
    for ref, table in ((False, tb.logits.detach()), (True, tb.logits_ref)):
        got = tb.log_probs(tokens, ref=ref).detach()
        assert got.shape == (50, 4)
        for row in range(50):
            for t in range(4):
                prefix = tuple(tokens[row, :t].tolist())
                expected = table_logprobs(tb, table, prefix)[tokens[row, t]]
                assert float(got[row, t]) == pytest.approx(float(expected), rel=1e-12)
    assert tb.log_probs(tokens).requires_grad and not tb.log_probs(tokens, ref=True).requires_grad


@pytest.mark.parametrize(
    "tb",
    [CategoricalTestbed.random(5, seed=16), TabularAutoregressive.random(3, 4, eos=2, seed=16)],
    ids=["categorical", "tabular"],
)
def test_sampled_testbed_sample_is_evaluate_of_draw(tb):
    assert isinstance(tb, SampledTestbed)
    s = tb.sample(200, generator=make_generator(17))
    x = tb.draw(200, generator=make_generator(17))
    e = tb.evaluate(x)
    assert torch.equal(s.x, x)
    assert torch.equal(s.logp, e.logp) and torch.equal(s.logp_ref, e.logp_ref)


def test_off_policy_needs_sampled_testbeds():
    with pytest.raises(TypeError, match="GaussianTestbed cannot draw and evaluate samples"):
        OffPolicyTestbed(gaussian(), gaussian())


def test_sequence_expectation_of_points_is_their_expectation():
    def fn(delta):
        return delta**2

    for tb in (GaussianTestbed.schulman(0.7), CategoricalTestbed.random(5, seed=18)):
        assert float(tb.sequence_expectation(fn)) == float(tb.expectation(fn))


def test_a_testbed_without_sequence_expectation_says_so():
    target = TabularAutoregressive.random(3, 3, eos=2, seed=19)
    off_policy = OffPolicyTestbed(target, TabularAutoregressive.random(3, 3, eos=2, seed=20))
    with pytest.raises(NotImplementedError, match="OffPolicyTestbed cannot compute exact sequence"):
        off_policy.sequence_expectation(lambda delta: delta)
    # The audit then reports no exact mean for sequence-level estimators.
    audit = audit_value("k1", off_policy, level="sequence", batch_size=4, n_trials=10)
    assert audit.expected is None


# -- Gaussian mixture target ------------------------------------------------------------------
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mixture_of_coinciding_components_has_the_gaussian_kls(direction):
    """A mixture of equal components is one Gaussian: the quadrature KLs against pi = N(0.3,
    0.8^2) equal the closed form (the trapezoid rule is spectrally accurate on this smooth,
    fast-decaying integrand; measured error <= 1.2e-16 absolute)."""
    target = GaussianMixtureTarget(means=(0.5, 0.5), std=1.1)
    gaussian_pair = GaussianTestbed(
        mean=0.3, log_std=math.log(0.8), mean_ref=0.5, log_std_ref=math.log(1.1)
    )
    expected = float(gaussian_pair.exact_kl(direction).detach())
    assert target.exact_kls(0.3, 0.8)[direction] == pytest.approx(expected, rel=1e-10)


def test_mixture_log_density_is_the_mixture_of_normals():
    target = GaussianMixtureTarget(means=(-2.0, 1.0, 3.0), std=0.6)
    x = torch.linspace(-5.0, 6.0, 101, dtype=torch.float64)
    f64 = torch.float64
    normals = [
        torch.distributions.Normal(torch.tensor(m, dtype=f64), torch.tensor(0.6, dtype=f64))
        for m in (-2.0, 1.0, 3.0)
    ]
    expected = torch.stack([n.log_prob(x).exp() for n in normals]).mean(0).log()
    assert torch.allclose(target.log_density(x), expected, rtol=1e-12, atol=0)
    grid = target.grid
    assert float(torch.trapezoid(target.log_density(grid).exp(), grid)) == pytest.approx(1.0)


def mixture_sampling(draw_seed: int):
    """The mean and the variance of the draws against the moment-matching Gaussian's (2
    comparisons)."""
    mean, std = GaussianMixtureTarget().moment_matching
    x = GaussianMixtureTarget().sample(100_000, generator=make_generator(draw_seed))
    return x, {"mean": mean_z(x, mean), "variance": mean_z((x - mean) ** 2, std**2)}


def test_mixture_samples_have_the_moment_matching_moments():
    """At z_for(RATE, 2) = 4.16."""
    mean, std = GaussianMixtureTarget().moment_matching
    assert (mean, std) == (0.0, pytest.approx(math.sqrt(0.36 + 4.0)))
    x, zs = mixture_sampling(21)
    assert x.dtype == torch.float64 and x.shape == (100_000,)
    assert_sampling_zs(zs)


SAMPLINGS = {
    "gaussian": gaussian_sampling,
    "categorical": categorical_sampling,
    "tabular": tabular_sampling,
    "mixture": mixture_sampling,
}


@pytest.mark.calibration
@pytest.mark.parametrize("sampler", SAMPLINGS)
def test_sampling_checks_hold_their_rate_over_draw_seeds(sampler):
    """Each sampling test's computation at 40 other draw seeds: no failure expected (40 x RATE =
    2.5e-3)."""
    zs = [SAMPLINGS[sampler](seed)[1] for seed in range(100, 140)]
    threshold = z_for(RATE, len(zs[0]))
    assert_failures_consistent([max(z.values()) for z in zs], threshold, RATE, sampler)


def test_moment_matching_minimizes_kl_ref_pi():
    target = GaussianMixtureTarget()
    mean, std = target.moment_matching
    best = target.exact_kls(mean, std)["ref||pi"]
    for dm, ds in ((0.1, 0.0), (-0.1, 0.0), (0.0, 0.1), (0.0, -0.1)):
        assert target.exact_kls(mean + dm, std + ds)["ref||pi"] > best


def test_mixture_constructor_errors():
    with pytest.raises(ValueError, match="means must be one or more finite numbers"):
        GaussianMixtureTarget(means=())
    with pytest.raises(ValueError, match="std must be finite and > 0"):
        GaussianMixtureTarget(std=0.0)
