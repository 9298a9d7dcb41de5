"""kl_penalty: every gradient estimator's mean against the exact gradients of both KLs.

Statistical rule (``tests/_stats.py``): z statistics of the squared distance between the mean
gradient and a target (N(0, 1) under the null, tail included: ``klest.audit.mean_shift_z``)
compared with Z = 4 (one null comparison per test, one-sided: false-fail rate 3e-5), or with
``z_for(RATE, 1, two_sided=False)`` = 3.83 (rate 6.3e-5); where a test asserts that a target is
*rejected* (z > threshold), the expected z is far above it (each test says by how much where
it is not obvious); seeds are fixed. Deterministic facts (decouple, masks, values) are checked
exactly, values against the formulas of ``tests/_reference.py``.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch

import klest
from klest.audit import GradSpec, audit_grad, gradient_draws, mean_shift_z
from klest.sampled.penalty import KLGradientWarning
from klest.testbeds import (
    TabularAutoregressive,
    make_generator,
)
from tests._reference import (
    assert_verbose_close,
    exact_token_level_gradient,
    left_padded,
    reduce_reference,
    values_reference,
)
from tests._stats import RATE, Z, assert_failures_consistent, z_for
from tests._testbeds import make
from tests._tolerance import assert_close_to_rounding, rounding_tolerance

BOTH = ("pi||ref", "ref||pi")


UNBIASED = [
    ("gaussian", "k1/pathwise", BOTH),
    ("gaussian", "k3/pathwise", BOTH),  # Chimera: k3's value, k1's pathwise gradient
    ("gaussian", "k1/stl", ("pi||ref",)),
    ("gaussian", "k3/autodiff", BOTH),  # pathwise gradient of an unbiased value
    ("gaussian-sf", "k3/score", BOTH),
    ("gaussian-sf", "k3/score+loo", BOTH),
    ("gaussian-sf", "k3/token", BOTH),  # one step: token-level is exact
    ("gaussian-sf", "k3/cumulative", BOTH),  # T = 1: cumulative is the score estimator
    ("gaussian-sf", "k3/cumulative+loo", BOTH),
    ("categorical", "k3/score", BOTH),
    ("categorical", "k3/score+ema", BOTH),
    ("categorical", "k3/cumulative", BOTH),
    ("categorical", "rb/rb", BOTH),
    ("categorical", "k1/rb+loo", ("pi||ref",)),
    ("tabular", "k3/score", BOTH),
    ("tabular", "k3/score+loo", BOTH),
    ("tabular", "k3/cumulative", BOTH),
    ("tabular", "k3/cumulative+loo", BOTH),
    ("tabular", "k3/score+ema", BOTH),
    ("tabular", "k3/cumulative+ema", BOTH),
    ("tabular", "rb/rb", BOTH),
    ("tabular", "rb/rb+loo", ("pi||ref",)),
    ("markov", "k3/cumulative", BOTH),
    ("markov", "rb/rb", BOTH),
    ("off-policy", "k3/score", BOTH),
    ("off-policy", "k3/score+loo", BOTH),
    ("off-policy", "k3/cumulative+loo", BOTH),
    ("off-policy", "rb/rb+loo", ("pi||ref",)),
    ("off-policy", "rb/rb", ("ref||pi",)),
]


# Cases whose gradient draws have infinite fourth moments (on "gaussian" E_pi[r^k] is finite only
# for k < 3.86) and a weak signal: the trace estimate behind z is erratic, so z_zero is not
# reliably large (at 600 trials its mean - 4 sd is below 2, and more trials do not fix that).
# They keep the null check (there conservative: z_target stays well below 3.83) and have a twin
# on "gaussian-wide" (r bounded) that checks both.
WEAK_SIGNAL = {
    ("gaussian", "k1/pathwise", "ref||pi"),
    ("gaussian", "k3/pathwise", "ref||pi"),
    ("gaussian", "k3/autodiff", "pi||ref"),
    ("gaussian", "k3/autodiff", "ref||pi"),
    *(
        ("gaussian-sf", spec, "ref||pi")
        for spec in ("k3/score", "k3/score+loo", "k3/token", "k3/cumulative", "k3/cumulative+loo")
    ),
}
GRADIENT_CASES = [(n, s, d) for n, s, ds in UNBIASED for d in ds] + [
    (n.replace("gaussian", "gaussian-wide"), s, d) for n, s, d in sorted(WEAK_SIGNAL)
]
# One null comparison per case, one-sided (mean_shift_z is large when the mean is off): 3.83.
Z_ONE_SIDED = z_for(RATE, 1, two_sided=False)


def _unbiased_gradient_checks(name: str, spec: str, direction: str, seed: int) -> dict:
    """z_target / threshold (fails above 1) and, unless the case is in ``WEAK_SIGNAL``,
    threshold / z_zero (fails above 1)."""
    audit = audit_grad(spec, make(name), direction=direction, batch_size=8, n_trials=600, seed=seed)
    out = {"z_target": audit.z_target / Z_ONE_SIDED}
    if (name, spec, direction) not in WEAK_SIGNAL:
        out["z_zero"] = Z_ONE_SIDED / audit.z_zero
    return out


@pytest.mark.parametrize(("name", "spec", "direction"), GRADIENT_CASES)
def test_gradient_is_unbiased_for_the_claimed_kl(name, spec, direction):
    """z_target <= 3.83: one one-sided comparison at ``RATE`` (6.3e-5). And it carries signal,
    z_zero > 3.83, outside ``WEAK_SIGNAL``: each such case has mean(z_zero) - 4 sd(z_zero)
    >= 6.6 (rb's exact categorical gradients: inf)."""
    checks = _unbiased_gradient_checks(name, spec, direction, seed=7)
    assert all(v <= 1 for v in checks.values()), checks


@pytest.mark.calibration
def test_gradient_checks_of_the_weak_signal_twins_hold_over_seeds():
    """The cases the fix concerns, on "gaussian-wide" (k1/pathwise, the Chimera k3/pathwise
    shares its draws), at 15 seeds each: no failure expected (45 x 6.3e-5 = 2.8e-3)."""
    cases = [
        ("gaussian-wide", "k1/pathwise", "ref||pi"),
        ("gaussian-wide", "k3/autodiff", "ref||pi"),
        ("gaussian-wide-sf", "k3/score", "ref||pi"),
    ]
    stats: dict[str, list[float]] = {}
    for name, spec, direction in cases:
        for seed in range(15):
            for key, value in _unbiased_gradient_checks(name, spec, direction, seed).items():
                stats.setdefault(f"{name} {spec} {direction} {key}", []).append(value)
    for key, values in stats.items():
        assert_failures_consistent(values, 1.0, RATE, key)


@pytest.mark.parametrize("name", ["categorical", "tabular", "gaussian-sf"])
def test_autodiff_of_k1_has_mean_zero(name):
    audit = audit_grad("k1/autodiff", make(name), batch_size=8, n_trials=600, seed=1)
    assert audit.z_zero <= Z and audit.z_target > Z, audit


@pytest.mark.parametrize("name", ["categorical", "gaussian-sf"])
def test_autodiff_of_k3_descends_the_other_kl(name):
    audit = audit_grad("k3/autodiff", make(name), batch_size=8, n_trials=600, seed=2)
    assert audit.z_other <= Z and audit.z_target > Z, audit
    assert audit.verdict == "descends KL(ref||pi), not KL(pi||ref)"


def test_on_sequences_autodiff_of_k3_and_token_level_are_biased():
    testbed = make("tabular")
    for spec in ("k3/autodiff", "k3/token", "rb/autodiff"):
        audit = audit_grad(spec, testbed, batch_size=8, n_trials=600, seed=3)
        assert audit.z_target > Z and audit.rel_bias > 0.05, audit


def test_token_level_equals_autodiff_of_k2_exactly():
    testbed = make("tabular")
    s = testbed.sample(16, generator=make_generator(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLGradientWarning)
        token = klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, grad="token")
        (g_token,) = torch.autograd.grad(token, testbed.parameters(), retain_graph=True)
        k2 = klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, estimator="k2", grad="autodiff")
        (g_k2,) = torch.autograd.grad(k2, testbed.parameters())
    assert torch.allclose(g_token, g_k2, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    ("grad", "direction", "name"),
    [
        ("score", "pi||ref", "tabular"),
        ("score", "ref||pi", "tabular"),
        ("cumulative", "pi||ref", "fixed-length"),
        ("cumulative", "ref||pi", "fixed-length"),
    ],
)
def test_mean_baseline_scales_the_gradient_by_one_minus_one_over_n(grad, direction, name):
    """A group mean that includes the sample itself removes 1/n of its own term's mean.

    For ``cumulative`` the baseline of position t averages the rows valid at t; with eos that
    count is random, so the factor is exactly 1 - 1/n only on fixed-length sequences.
    """
    # No eos in "fixed-length": every position is valid in every row, so a group mean always
    # has n terms.
    testbed = make("tabular" if name == "tabular" else "tabular-fixed-length")
    n = 4
    draws = gradient_draws(
        GradSpec.parse(f"k3/{grad}+mean").build(direction),
        testbed,
        batch_size=n,
        n_trials=2000,
        seed=4,
    )
    exact = torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad(direction)])
    assert mean_shift_z(draws, (1 - 1 / n) * exact) <= Z
    assert mean_shift_z(draws, exact) > Z


