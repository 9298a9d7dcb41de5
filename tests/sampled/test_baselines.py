"""Baselines and fitted coefficients: group leave-one-out and mean baselines and BaselineEMA
against brute-force recomputation; ``grad="adaptive"`` and ``baseline="loo-fitted"``:
coefficients fitted on other rows.

Deterministic tests compare with slow loop references written here; statistical tests compare
Monte Carlo means with exact gradients (Gaussian closed forms, tabular enumeration) within the
Bonferroni thresholds of ``tests/_stats.py`` at the stated false-fail rate ``RATE``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from klest import kl_penalty
from klest.audit import GradSpec, gradient_draws, mean_shift_z
from klest.sampled.baselines import (
    BaselineEMA,
    baseline_scale,
    group_baseline,
    mix_coefficient,
    mix_multipliers,
)
from klest.sampled.groups import group_keys
from klest.sampled.penalty import KLGradientWarning
from klest.testbeds import GaussianTestbed, TabularAutoregressive, make_generator
from tests._reference import estimator_formula, left_padded
from tests._stats import RATE, z_for

DIRECTIONS = ("pi||ref", "ref||pi")


# -- references ----------------------------------------------------------------------------


def mix_reference(delta: torch.Tensor, valid: torch.Tensor, direction: str) -> torch.Tensor:
    """c_i from the other rows by explicit loops: -sum(ab)/sum(b^2) with (a, b) the derivatives
    of k1 and k3 - k1 by autograd; for KL(pi||ref) at most exp(-sample variance of delta)."""
    rows = delta.shape[0]
    pairs = []
    for i in range(rows):
        row = []
        for t in range(delta.shape[1]):
            if valid[i, t]:
                d = delta[i, t].detach().double().clone().requires_grad_(True)
                k1 = estimator_formula(d, "k1", direction)
                k3 = estimator_formula(d, "k3", direction)
                (a,) = torch.autograd.grad(k1, d, retain_graph=True)
                (b,) = torch.autograd.grad(k3 - k1, d)
                row.append((float(a), float(b), float(delta[i, t])))
        pairs.append(row)
    out = []
    for i in range(rows):
        others = [p for j in range(rows) if j != i for p in pairs[j]]
        sab = sum(a * b for a, b, _ in others)
        sbb = sum(b * b for _, b, _ in others)
        c = -sab / sbb if sbb > 0 else 0.0
        if direction == "pi||ref" and len(others) >= 2:
            ds = [d for _, _, d in others]
            mean = sum(ds) / len(ds)
            var = sum((d - mean) ** 2 for d in ds) / (len(ds) - 1)
            c = min(c, math.exp(-var))
        out.append(c)
    return torch.tensor(out, dtype=torch.float64).unsqueeze(-1)


def scale_reference(targets: torch.Tensor, valid: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """lambda_i by loops: folds alternate within each group (in row order) over its non-empty
    rows (empty rows alternate apart); the other fold's sum of A_j B'_j over sum of B'_j^2
    (B'_j: the mean of j's fold-mates in its group at the same position, counted from each
    row's first valid token), clipped to [0, 1]."""
    rows = targets.shape[0]
    seen: dict[tuple[int, bool], int] = {}
    fold = []
    for k, empty in zip(keys, (~valid.any(-1)).tolist(), strict=True):
        fold.append(seen.get((k, empty), 0) % 2)
        seen[k, empty] = seen.get((k, empty), 0) + 1
    aligned = [
        [float(targets[i, t]) for t in range(targets.shape[1]) if valid[i, t]] for i in range(rows)
    ]
    p = [0.0, 0.0]
    q = [0.0, 0.0]
    for j in range(rows):
        for t, a in enumerate(aligned[j]):
            mates = [
                aligned[k][t]
                for k in range(rows)
                if k != j and keys[k] == keys[j] and fold[k] == fold[j] and t < len(aligned[k])
            ]
            if mates:
                b = sum(mates) / len(mates)
                p[fold[j]] += a * b
                q[fold[j]] += b * b
    out = []
    for i in range(rows):
        o = 1 - fold[i]
        lam = p[o] / q[o] if q[o] > 0 else 0.0
        out.append(min(max(lam, 0.0), 1.0))
    return torch.tensor(out, dtype=torch.float64).unsqueeze(-1)


def _masked_batch(rows=7, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    delta = 0.4 * torch.randn(rows, t, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 0, 4, 1, 5, 2])[:rows]
    valid = torch.arange(t) < lengths.unsqueeze(-1)
    return delta, valid


# -- the fitted coefficients against the loop references ------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mix_multipliers_are_the_derivatives_of_k1_and_k3_minus_k1(direction):
    delta = torch.linspace(-3, 3, 13, dtype=torch.float64).requires_grad_(True)
    k1 = estimator_formula(delta, "k1", direction)
    k3 = estimator_formula(delta, "k3", direction)
    (a_ref,) = torch.autograd.grad(k1.sum(), delta, retain_graph=True)
    (b_ref,) = torch.autograd.grad((k3 - k1).sum(), delta)
    a, b = mix_multipliers(delta.detach(), direction)
    torch.testing.assert_close(a, a_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b, b_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_mix_coefficient_matches_the_loop_reference(direction):
    delta, valid = _masked_batch()
    got = mix_coefficient(delta, valid, direction)
    torch.testing.assert_close(got, mix_reference(delta, valid, direction), rtol=1e-10, atol=0)


def test_mix_coefficient_does_not_depend_on_its_own_row():
    """Unbiasedness rests on c_i being independent of row i: change row i, c_i stays."""
    delta, valid = _masked_batch()
    c = mix_coefficient(delta, valid, "pi||ref")
    for i in range(delta.shape[0]):
        moved = delta.clone()
        moved[i] = moved[i] * 3 - 1
        again = mix_coefficient(moved, valid, "pi||ref")
        assert again[i] == pytest.approx(float(c[i]), rel=1e-12)
        assert not torch.equal(again, c) or not bool(valid[i].any())


def test_mix_coefficient_of_a_lone_row_is_zero_and_left_padding_agrees():
    delta, valid = _masked_batch()
    assert float(mix_coefficient(delta[:1], valid[:1], "pi||ref")) == 0.0
    torch.testing.assert_close(
        mix_coefficient(left_padded(delta, valid), left_padded(valid, valid), "pi||ref"),
        mix_coefficient(delta, valid, "pi||ref"),
        rtol=1e-12,
        atol=0,
    )


def test_baseline_scale_matches_the_loop_reference():
    g = torch.Generator().manual_seed(1)
    targets = 0.7 + torch.randn(10, 4, generator=g, dtype=torch.float64)
    lengths = torch.tensor([4, 2, 3, 0, 4, 1, 4, 3, 2, 4])
    valid = torch.arange(4) < lengths.unsqueeze(-1)
    keys = [0, 1, 0, 0, 1, 1, 0, 1, 0, 2]
    got = baseline_scale(targets, valid, torch.tensor(keys))
    torch.testing.assert_close(got, scale_reference(targets, valid, keys), rtol=1e-10, atol=0)


def test_baseline_scale_does_not_depend_on_its_own_fold():
    """lambda_i uses only the other fold: change any row of i's fold, lambda_i stays."""
    g = torch.Generator().manual_seed(2)
    targets = 0.5 + torch.randn(8, 3, generator=g, dtype=torch.float64)
    valid = torch.ones(8, 3, dtype=torch.bool)
    keys = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    lam = baseline_scale(targets, valid, keys)
    moved = targets.clone()
    moved[[0, 2, 4, 6]] = 5.0 * moved[[0, 2, 4, 6]] + 3.0  # fold 0 of both groups
    again = baseline_scale(moved, valid, keys)
    torch.testing.assert_close(again[[0, 2, 4, 6]], lam[[0, 2, 4, 6]], rtol=1e-12, atol=0)
    assert not torch.allclose(again[[1, 3, 5, 7]], lam[[1, 3, 5, 7]])


# -- through kl_penalty ----------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_adaptive_gradient_is_autograd_of_the_reference_surrogate(direction):
    """Value: k3's; gradient: autograd of sum_i sum_t k1 + c_i (k3 - k1) with the reference
    c_i held fixed (so no gradcheck: finite differences would move c)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    shift = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(4) < torch.tensor([4, 2, 3, 0, 4, 1]).unsqueeze(-1)
    logp = -0.5 * x * x * (1 + shift)
    logp_ref = -0.5 * (x - shift) ** 2
    loss = kl_penalty(
        logp,
        logp_ref,
        estimator="k3",
        grad="adaptive",
        direction=direction,
        mask=mask,
        reparameterized=True,
        reduction="sum",
    )
    delta = (logp - logp_ref).detach()
    c = mix_reference(delta, mask, direction)
    d = logp - logp_ref
    k1 = estimator_formula(d, "k1", direction)
    k3 = estimator_formula(d, "k3", direction)
    surrogate = torch.where(mask, k1 + c * (k3 - k1), 0.0).sum()
    value = torch.where(mask, estimator_formula(delta, "k3", direction), 0.0).sum()
    assert float(loss.detach()) == pytest.approx(float(value), rel=1e-12)
    got = torch.autograd.grad(loss, (x, shift), retain_graph=True)
    want = torch.autograd.grad(surrogate, (x, shift))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_adaptive_and_loo_fitted_refuse_what_they_cannot_do():
    logp = torch.randn(4, requires_grad=True).clamp(max=0)
    logp_ref = torch.randn(4).clamp(max=0)
    with pytest.raises(ValueError, match="grad='adaptive' is a pathwise gradient"):
        kl_penalty(logp, logp_ref, grad="adaptive")
    with pytest.raises(ValueError, match="needs samples from pi itself"):
        kl_penalty(
            logp,
            logp_ref + logp,
            grad="adaptive",
            reparameterized=True,
            logp_behavior=logp.detach(),
        )
    with pytest.raises(ValueError, match="baseline applies to grad in"):
        kl_penalty(
            logp, logp_ref + logp, grad="adaptive", reparameterized=True, baseline="loo-fitted"
        )
    with pytest.raises(ValueError, match="loo-fitted"):
        kl_penalty(logp, logp_ref, grad="cumulative", baseline="loo-fited")
    assert GradSpec.parse("k3/cumulative+loo-fitted").baseline == "loo-fitted"


def test_loo_fitted_cumulative_is_the_reference_coefficient_and_padding_agrees():
    """Gradient w.r.t. logp of cumulative + loo-fitted: the returns-to-go minus lambda times the
    leave-one-out mean of the other rows of the group at the same position (loops)."""
    g = torch.Generator().manual_seed(4)
    logp = (-torch.rand(8, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    logp_ref = -torch.rand(8, 4, generator=g, dtype=torch.float64)
    mask = torch.arange(4) < torch.tensor([4, 3, 4, 2, 4, 4, 1, 3]).unsqueeze(-1)
    keys = [0, 0, 0, 0, 1, 1, 1, 1]
    group = torch.tensor(keys)
    loss = kl_penalty(
        logp,
        logp_ref,
        mask=mask,
        grad="cumulative",
        baseline="loo-fitted",
        group=group,
        reduction="sum",
    )
    (got,) = torch.autograd.grad(loss, logp)
    delta = torch.where(mask, (logp - logp_ref).detach(), 0.0)
    togo = delta.flip(-1).cumsum(-1).flip(-1)
    lam = scale_reference(togo, mask, keys)
    want = torch.zeros_like(togo)
    for i in range(8):
        for t in range(int(mask[i].sum())):
            mates = [
                float(togo[k, t]) for k in range(8) if k != i and keys[k] == keys[i] and mask[k, t]
            ]
            b = sum(mates) / len(mates) if mates else 0.0
            want[i, t] = togo[i, t] - lam[i, 0] * b
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    left = left_padded(logp.detach(), mask).requires_grad_(True)
    mask_left = left_padded(mask, mask)
    loss_left = kl_penalty(
        left,
        left_padded(logp_ref, mask),
        mask=mask_left,
        grad="cumulative",
        baseline="loo-fitted",
        group=group,
        reduction="sum",
    )
    (got_left,) = torch.autograd.grad(loss_left, left)
    torch.testing.assert_close(got_left, left_padded(want, mask), rtol=1e-10, atol=1e-12)


# -- statistics against exact answers --------------------------------------------------------


def _draws(spec_or_fn, testbed, *, batch, trials, seed, direction="pi||ref"):
    fn = spec_or_fn
    if isinstance(spec_or_fn, str):
        fn = GradSpec.parse(spec_or_fn).build(direction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLGradientWarning)
        return gradient_draws(fn, testbed, batch_size=batch, n_trials=trials, seed=seed)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_adaptive_is_unbiased_on_a_gaussian(direction):
    """Each of the 8 coordinates (mean, log-std in D = 4) of the mean adaptive gradient within
    z standard errors of the closed-form gradient. z: Bonferroni at RATE over 8 two-sided
    comparisons (per direction)."""
    tb = GaussianTestbed(mean=[0.4, -0.3, 0.2, 0.5], log_std=0.15, mean_ref=0.0, log_std_ref=0.0)
    draws = _draws("k3/adaptive", tb, batch=8, trials=1000, seed=11, direction=direction)
    exact = torch.cat([g.reshape(-1) for g in tb.exact_kl_grad(direction)])
    se = draws.std(0) / math.sqrt(draws.shape[0])
    z = z_for(RATE, exact.numel())
    assert bool(((draws.mean(0) - exact).abs() <= z * se).all()), (draws.mean(0), exact, se)


def _variance_with_se(draws: torch.Tensor, coords: int) -> tuple[float, float]:
    """The mean over the first ``coords`` coordinates of the per-coordinate variance, and its
    standard error from the trials' own spread (coordinates may be dependent)."""
    g = draws[:, :coords]
    per_trial = ((g - g.mean(0)) ** 2).mean(1) * g.shape[0] / (g.shape[0] - 1)
    return float(per_trial.mean()), float(per_trial.std()) / math.sqrt(g.shape[0])


@pytest.mark.parametrize(("dim", "trials"), [(1, 1500), (1000, 300)])
def test_adaptive_variance_is_at_most_the_better_of_k1_and_k3(dim, trials):
    """Chimera setting (pi = N(0.05, I), ref = N(0, I), B = 32), gradient w.r.t. mu: the
    per-coordinate variance of the adaptive gradient is at most the smaller closed form of
    k1's (1/B) and k3's ((e^{m^2}(1 + mu^2) - 1)/B, m^2 = D mu^2) plus z standard errors of the
    Monte Carlo variance. z: one-sided Bonferroni at RATE over the 2 dimensions. At D = 1 k3 is
    the better one (the adaptive c is within 1e-3 of 1); at D = 1000 k1 (c ~ e^{-2.5}); the
    fitted c's own noise costs less than the margin to the other estimator's closed form."""
    mu, batch = 0.05, 32
    m2 = dim * mu * mu
    k1 = 1 / batch
    k3 = (math.exp(m2) * (1 + mu * mu) - 1) / batch
    tb = GaussianTestbed.chimera(dim, mu)
    draws = _draws("k3/adaptive", tb, batch=batch, trials=trials, seed=5 + dim)
    var, se = _variance_with_se(draws, dim)
    z = z_for(RATE, 2, two_sided=False)
    assert var <= min(k1, k3) + z * se, (var, se, k1, k3)


@pytest.mark.parametrize(
    ("scale", "spec"),
    [
        (0.5, "k3/cumulative+loo-fitted"),
        (1.5, "k3/cumulative+loo-fitted"),
        (1.5, "k3/score+loo-fitted"),
    ],
)
def test_loo_fitted_is_unbiased_on_a_tabular_policy(scale, spec):
    """The mean gradient against the enumerated exact gradient, by the normal deviate of
    :func:`klest.audit.mean_shift_z` (the squared distance over the trace of the covariance:
    rarely visited states, whose coordinates barely vary, do not break it). z: one-sided
    Bonferroni at RATE over the 3 cases."""
    tb = TabularAutoregressive.random(3, 4, scale=scale, seed=0)
    draws = _draws(spec, tb, batch=8, trials=1000, seed=21)
    exact = torch.cat([g.reshape(-1) for g in tb.exact_kl_grad("pi||ref")])
    assert mean_shift_z(draws, exact) <= z_for(RATE, 3, two_sided=False)


# The fitted scale's own noise: cumulative + loo-fitted on these two testbeds was measured at
# 1.00 (low KL) and 0.96 (high KL) times the better of plain and leave-one-out (3000 batches of
# 8); the scale is fitted on half a batch, so the test allows 5% above it.
FIT_NOISE = 0.05


@pytest.mark.parametrize("scale", [0.5, 1.5])
def test_loo_fitted_variance_is_at_most_plain_and_loo(scale):
    """Total gradient variance (trace) of cumulative + loo-fitted against plain cumulative and
    cumulative + loo on the same batches: the paired per-trial difference of squared deviations
    has mean at most FIT_NOISE times the other's variance plus z standard errors. z: one-sided
    Bonferroni at RATE over 4 comparisons (2 regimes x 2 rivals). At low KL (scale 0.5) the
    full baseline is worse than none, at high KL better: the fitted scale follows the better."""
    tb = TabularAutoregressive.random(3, 4, scale=scale, seed=0)
    trials = 1000
    fitted = _draws("k3/cumulative+loo-fitted", tb, batch=8, trials=trials, seed=31)
    z = z_for(RATE, 4, two_sided=False)
    for rival in ("k3/cumulative", "k3/cumulative+loo"):
        other = _draws(rival, tb, batch=8, trials=trials, seed=31)  # the same batches
        dev_f = ((fitted - fitted.mean(0)) ** 2).sum(1)
        dev_o = ((other - other.mean(0)) ** 2).sum(1)
        diff = dev_f - (1 + FIT_NOISE) * dev_o
        se = float(diff.std()) / math.sqrt(trials)
        assert float(diff.mean()) <= z * se, (rival, float(dev_f.mean()), float(dev_o.mean()))


# -- group baselines and moving averages ------------------------------------------------


def brute_group_baseline(targets, valid, group, kind):
    """For each valid position of each row: the mean, over the rows of the same group, of their
    value the same number of tokens after their first valid token (where valid there), leaving
    the row itself out for "loo"; 0 where there is no such row."""
    rows, t = targets.shape
    first = [next((j for j in range(t) if bool(valid[i, j])), 0) for i in range(rows)]
    out = torch.zeros_like(targets)
    for i in range(rows):
        for j in range(t):
            if not bool(valid[i, j]):
                continue
            offset = j - first[i]
            others = [
                float(targets[k, first[k] + offset])
                for k in range(rows)
                if group[k] == group[i]
                and first[k] + offset < t
                and bool(valid[k, first[k] + offset])
                and (kind == "mean" or k != i)
            ]
            out[i, j] = sum(others) / len(others) if others else 0.0
    return out


@pytest.mark.parametrize("kind", ["loo", "mean"])
def test_group_baseline_matches_brute_force_and_never_pools_groups(kind):
    g = make_generator(3)
    targets = torch.randn(7, 4, generator=g, dtype=torch.float64)
    valid = torch.rand(7, 4, generator=g) > 0.3
    group = torch.tensor([3, 3, 8, 3, 8, 1, 8])  # a group of one (id 1)
    valid[1, :2] = False  # a left-padded row: its positions count from its first token
    got = torch.where(valid, group_baseline(targets, valid, kind, group_keys(group)), 0.0)
    torch.testing.assert_close(got, brute_group_baseline(targets, valid, group, kind))
    # Ids are honoured, not their order or values: relabelling changes nothing.
    relabelled = group_baseline(
        targets, valid, kind, group_keys(torch.tensor([0, 0, 5, 0, 5, 9, 5]))
    )
    torch.testing.assert_close(torch.where(valid, relabelled, 0.0), got)


def brute_ema(batches, decay):
    """The baseline each batch gets: per position, the decayed mean of earlier batches' means
    over their valid rows, bias-corrected; positions never seen give 0."""
    t = max(b.shape[1] for b, _ in batches)
    sums, weights, out = [0.0] * t, [0.0] * t, []
    for targets, valid in batches:
        width = targets.shape[1]
        out.append(
            torch.tensor(
                [sums[j] / weights[j] if weights[j] > 0 else 0.0 for j in range(width)],
                dtype=torch.float64,
            )
        )
        for j in range(width):
            kept = [float(targets[i, j]) for i in range(targets.shape[0]) if bool(valid[i, j])]
            if kept:
                sums[j] = decay * sums[j] + (1 - decay) * sum(kept) / len(kept)
                weights[j] = decay * weights[j] + (1 - decay)
    return out


def test_baseline_ema_matches_brute_force_update_order_and_weights():
    g = make_generator(4)
    batches = []
    for width in (3, 5, 2, 5):  # sequences of growing and shrinking length
        targets = torch.randn(4, width, generator=g, dtype=torch.float64)
        valid = torch.rand(4, width, generator=g) > 0.4
        batches.append((targets, valid))
    ema = BaselineEMA(decay=0.7)
    want = brute_ema(batches, 0.7)
    for (targets, valid), expected in zip(batches, want, strict=True):
        got = ema(targets, valid)
        assert got.shape == targets.shape
        torch.testing.assert_close(got[0].double(), expected.double(), rtol=1e-12, atol=1e-15)
        assert torch.equal(got, got[:1].expand_as(got))  # one value per position


def test_baseline_ema_state_dict_round_trip_with_grown_buffers():
    g = make_generator(5)
    ema = BaselineEMA(decay=0.5)
    for width in (2, 6):
        ema(torch.randn(3, width, generator=g, dtype=torch.float64), torch.ones(3, width).bool())
    restored = BaselineEMA(decay=0.5)
    restored.load_state_dict(ema.state_dict())
    targets = torch.randn(3, 6, generator=g, dtype=torch.float64)
    valid = torch.ones(3, 6, dtype=torch.bool)
    torch.testing.assert_close(restored(targets, valid), ema(targets, valid))


def test_baselines_keep_the_targets_dtype():
    targets = torch.randn(4, 3, dtype=torch.float32)
    valid = torch.ones(4, 3, dtype=torch.bool)
    assert BaselineEMA()(targets, valid).dtype == torch.float32
    assert group_baseline(targets, valid, "loo", torch.zeros(4, dtype=torch.int64)).dtype == (
        torch.float32
    )


def test_ema_state_follows_its_inputs_to_another_device():
    """After a CPU batch, a batch on another device moves the state there (the "meta" device
    stands in for an accelerator: the same device logic, no data)."""
    ema = BaselineEMA()
    ema(torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.bool))
    t = torch.zeros(2, 4, dtype=torch.float64, device="meta")
    out = ema(t, torch.ones(2, 4, dtype=torch.bool, device="meta"))
    assert out.device.type == "meta"
    assert all(b.device.type == "meta" and b.dtype == torch.float64 for b in ema.buffers())
