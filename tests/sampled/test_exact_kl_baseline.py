"""The exact-KL baselines of kl_penalty (``baseline="exact-kl"`` / ``"exact-kl+loo"``).

Deterministic facts are checked exactly against a reference written here: the gradient of the
surrogate with respect to each sampled log-prob is its coefficient, which a loop over rows and
positions computes from the formula. Statistical rule (``tests/_stats.py``): mean gradients
against the exact gradients of ``klest.testbeds`` (by enumeration) through
``klest.audit.mean_shift_z``, one one-sided comparison per check at ``RATE`` (6.3e-5,
threshold ``z_for(RATE, 1, two_sided=False)`` = 3.83); variance ratios of paired draws within
``Z`` = 4 standard errors (delta method, see ``tests.test_penalty.variance_ratio``); fixed
seeds.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import klest
from klest.audit import GradSpec, audit_grad, gradient_draws, mean_shift_z
from klest.sampled.penalty import KLGradientWarning
from klest.testbeds import make_generator
from tests._reference import exact_token_level_gradient, left_padded
from tests._stats import RATE, Z, z_for
from tests._testbeds import make
from tests.sampled.test_penalty import _squared_deviations, variance_ratio

Z_ONE_SIDED = z_for(RATE, 1, two_sided=False)


def _batch(seed: int = 0, n: int = 6, t: int = 4, v: int = 5):
    """Random logits ``[n, t, v]`` (float64), sampled tokens, a right-padded mask with an empty
    row, and log-probs of the tokens (``logp`` a leaf: its gradient is the coefficient)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, t, v, generator=g, dtype=torch.float64)
    logits_ref = torch.randn(n, t, v, generator=g, dtype=torch.float64)
    lp, lq = torch.log_softmax(logits, -1), torch.log_softmax(logits_ref, -1)
    y = torch.multinomial(lp.exp().reshape(-1, v), 1, generator=g).reshape(n, t)
    lengths = torch.tensor([t, 2, 0, t - 1, 1, t])[:n]
    mask = torch.arange(t) < lengths[:, None]
    logp = lp.gather(-1, y[..., None])[..., 0].clone().requires_grad_()
    logp_ref = lq.gather(-1, y[..., None])[..., 0]
    return logits, logits_ref, logp, logp_ref, mask


def _kl_reference(logits: torch.Tensor, logits_ref: torch.Tensor) -> torch.Tensor:
    """KL(pi_t || ref_t) at every position, from its definition."""
    p = torch.softmax(logits, -1)
    return (p * (torch.log(p) - torch.log_softmax(logits_ref, -1))).sum(-1)


def _coef_reference(d, kls, mask, group, grad, baseline, w=None):
    """The coefficient of each log-prob, by loops: token t's target (the weighted log-ratios
    from t on for cumulative, its own log-ratio for token) minus W_{<=t} times the baseline
    KL_t (+ the mean over the other rows j of the group of (target_j - KL_j) / W_j at the same
    completion position, counting only rows valid there). Off-policy ``w`` holds the inclusive
    prefix weights for cumulative, the per-token weights for token."""
    n, t = d.shape
    w = torch.ones_like(d) if w is None else w
    target = torch.zeros_like(d)
    for i in range(n):
        for k in range(t):
            if grad == "cumulative":
                target[i, k] = sum(w[i, u] * d[i, u] for u in range(k, t) if mask[i, u])
            else:
                target[i, k] = w[i, k] * d[i, k]
    residual = target / w - kls  # the unweighted target's residual
    coef = torch.zeros_like(d)
    for i in range(n):
        valid = [k for k in range(t) if mask[i, k]]
        for pos, k in enumerate(valid):
            b = kls[i, k]
            if baseline == "exact-kl+loo":
                others = []
                for j in range(n):
                    valid_j = [u for u in range(t) if mask[j, u]]
                    if j != i and group[j] == group[i] and pos < len(valid_j):
                        others.append(residual[j, valid_j[pos]])
                b = b + (sum(others) / len(others) if others else 0.0)
            coef[i, k] = target[i, k] - w[i, k] * b
    return coef