@pytest.mark.parametrize("direction", BOTH)
@pytest.mark.parametrize("name", ["tabular", "off-policy"])
def test_token_level_gradient_has_its_documented_mean(name, direction):
    """``token``'s mean is the per-position KLs' gradient with the prefixes held fixed (module
    docstring of klest.sampled.penalty): on-policy pi's prefixes, off-policy behavior's."""
    testbed = make(name)
    target = testbed.target if name == "off-policy" else testbed
    sampler = testbed.behavior if name == "off-policy" else None
    draws = gradient_draws(
        GradSpec.parse("k3/token").build(direction), testbed, batch_size=8, n_trials=600, seed=11
    )
    documented = exact_token_level_gradient(target, direction, sampler)
    exact = torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad(direction)])
    assert mean_shift_z(draws, documented) <= Z
    assert mean_shift_z(draws, exact) > Z  # and it is not the sequence KL's gradient


@functools.cache
def _squared_deviations(spec: str, high_kl: bool, batch: int) -> torch.Tensor:
    """Per-trial ||g_i - mean g||^2 of a gradient estimator; fixed seed, so every spec sees the
    same samples (the draws of two specs are paired)."""
    if high_kl:  # KL(pi||ref) = 6.1
        testbed = TabularAutoregressive.random(3, 4, seed=5, scale=3.0)
    else:  # KL(pi||ref) = 0.78
        testbed = TabularAutoregressive.random(3, 4, eos=2, seed=0, scale=0.7)
    draws = gradient_draws(
        GradSpec.parse(spec).build("pi||ref"), testbed, batch_size=batch, n_trials=800, seed=5
    )
    return ((draws - draws.mean(0)) ** 2).sum(1)