@pytest.mark.parametrize("baseline", ["exact-kl", "exact-kl+loo"])
@pytest.mark.parametrize("grad", ["cumulative", "token"])
@pytest.mark.parametrize("off_policy", [False, True])
def test_gradient_is_the_documented_coefficient(grad, baseline, off_policy):
    """d loss / d logp[i, t] with reduction="sum" is each token's coefficient exactly (empty
    row, a group of one and padding included)."""
    logits, logits_ref, logp, logp_ref, mask = _batch()
    group = torch.tensor([0, 0, 0, 1, 1, 2])
    d = (logp - logp_ref).detach()
    behavior, w = None, None
    if off_policy:
        behavior = (logp.detach() + 0.3 * torch.randn(logp.shape, dtype=torch.float64)).clamp(
            max=0.0
        )
        log_w = torch.where(mask, logp.detach() - behavior, 0.0)
        w = log_w.cumsum(-1).exp() if grad == "cumulative" else log_w.exp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLGradientWarning)  # token is biased (documented)
        loss = klest.kl_penalty(
            logp,
            logp_ref,
            mask=mask,
            grad=grad,
            baseline=baseline,
            group=group,
            logits=logits,
            logits_ref=logits_ref,
            logp_behavior=behavior,
            reduction="sum",
        )
    (got,) = torch.autograd.grad(loss, logp)
    want = _coef_reference(d, _kl_reference(logits, logits_ref), mask, group, grad, baseline, w)
    torch.testing.assert_close(got, torch.where(mask, want, 0.0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("baseline", ["exact-kl", "exact-kl+loo"])
def test_left_padding_and_position_kls_give_the_same_gradient(baseline):
    """Left- and right-padded batches agree (the leave-one-out part compares the t-th token of
    each completion), and ``position_kls`` (with a graph, detached by the baseline) equals
    passing the logits."""
    logits, logits_ref, logp, logp_ref, mask = _batch(seed=1)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    grads = []
    for layout in ("right", "left", "position_kls"):
        arrange = (lambda x: left_padded(x, mask)) if layout == "left" else (lambda x: x)
        lp = arrange(logp.detach()).requires_grad_()
        kls = None
        if layout == "position_kls":
            kls = _kl_reference(logits, logits_ref).requires_grad_()
        loss = klest.kl_penalty(
            lp,
            arrange(logp_ref),
            mask=arrange(mask),
            baseline=baseline,
            group=group,
            logits=None if kls is not None else arrange(logits),
            logits_ref=None if kls is not None else arrange(logits_ref),
            position_kls=kls,
            reduction="sum",
        )
        (g,) = torch.autograd.grad(loss, lp)
        grads.append(g)
        if kls is not None:
            assert kls.grad is None
    torch.testing.assert_close(left_padded(grads[0], mask), grads[1], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-12, atol=1e-13)


UNBIASED = [
    ("categorical", "k3/cumulative+exact-kl"),  # T = 1: the score function with baseline KL
    ("tabular", "k3/cumulative+exact-kl"),
    ("tabular", "k1/cumulative+exact-kl+loo"),
    ("markov", "k3/cumulative+exact-kl"),
    ("off-policy", "k3/cumulative+exact-kl"),
    ("off-policy", "k3/cumulative+exact-kl+loo"),
]


@pytest.mark.parametrize(("name", "spec"), UNBIASED)
def test_gradient_is_unbiased_for_kl_pi_ref(name, spec):
    """z_target <= 3.83 (one one-sided comparison at RATE) and the draws carry signal
    (z_zero > 3.83; measured 17-62 on these testbeds)."""
    audit = audit_grad(spec, make(name), batch_size=8, n_trials=600, seed=7)
    assert audit.z_target <= Z_ONE_SIDED, audit
    assert audit.z_zero > Z_ONE_SIDED, audit


@pytest.mark.parametrize(("name", "n_trials"), [("tabular", 600), ("off-policy", 2400)])
def test_token_with_exact_kl_keeps_the_token_level_mean(name, n_trials):
    """vOPD's estimator (token + exact-KL baseline) has the mean of ``grad="token"``: the
    per-position KLs' gradient with the prefixes held fixed, which is not the sequence KL's
    gradient (rejected: measured z 17 and 43 against the threshold 4).

    Off-policy, the importance weights make the draws skewed: at 600 trials the mean's z has a
    heavier right tail than the normal. The skew of a mean shrinks as 1/sqrt(n), and at 2400
    trials its tail is near the normal's."""
    testbed = make(name)
    target = testbed.target if name == "off-policy" else testbed
    sampler = testbed.behavior if name == "off-policy" else None
    draws = gradient_draws(
        GradSpec.parse("k3/token+exact-kl").build("pi||ref"),
        testbed,
        batch_size=8,
        n_trials=n_trials,
        seed=11,
    )
    documented = exact_token_level_gradient(target, "pi||ref", sampler)
    exact = torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad("pi||ref")])
    assert mean_shift_z(draws, documented) <= Z
    assert mean_shift_z(draws, exact) > Z


def test_exact_kl_cuts_cumulative_variance_at_high_kl():
    """At KL(pi||ref) = 6.1 (V = 3, T = 4, batches of 8, 800 paired draws) subtracting KL_t
    leaves 0.54 (se 0.02) of cumulative's variance; leave-one-out leaves 0.68 (se 0.03): the
    upper bound R + Z se must be below 1, and that of exact-kl's variance over leave-one-out's
    (measured 0.80, se 0.03) too."""
    plain = _squared_deviations("k3/cumulative", True, 8)
    exact_kl = _squared_deviations("k3/cumulative+exact-kl", True, 8)
    ratio, se = variance_ratio(exact_kl, plain)
    assert ratio + Z * se < 1.0, (ratio, se)
    ratio, se = variance_ratio(exact_kl, _squared_deviations("k3/cumulative+loo", True, 8))
    assert ratio + Z * se < 1.0, (ratio, se)