def variance_ratio(with_baseline: torch.Tensor, without: torch.Tensor) -> tuple[float, float]:
    r"""Ratio R = tr Cov(with) / tr Cov(without) of paired draws, and its standard error.

    With a_i, b_i the paired squared deviations, R = mean(a) / mean(b) and, by the delta
    method, se(R) = sd(a_i - R b_i) / (mean(b) sqrt(n)).
    """
    a, b = with_baseline, without
    ratio = float(a.mean() / b.mean())
    se = float((a - ratio * b).std() / b.mean()) / math.sqrt(a.numel())
    return ratio, se


@pytest.mark.parametrize("baseline", ["loo", "ema"])
@pytest.mark.parametrize("estimator", ["k3/score", "k3/cumulative", "rb/rb"])
def test_baselines_reduce_gradient_variance_at_high_kl(estimator, baseline):
    """At high KL (6.1, V=3, T=4, groups of 8) a baseline removes most of the large mean of the
    target that the scores multiply: the variance ratio's upper bound R + Z se(R) (Z = 4, so a
    false fail has probability 3e-5 under the normal approximation; se from the paired draws,
    see :func:`variance_ratio`; tabular gradients are bounded, so every moment the delta method
    needs is finite) must be below 1. Measured: score 0.36 / 0.30, cumulative 0.68 / 0.52,
    rb 0.36 / 0.36 (loo / ema), se <= 0.03.

    Not universal: on other tables of the same scale (seed 6, KL 6.4-10.6) LOO and even EMA
    *increase* cumulative's variance (x1.2-1.4 at n = 4): a constant baseline near E[G_t] is
    far from the variance-optimal E[s_t^2 G_t] / E[s_t^2] when rare tokens carry the targets.
    """
    plain = _squared_deviations(estimator, True, 8)
    ratio, se = variance_ratio(_squared_deviations(f"{estimator}+{baseline}", True, 8), plain)
    assert ratio + Z * se < 1.0, (ratio, se)


def test_leave_one_out_is_not_free_at_low_kl():
    """A baseline adds the noise of its own estimate. At KL 0.78 (groups of 4) LOO
    multiplies cumulative's gradient variance by 1.73 (se 0.05): the lower bound R - Z se(R)
    must be above 1 (Z = 4; see the high-KL test for the standard error)."""
    plain = _squared_deviations("k3/cumulative", False, 4)
    ratio, se = variance_ratio(_squared_deviations("k3/cumulative+loo", False, 4), plain)
    assert ratio - Z * se > 1.0, (ratio, se)


def test_warnings_for_biased_choices():
    testbed = make("tabular")
    s = testbed.sample(4, generator=make_generator(1))
    with pytest.warns(KLGradientWarning, match="per-token partial gradient"):
        klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, grad="token")
    with pytest.warns(KLGradientWarning, match="not an unbiased gradient"):
        klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, grad="autodiff")


# -- values, masks, reductions -------------------------------------------------------------------
@pytest.mark.parametrize(
    "reduction", ["seq-mean-token-sum", "token-mean", "sum", "seq-mean-token-mean"]
)
@pytest.mark.parametrize("value", ["k1", "k2", "k3", "abs"])
def test_forward_value_is_the_value_estimator(value, reduction):
    testbed = make("tabular")
    s = testbed.sample(6, generator=make_generator(3))
    loss = klest.kl_penalty(
        s.logp, s.logp_ref, mask=s.mask, estimator=value, grad="cumulative", reduction=reduction
    )
    expected = klest.kl_estimate(
        s.logp, s.logp_ref, estimator=value, mask=s.mask, reduction=reduction
    )
    assert torch.allclose(loss, expected, rtol=1e-12)
    # And against the formula, written out independently of klest.
    per_token = values_reference(
        s.logp, s.logp_ref, estimator=value, direction="pi||ref", mask=s.mask
    )
    by_hand = reduce_reference(per_token, s.mask, reduction)
    assert float(loss.detach()) == pytest.approx(by_hand, rel=1e-12, abs=1e-15)


VALUE_CHOICES = [
    ("k1", None),
    ("k2", None),
    ("k3", None),
    ("abs", None),
    ("cv", 0.5),
    ("cv", "loo"),
    ("rb", None),
]


@pytest.mark.parametrize("direction", BOTH)
@pytest.mark.parametrize("grad", ["score", "cumulative", "rb", "token"])
def test_score_type_gradient_does_not_depend_on_the_value_estimator(grad, direction):
    """The value and the gradient are chosen apart: every value gives the same gradient."""
    testbed = make("tabular")
    s = testbed.sample(8, generator=make_generator(12))
    grads = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLGradientWarning)
        for value, alpha in VALUE_CHOICES:
            loss = klest.kl_penalty(
                s.logp,
                s.logp_ref,
                mask=s.mask,
                estimator=value,
                alpha=alpha,
                grad=grad,
                direction=direction,
                logits=s.logits,
                logits_ref=s.logits_ref,
            )
            (grads[(value, alpha)],) = torch.autograd.grad(
                loss, testbed.parameters(), retain_graph=True
            )
    reference = grads[("k3", None)]
    assert float(reference.abs().max()) > 0
    for key, g in grads.items():
        torch.testing.assert_close(g, reference, rtol=1e-12, atol=1e-15, msg=str(key))