def test_exact_kl_is_free_at_low_kl_where_leave_one_out_is_not():
    """At KL 0.78 (groups of 4) leave-one-out multiplies cumulative's variance by 1.73 while
    KL_t, which carries no other sample's noise, leaves it at 1.02 (se 0.02): the lower bound
    R - Z se of exact-kl's ratio must be below 1, and its ratio to leave-one-out's variance
    R + Z se below 1 (measured 0.59)."""
    plain = _squared_deviations("k3/cumulative", False, 4)
    exact_kl = _squared_deviations("k3/cumulative+exact-kl", False, 4)
    ratio, se = variance_ratio(exact_kl, plain)
    assert ratio - Z * se < 1.0, (ratio, se)
    ratio, se = variance_ratio(exact_kl, _squared_deviations("k3/cumulative+loo", False, 4))
    assert ratio + Z * se < 1.0, (ratio, se)


def test_exact_kl_raises_the_token_level_variance_at_low_kl():
    """The value function is not the variance-optimal baseline: on the token-level gradient
    (vOPD's setting) KL_t multiplies the variance by 1.28 (se 0.03) at KL 0.78 (groups of 4):
    the lower bound R - Z se must be above 1. (At KL 6.1: 1.09, se 0.03.)"""
    plain = _squared_deviations("k3/token", False, 4)
    ratio, se = variance_ratio(_squared_deviations("k3/token+exact-kl", False, 4), plain)
    assert ratio - Z * se > 1.0, (ratio, se)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"direction": "ref||pi"}, "direction='pi||ref' only, not 'ref||pi'"),
        ({"grad": "rb"}, "not grad='rb': rb already replaces"),
        ({"grad": "score"}, "not grad='score'"),
        ({"grad": "autodiff"}, "not grad='autodiff'"),
        ({"logits": None, "logits_ref": None}, "baseline='exact-kl' needs the full next-token"),
        ({"baseline": "exact"}, "baseline"),
    ],
)
def test_bad_choices_are_refused(kwargs, match):
    logits, logits_ref, logp, logp_ref, mask = _batch(seed=2)
    call = {
        "mask": mask,
        "grad": "cumulative",
        "baseline": "exact-kl",
        "logits": logits,
        "logits_ref": logits_ref,
        **kwargs,
    }
    with pytest.raises(ValueError, match=match.replace("|", r"\|").replace("(", r"\(")):
        klest.kl_penalty(logp, logp_ref, **call)


def test_grad_spec_parses_exact_kl_baselines():
    spec = GradSpec.parse("k3/cumulative+exact-kl+loo")
    assert (spec.value, spec.grad, spec.baseline) == ("k3", "cumulative", "exact-kl+loo")
    assert spec.label() == "k3/cumulative+exact-kl+loo"
    with pytest.raises(ValueError, match="baseline"):
        GradSpec.parse("k3/cumulative+exact")
    s = make("tabular").sample(4, generator=make_generator(3))
    assert torch.isfinite(spec.build("pi||ref")(s))  # the audit passes the logits


def test_exact_position_gradient_is_the_conditional_mean_of_vopd_estimator():
    """Why the distillation trainer takes no exact-KL baseline: at one position, the gradient
    of the exact KL(pi_t||ref_t) w.r.t. pi's logits equals the expectation over the token
    y_t ~ pi_t of vOPD's per-token estimator s_t (rho_t - KL_t) (``grad="token",
    baseline="exact-kl"``), enumerated over the vocabulary: the exact form is its
    Rao-Blackwellization, so it has no more variance. Exact identity, float64."""
    g = torch.Generator().manual_seed(7)
    v = 6
    z = torch.randn(v, generator=g, dtype=torch.float64).requires_grad_(True)
    y = torch.randn(v, generator=g, dtype=torch.float64)
    (exact,) = torch.autograd.grad(_kl_reference(z, y), z)
    logits_ref = y.expand(1, 1, v)
    expected = torch.zeros_like(z)
    for token in range(v):
        lp = torch.log_softmax(z, -1)
        logp = lp[token].reshape(1, 1)
        logp_ref = torch.log_softmax(y, -1)[token].reshape(1, 1)
        loss = klest.kl_penalty(
            logp,
            logp_ref,
            grad="token",
            baseline="exact-kl",
            logits=z.detach().expand(1, 1, v),
            logits_ref=logits_ref,
        )
        (grad_z,) = torch.autograd.grad(loss, z)
        expected += lp[token].exp().detach() * grad_z
    torch.testing.assert_close(expected, exact, rtol=1e-12, atol=1e-14)