@pytest.mark.parametrize("name", ["tabular", "off-policy"])
@pytest.mark.parametrize("direction", BOTH)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(("value", "alpha"), VALUE_CHOICES[:-1])
def test_forward_value_is_kl_estimate_for_every_value_level_and_direction(
    value, alpha, level, direction, name
):
    testbed = make(name)
    s = testbed.sample(8, generator=make_generator(13))
    common = {"mask": s.mask, "direction": direction, "alpha": alpha, "level": level}
    common["logp_behavior"] = s.logp_behavior
    loss, details = klest.kl_penalty(
        s.logp, s.logp_ref, estimator=value, grad="cumulative", return_details=True, **common
    )
    per_sequence = klest.kl_estimate(
        s.logp, s.logp_ref, estimator=value, reduction="per-sequence", **common
    )
    torch.testing.assert_close(details.per_sequence, per_sequence.detach(), rtol=1e-12, atol=0)
    expected = klest.kl_estimate(
        s.logp, s.logp_ref, estimator=value, reduction="seq-mean-token-sum", **common
    )
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-15)
    # And against the formulas written out in tests/_reference.py (leave-one-out included).
    reference = values_reference(
        s.logp,
        s.logp_ref,
        estimator=value,
        direction=direction,
        alpha=alpha,
        mask=s.mask,
        level=level,
        logp_behavior=s.logp_behavior,
    )
    by_row = reference.sum(-1) if level == "token" else reference
    torch.testing.assert_close(details.per_sequence, by_row, rtol=1e-10, atol=1e-12)
    nonempty = s.mask.any(-1)
    torch.testing.assert_close(loss.detach(), by_row[nonempty].mean(), rtol=1e-10, atol=1e-12)


def test_rb_value_for_ref_pi_weights_each_position_by_the_prefix_ratio():
    """KL(ref||pi) = sum_n E_{y<n ~ ref} KL_n(ref||pi) = E_pi[sum_n R_{<n} KL_n(ref||pi)]."""
    testbed = make("tabular")
    s = testbed.sample(6, generator=make_generator(14))
    loss, details = klest.kl_penalty(
        s.logp,
        s.logp_ref,
        mask=s.mask,
        estimator="rb",
        grad="rb",
        direction="ref||pi",
        logits=s.logits,
        logits_ref=s.logits_ref,
        return_details=True,
    )
    lp, lr = s.logits.detach(), s.logits_ref
    kl_n = torch.where(s.mask, (lr.exp() * (lr - lp)).sum(-1), 0.0)
    delta = torch.where(s.mask, s.logp.detach() - s.logp_ref, 0.0)
    prefix_ratio = torch.exp(-(delta.cumsum(-1) - delta))  # R_{<n}
    expected = (prefix_ratio * kl_n).sum(-1)
    torch.testing.assert_close(details.per_sequence, expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(loss.detach(), expected.mean(), rtol=1e-12, atol=1e-15)


def test_rb_value_is_the_sum_of_exact_position_kls():
    testbed = make("tabular")
    s = testbed.sample(6, generator=make_generator(4))
    loss, details = klest.kl_penalty(
        s.logp,
        s.logp_ref,
        mask=s.mask,
        estimator="rb",
        grad="rb",
        logits=s.logits,
        logits_ref=s.logits_ref,
        return_details=True,
    )
    per_position = klest.categorical_kl(s.logits, s.logits_ref, mask=s.mask, reduction="none")
    assert torch.allclose(details.per_sequence, per_position.sum(-1))
    assert torch.allclose(loss, per_position.sum(-1).mean())
    assert details.diagnostics.frac_negative == 0.0


@pytest.mark.parametrize("grad", ["score", "cumulative", "rb", "token", "autodiff"])
def test_padding_is_excluded_from_value_and_gradient(grad):
    """Appending garbage tokens behind a mask changes neither the loss nor its gradient."""
    testbed = make("tabular")
    s = testbed.sample(5, generator=make_generator(5))

    def run(logp, logp_ref, mask, logits, logits_ref):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KLGradientWarning)
            loss = klest.kl_penalty(
                logp,
                logp_ref,
                mask=mask,
                grad=grad,
                logits=logits,
                logits_ref=logits_ref,
                baseline="loo" if grad in ("score", "cumulative", "rb") else None,
            )
        return loss, torch.autograd.grad(loss, testbed.parameters(), retain_graph=True)[0]

    base_loss, base_grad = run(s.logp, s.logp_ref, s.mask, s.logits, s.logits_ref)
    junk = torch.full((5, 2), float("nan"), dtype=torch.float64)
    pad = torch.cat([s.mask, torch.zeros(5, 2, dtype=torch.bool)], 1)
    junk_logits = torch.full((5, 2, 3), float("nan"), dtype=torch.float64)
    padded_loss, padded_grad = run(
        torch.cat([s.logp, junk], 1),
        torch.cat([s.logp_ref, junk], 1),
        pad,
        torch.cat([s.logits, junk_logits], 1),
        torch.cat([s.logits_ref, junk_logits], 1),
    )
    assert torch.allclose(base_loss, padded_loss, rtol=1e-12)
    assert torch.allclose(base_grad, padded_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("grad", ["score", "cumulative", "rb", "token", "autodiff"])
def test_per_token_and_per_sequence_losses_sum_to_the_batch_loss(grad):
    """``"none"`` keeps the token axis (0 at padding), ``"per-sequence"`` one loss per row; both
    sum, in value and gradient, to ``"sum"``."""
    testbed = make("tabular")
    s = testbed.sample(6, generator=make_generator(6))
    params = testbed.parameters()
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLGradientWarning)
        for reduction in ("none", "per-sequence", "sum"):
            loss = klest.kl_penalty(
                s.logp,
                s.logp_ref,
                mask=s.mask,
                grad=grad,
                reduction=reduction,
                logits=s.logits,
                logits_ref=s.logits_ref,
            )
            out[reduction] = (loss, torch.autograd.grad(loss.sum(), params, retain_graph=True)[0])
    assert out["none"][0].shape == s.logp.shape and out["per-sequence"][0].shape == (6,)
    assert float(out["none"][0].detach()[~s.mask].abs().max()) == 0.0
    for reduction in ("none", "per-sequence"):
        loss, g = out[reduction]
        torch.testing.assert_close(loss.sum(), out["sum"][0], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(g, out["sum"][1], rtol=1e-12, atol=1e-15)


# -- bad input --------------------------------------------------------------------------------
def test_bad_input():
    testbed = make("tabular")
    s = testbed.sample(4, generator=make_generator(7))
    lp, lq, m = s.logp, s.logp_ref, s.mask
    with pytest.raises(ValueError, match="needs the full next-token distributions"):
        klest.kl_penalty(lp, lq, mask=m, grad="rb")
    with pytest.raises(ValueError, match="needs reparameterized samples"):
        klest.kl_penalty(lp, lq, mask=m, grad="pathwise")
    with pytest.raises(ValueError, match="is a score-function gradient"):
        klest.kl_penalty(lp, lq, mask=m, grad="cumulative", reparameterized=True)
    with pytest.raises(TypeError, match="reparameterized must be a bool"):
        klest.kl_penalty(lp, lq, mask=m, reparameterized=None)
    with pytest.raises(ValueError, match="logits has shape"):
        klest.kl_penalty(
            lp, lq, mask=m, grad="rb", logits=s.logits[:, :2], logits_ref=s.logits_ref[:, :2]
        )
    with pytest.raises(ValueError, match="baseline applies to grad in"):
        klest.kl_penalty(lp, lq, mask=m, grad="token", baseline="loo")
    with pytest.raises(ValueError, match="unknown baseline 'median'"):
        klest.kl_penalty(lp, lq, mask=m, grad="score", baseline="median")
    with pytest.raises(ValueError, match="unknown grad 'reinforce'"):
        klest.kl_penalty(lp, lq, mask=m, grad="reinforce")
    with pytest.raises(ValueError, match="unknown estimator 'k5'"):
        klest.kl_penalty(lp, lq, mask=m, estimator="k5")
    for reduction in ("token-mean", "none"):
        with pytest.raises(ValueError, match="needs per-token values"):
            klest.kl_penalty(lp, lq, mask=m, level="sequence", reduction=reduction)

    g = make("gaussian").sample(4, generator=make_generator(8))
    rep = {"reparameterized": True}
    with pytest.raises(ValueError, match="needs logp_stl"):
        klest.kl_penalty(g.logp, g.logp_ref, grad="stl", **rep)
    with pytest.raises(ValueError, match="has mean zero only there"):
        klest.kl_penalty(
            g.logp, g.logp_ref, grad="stl", logp_stl=g.logp_stl, direction="ref||pi", **rep
        )
    with pytest.raises(ValueError, match="needs samples from pi itself"):
        klest.kl_penalty(g.logp, g.logp_ref, grad="pathwise", logp_behavior=g.logp.detach(), **rep)
    with pytest.raises(ValueError, match="needs logp_ref to carry the graph"):
        klest.kl_penalty(g.logp, g.logp_ref.detach(), grad="pathwise", **rep)
    with pytest.raises(ValueError, match="gradient spec"):
        GradSpec.parse("k3")


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_autodiff_of_a_control_variate_descends_alpha_times_the_other_kl(alpha):
    """Tang & Munos (2025): an autodiffed control variate regularizes with its multiplier."""
    testbed = make("categorical")
    draws = gradient_draws(
        GradSpec.parse(f"cv:{alpha}/autodiff").build("pi||ref"),
        testbed,
        batch_size=8,
        n_trials=1500,
        seed=9,
    )
    other = torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad("ref||pi")])
    assert mean_shift_z(draws, alpha * other) <= Z


@pytest.mark.parametrize("direction", BOTH)
@pytest.mark.parametrize("name", ["tabular", "off-policy", "categorical"])
def test_rb_value_is_unbiased(name, direction):
    testbed = make(name)

    def per_sequence(sample):
        return klest.kl_penalty(
            sample.logp,
            sample.logp_ref,
            mask=sample.mask,
            estimator="rb",
            grad="rb",
            direction=direction,
            logits=sample.logits,
            logits_ref=sample.logits_ref,
            logp_behavior=sample.logp_behavior,
            reduction="per-sequence",
        )

    audit = klest.audit_value(
        per_sequence, testbed, direction=direction, batch_size=200, n_trials=10, seed=3
    )
    assert abs(audit.z) <= Z, audit  # z has a rounding floor: categorical's rb is exact


def test_rao_blackwellization_can_increase_variance():
    """A counterexample to "Var(RB) <= Var(MC)": MC variance 0, RB (log 3)^2 / 4.

    Tokens a=0, b=1, x=2, z=3, T=2: pi(ax) = pi(bx) = 1/2; ref(ax) = ref(bx) = 1/4, ref(bz) = 1/2.
    """
    ninf = float("-inf")
    pi = torch.full((5, 4), ninf, dtype=torch.float64)
    ref = torch.full((5, 4), ninf, dtype=torch.float64)
    pi[0, :2] = torch.tensor([0.5, 0.5], dtype=torch.float64).log()  # first token: a or b
    ref[0, :2] = torch.tensor([0.25, 0.75], dtype=torch.float64).log()
    pi[1, 2] = ref[1, 2] = 0.0  # after a: x
    pi[2, 2] = 0.0  # after b: pi says x
    ref[2, 2:] = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64).log()  # ref says x or z
    pi[3:] = ref[3:] = 0.0  # prefixes x / z never occur
    testbed = TabularAutoregressive(pi, ref, horizon=2)
    s = testbed.evaluate(torch.tensor([[0, 2], [1, 2]]))  # the two sequences, each w.p. 1/2
    mc = klest.k1(s.logp, s.logp_ref, reduction="none").sum(-1).detach()
    rb = klest.categorical_kl(s.logits, s.logits_ref, reduction="per-sequence").detach()
    assert float(mc[0]) == pytest.approx(float(mc[1]), rel=1e-14)  # log 2 each: variance 0
    rb_var = float(((rb - rb.mean()) ** 2).mean())  # exact: both sequences have probability 1/2
    assert rb_var == pytest.approx(math.log(3) ** 2 / 4, rel=1e-12)
    assert float(mc.mean()) == pytest.approx(float(rb.mean()), rel=1e-12)  # same mean: the KL


# -- trainer batches ------------------------------------------------------------------------------


WITH_BASELINES = [
    (grad, baseline, direction)
    for grad in ("score", "cumulative", "rb", "token", "autodiff")
    for baseline in (None, "loo", "mean", "ema")
    for direction in BOTH
    if baseline is None
    or (grad in ("score", "cumulative") or (grad == "rb" and direction == "pi||ref"))
]


@pytest.mark.parametrize(("grad", "baseline", "direction"), WITH_BASELINES)
def test_left_and_right_padding_give_the_same_loss_and_gradient(grad, baseline, direction):
    """Per-position baselines align completions at their first token (eos makes lengths vary)."""
    testbed = make("tabular")
    s = testbed.sample(8, generator=make_generator(21))
    assert not bool(s.mask.all())  # some rows are padded
    group = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    results = []
    for layout in ("right", "left"):

        def arrange(x, layout=layout):
            return x if layout == "right" else left_padded(x, s.mask)

        ema = klest.BaselineEMA(decay=0.5) if baseline == "ema" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KLGradientWarning)
            for _ in range(2 if ema else 1):  # a second batch, so the moving average is not 0
                loss = klest.kl_penalty(
                    arrange(s.logp),
                    arrange(s.logp_ref),
                    mask=arrange(s.mask),
                    grad=grad,
                    direction=direction,
                    baseline=ema if ema is not None else baseline,
                    group=group if baseline in ("loo", "mean") else None,
                    logits=arrange(s.logits),
                    logits_ref=arrange(s.logits_ref),
                )
        params = testbed.parameters()
        results.append((loss, torch.autograd.grad(loss, params, retain_graph=True)[0]))
    (loss_r, grad_r), (loss_l, grad_l) = results
    torch.testing.assert_close(loss_l, loss_r, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_l, grad_r, rtol=1e-10, atol=1e-13)


STATELESS_GROUP_BASELINES = [
    ("cumulative", "loo", "pi||ref"),
    ("cumulative", "mean", "ref||pi"),
    ("cumulative", "loo-fitted", "pi||ref"),
    ("cumulative", "exact-kl+loo", "pi||ref"),
    ("rb", "loo", "pi||ref"),
    ("token", "exact-kl+loo", "pi||ref"),
]


@pytest.mark.parametrize(("grad", "baseline", "direction"), STATELESS_GROUP_BASELINES)
def test_validation_changes_no_loss_or_gradient_in_any_layout(grad, baseline, direction):
    """The value checks only read: in every padding layout, one call after another, a validated
    call gives, bit for bit, the loss and gradient of validate=False (the checks keep no
    state between calls)."""
    testbed = make("tabular")
    s = testbed.sample(8, generator=make_generator(23))
    assert not bool(s.mask.all())
    group = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    params = testbed.parameters()

    def call(layout, validate):
        def arrange(x):
            return x if layout == "right" else left_padded(x, s.mask)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KLGradientWarning)
            loss = klest.kl_penalty(
                arrange(s.logp),
                arrange(s.logp_ref),
                mask=arrange(s.mask),
                grad=grad,
                direction=direction,
                baseline=baseline,
                group=group,
                logits=arrange(s.logits),
                logits_ref=arrange(s.logits_ref),
                validate=validate,
            )
        return loss, torch.autograd.grad(loss, params, retain_graph=True)[0]

    for layout in ("right", "right", "left", "left", "right", "left", "right"):
        loss, g = call(layout, True)
        loss_ref, g_ref = call(layout, False)
        assert torch.equal(loss, loss_ref), layout
        assert torch.equal(g, g_ref), layout


def test_ema_baseline_aligns_completions_at_their_first_token():
    testbed = make("tabular")
    s = testbed.sample(8, generator=make_generator(22))
    emas = {}
    for layout in ("right", "left"):
        ema = klest.BaselineEMA(decay=0.5)
        arrange = (lambda x: x) if layout == "right" else (lambda x: left_padded(x, s.mask))
        for _ in range(2):
            klest.kl_penalty(
                arrange(s.logp), arrange(s.logp_ref), mask=arrange(s.mask), baseline=ema
            )
        emas[layout] = ema
    torch.testing.assert_close(emas["left"].sums, emas["right"].sums, rtol=1e-12, atol=0)
    torch.testing.assert_close(emas["left"].weights, emas["right"].weights, rtol=0, atol=0)


@pytest.mark.parametrize("grad", ["score", "cumulative"])
def test_a_sample_alone_in_its_group_gets_leave_one_out_baseline_zero(grad):
    """Gradient accumulation can leave one sample of a prompt in a micro-batch: it keeps an
    unbiased gradient (baseline 0) and the details count it."""
    testbed = make("tabular")
    s = testbed.sample(5, generator=make_generator(23))
    group = torch.tensor([0, 0, 1, 0, 2])
    per_seq, details = klest.kl_penalty(
        s.logp,
        s.logp_ref,
        mask=s.mask,
        grad=grad,
        baseline="loo",
        group=group,
        reduction="per-sequence",
        return_details=True,
    )
    assert details.n_singleton_samples == 2
    plain = klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, grad=grad, reduction="per-sequence")
    params = testbed.parameters()
    for row in (2, 4):
        (g_loo,) = torch.autograd.grad(per_seq[row], params, retain_graph=True)
        (g_plain,) = torch.autograd.grad(plain[row], params, retain_graph=True)
        torch.testing.assert_close(g_loo, g_plain, rtol=1e-12, atol=1e-15)
    (g_loo,) = torch.autograd.grad(per_seq[0], params, retain_graph=True)
    (g_plain,) = torch.autograd.grad(plain[0], params, retain_graph=True)
    assert not torch.allclose(g_loo, g_plain)  # rows with company do get a baseline


def test_singleton_count_is_of_samples_with_tokens():
    """An empty row is no sample: it neither counts as alone in its group nor keeps a group
    mate from being alone (whose leave-one-out baseline is 0 either way)."""
    s = make("tabular").sample(5, generator=make_generator(25))
    mask = s.mask.clone()
    mask[1] = False  # row 0's only group mate is empty: row 0 is alone
    mask[4] = False  # row 4 is alone in its group, but empty
    _, details = klest.kl_penalty(
        s.logp,
        s.logp_ref,
        mask=mask,
        baseline="loo",
        group=torch.tensor([7, 7, 3, 3, 9]),
        return_details=True,
    )
    assert details.n_singleton_samples == 1
    # Sequences with no token at all (T = 0, no mask): no sample, so none alone.
    empty = torch.zeros(3, 0, dtype=torch.float64)
    _, details = klest.kl_penalty(
        empty, empty, baseline="loo", group=torch.tensor([0, 1, 1]), return_details=True
    )
    assert details.n_singleton_samples == 0 and details.diagnostics.n_empty_rows == 3


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
@pytest.mark.parametrize("baseline", [None, "loo", "ema"])
def test_the_loss_has_the_compute_dtype(dtype, expected, baseline):
    s = make("tabular").sample(6, generator=make_generator(24))
    logp = s.logp.detach().to(dtype).requires_grad_()
    loss = klest.kl_penalty(
        logp,
        s.logp_ref.to(dtype),
        mask=s.mask,
        baseline=klest.BaselineEMA() if baseline == "ema" else baseline,
        group=torch.tensor([0, 0, 0, 1, 1, 1]) if baseline == "loo" else None,
    )
    assert loss.dtype == expected
    (g,) = torch.autograd.grad(loss, [logp])
    assert g.dtype == dtype


def test_no_gradient_reaching_the_policy_warns_but_log_probs_from_logits_do_not():
    s = make("tabular").sample(4, generator=make_generator(25))
    with pytest.warns(KLGradientWarning, match="no gradient will reach the policy"):
        klest.kl_penalty(s.logp.detach(), s.logp_ref, mask=s.mask)
    logits = s.logits.detach().float().requires_grad_()
    labels = torch.where(s.mask, s.x, -100)
    _, d = klest.kl_from_logits(
        logits, s.logits_ref.float(), labels=labels, reduction="none", return_details=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = klest.kl_penalty(d.logp, d.logp_ref, mask=s.mask, baseline="loo")
    loss.backward()
    assert logits.grad is not None and float(logits.grad.abs().max()) > 0


def right_padded(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Undo :func:`left_padded` for a right-padded ``mask`` ``[B, T]``."""
    shift = mask.shape[1] - mask.sum(1)
    return x.gather(1, (torch.arange(mask.shape[1]) + shift.unsqueeze(1)) % mask.shape[1])


@pytest.mark.parametrize(
    ("rows", "t", "dtype"),
    [(1025, 5, torch.bfloat16), (1024, 5, torch.float16), (3, 2**15 + 5, torch.float32)],
    ids=["1025-rows-bf16", "1024-rows-fp16", "T-past-int16"],
)
@pytest.mark.parametrize("baseline", ["loo", "mean", "loo-fitted", "ema"])
def test_padding_layouts_agree_past_the_fast_paths_limits(rows, t, dtype, baseline):
    """Group keys past the 1024-row equality table, groups above bf16's exact integers (256),
    first tokens past int16 columns: left and right padding give one loss and gradient, and
    NaN / inf under the mask reach neither."""
    g = make_generator(23)
    logp = -torch.rand(rows, t, generator=g, dtype=torch.float64) * 2
    logp_ref = (logp + 0.3 * torch.randn(rows, t, generator=g, dtype=torch.float64)).clamp(max=0)
    lengths = torch.randint(0, t + 1, (rows,), generator=g)
    lengths[0] = t
    mask = torch.arange(t) < lengths.unsqueeze(1)
    logp = torch.where(mask, logp, math.nan).to(dtype)
    logp_ref = torch.where(mask, logp_ref, -math.inf).to(dtype)
    group = torch.randint(0, 3, (rows,), generator=g) * 2**40  # a few large, sparse ids
    results = []
    for layout in ("right", "left"):

        def arrange(x, layout=layout):
            return x if layout == "right" else left_padded(x, mask)

        ema = klest.BaselineEMA(decay=0.5) if baseline == "ema" else None
        x = arrange(logp).requires_grad_()
        for _ in range(2 if ema else 1):
            loss = klest.kl_penalty(
                x,
                arrange(logp_ref),
                mask=arrange(mask),
                baseline=ema if ema is not None else baseline,
                group=None if ema else group,
            )
        (grad,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(grad).all()
        assert not grad[~arrange(mask)].any()
        results.append((loss, grad if layout == "right" else right_padded(grad, mask)))
    (loss_r, grad_r), (loss_l, grad_l) = results
    assert torch.isfinite(loss_r)
    # The layouts reorder float32 sums of non-negative k3 values (cascade sums: about log2 n <= 16
    # roundings each) and the gradient's sums over tokens and rows, whose terms reach the size of
    # its largest entry: 2 x 32 roundings; the gradient is then rounded to the input dtype on
    # each side (half an ulp each, so twice the unit roundoff of each entry).
    assert_close_to_rounding(loss_l, loss_r, ulps=64, dtype=torch.float32, what="loss")
    atol = rounding_tolerance(grad_r, ulps=64, dtype=torch.float32)
    rtol = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    assert_verbose_close(grad_l, grad_r, atol=atol, rtol=rtol, what="gradient")


def test_details_without_groups_are_detached_and_count_no_singletons():
    """Without ``group`` no sample is alone in a group (``n_singleton_samples`` is 0), and
    ``per_sequence`` is the per-sequence value, detached even where the value carries the
    gradient (``grad="autodiff"``): logging it keeps no graph alive."""
    s = make("tabular").sample(4, generator=make_generator(29))
    k3 = klest.k3(s.logp, s.logp_ref, mask=s.mask, reduction="per-sequence").detach()
    with pytest.warns(KLGradientWarning, match="not an unbiased gradient"):
        autodiff = klest.kl_penalty(
            s.logp, s.logp_ref, mask=s.mask, grad="autodiff", return_details=True
        )
    loo = klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, baseline="loo", return_details=True)
    for _, details in (autodiff, loo):
        assert details.n_singleton_samples == 0
        assert not details.per_sequence.requires_grad
        torch.testing.assert_close(details.per_sequence, k3, rtol=1e-12, atol=1e-15)


def test_reparameterized_samples_are_log_densities_without_density_flag():
    """reparameterized=True implies log-densities (continuous x): a narrow Gaussian's
    log-density above 0 is accepted without density=True. Value: k1's mean of
    log pi(x) - log ref(x), written here in float64; gradient: the pathwise one, autodiff of
    that mean through x = mu + sigma eps (computed here)."""
    eps = torch.randn(64, generator=make_generator(3), dtype=torch.float64)
    mu = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    sigma = 0.1
    x = mu + sigma * eps

    def normal(x, m, s):
        return -0.5 * ((x - m) / s) ** 2 - math.log(s * math.sqrt(2 * math.pi))

    lp, lq = normal(x, mu.detach(), sigma), normal(x, 0.0, 1.0)
    assert bool((lp > 0).any())  # log-densities above 0: impossible for log-probs
    got = klest.kl_penalty(lp, lq, estimator="k1", grad="pathwise", reparameterized=True)
    want = (lp - lq).mean()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    (g_got,) = torch.autograd.grad(got, mu, retain_graph=True)
    (g_want,) = torch.autograd.grad(want, mu)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-14)


def test_vmap_over_batches_with_a_left_padded_group_baseline():
    """``torch.func.vmap`` (and ``vmap(grad)``) of ``kl_penalty`` with a per-position group
    baseline on a left-padded batch equals a loop over the batches: the baseline's in-place
    fast paths into strided views give way to plain operations under the transform."""
    g = make_generator(31)
    logp = -torch.rand(3, 4, 5, generator=g, dtype=torch.float64)
    logp_ref = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    mask[3, 3:] = False
    group = torch.tensor([0, 0, 1, 1])

    def loss(lp):
        # validate=False: vmap cannot read values back to the host, as the checks do
        return klest.kl_penalty(
            lp, logp_ref, mask=mask, baseline="loo", group=group, validate=False
        )

    looped = torch.stack([loss(lp) for lp in logp])
    torch.testing.assert_close(torch.func.vmap(loss)(logp), looped, rtol=1e-12, atol=1e-12)
    grads = torch.stack([torch.func.grad(loss)(lp) for lp in logp])
    batched = torch.func.vmap(torch.func.grad(loss))(logp)
    torch.testing.assert_close(batched, grads, rtol=1e-12, atol=1e-12)
