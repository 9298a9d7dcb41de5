"""kl_penalty's ``discount=`` and ``weights=``: each mean gradient, exactly, by enumeration.

Every sequence of a small tabular testbed (V = 3, T = 3 with an eos) is scored once, and the
estimator's per-sequence surrogate is weighted by the sequence's probability: the result is the
estimator's mean gradient with no sampling noise. It is compared with the gradient of the
objective the docstring names, computed by autograd through the enumeration (weights) or by a
double loop over positions (discount), in float64. Tolerance: both sides sum about 20 sequences
of 3 positions, each a product of a few rounded factors; 200 ulps of the largest entry covers
the rounding of either order of summation with a wide margin and is far below the differences
the tests rule out (the other objectives differ by 1e-2 or more of the gradient's scale).
"""

from __future__ import annotations

import pytest
import torch

import klest
from klest.testbeds import TabularAutoregressive
from tests._reference import exact_token_level_gradient
from tests._tolerance import assert_close_to_rounding

ULPS = 200
# grad="token" warns that it is not the sequence KL's gradient: here that is the point.
pytestmark = pytest.mark.filterwarnings("ignore:grad='token' is the per-token partial gradient")


def _testbed() -> TabularAutoregressive:
    return TabularAutoregressive.random(3, 3, eos=2, seed=3, scale=1.2)


def _enumerated(testbed: TabularAutoregressive):
    tokens, valid = testbed.all_sequences()
    s = testbed.evaluate(tokens)
    logp = torch.where(valid, s.logp, 0.0)
    return tokens, valid, s, logp


def _mean_gradient(testbed: TabularAutoregressive, grad: str, **options) -> torch.Tensor:
    """sum_y p(y) * grad of the estimator's surrogate on y: its exact mean gradient."""
    _tokens, valid, s, logp = _enumerated(testbed)
    prob = logp.sum(-1).exp().detach()
    rows = klest.kl_penalty(
        s.logp,
        s.logp_ref,
        mask=valid,
        grad=grad,
        estimator="rb" if grad == "rb" else "k3",
        logits=s.logits if grad == "rb" else None,
        logits_ref=s.logits_ref if grad == "rb" else None,
        reduction="none",
        **options,
    )
    total = (prob.unsqueeze(-1) * rows).sum()
    return torch.autograd.grad(total, testbed.logits)[0].reshape(-1)


def _flat_grad(total: torch.Tensor, testbed: TabularAutoregressive) -> torch.Tensor:
    return torch.autograd.grad(total, testbed.logits)[0].reshape(-1)


def _prefix_weights(tokens: torch.Tensor, *, own_token: bool) -> torch.Tensor:
    """Positive weights w_t reading y_{<=t} (own_token) or y_{<t} only."""
    t_len = tokens.shape[1]
    shifted = tokens if own_token else torch.cat([torch.zeros_like(tokens[:, :1]), tokens], 1)
    codes = (shifted[:, :t_len].double() + 1).cumprod(1)  # a different number per prefix
    return 0.6 + 0.5 * torch.cos(1.3 * codes) + 0.1 * torch.arange(t_len)


# -- weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("grad", ["score", "cumulative"])
def test_weighted_gradient_is_the_policy_gradient_of_the_weighted_penalties(grad):
    """Weights reading their own token: the mean gradient is grad_theta' E_{pi_theta'}[sum_t
    w_t rho_t] with the penalties w_t rho_t held fixed."""
    testbed = _testbed()
    tokens, valid, s, logp = _enumerated(testbed)
    w = _prefix_weights(tokens, own_token=True)
    rho = torch.where(valid, s.logp - s.logp_ref, 0.0).detach()
    expected = _flat_grad((logp.sum(-1).exp() * (w * rho).sum(-1)).sum(), testbed)
    actual = _mean_gradient(testbed, grad, weights=w)
    assert_close_to_rounding(actual, expected, ulps=ULPS)
    unweighted = _mean_gradient(testbed, grad)
    assert (unweighted - expected).abs().max() > 1e-2 * expected.abs().max()


@pytest.mark.parametrize("grad", ["score", "cumulative", "rb"])
def test_prefix_weighted_gradient_is_the_weighted_objectives(grad):
    """Weights reading the tokens before their own: the mean gradient is that of
    E_pi[sum_t w_t rho_t] (rho differentiable, w fixed), for rb too."""
    testbed = _testbed()
    tokens, valid, s, logp = _enumerated(testbed)
    w = _prefix_weights(tokens, own_token=False)
    rho = torch.where(valid, s.logp - s.logp_ref, 0.0)
    expected = _flat_grad((logp.sum(-1).exp() * (w * rho).sum(-1)).sum(), testbed)
    assert_close_to_rounding(_mean_gradient(testbed, grad, weights=w), expected, ulps=ULPS)


def test_weighted_token_gradient_holds_the_prefixes_and_penalties_fixed():
    """grad="token" with weights: sum_t E_{y<t}[grad_theta' E_{pi'_t}[w_t rho_t]], the
    prefix distribution and the penalties held fixed."""
    testbed = _testbed()
    tokens, valid, s, logp = _enumerated(testbed)
    w = _prefix_weights(tokens, own_token=True)
    rho = torch.where(valid, s.logp - s.logp_ref, 0.0).detach()
    prob = logp.sum(-1, keepdim=True).exp().detach()
    own = torch.exp(logp - logp.detach())  # the gradient of pi_t(y_t) only
    expected = _flat_grad((prob * own * w * rho).sum(), testbed)
    assert_close_to_rounding(_mean_gradient(testbed, "token", weights=w), expected, ulps=ULPS)


def test_weights_of_one_change_nothing_and_weight_the_value():
    testbed = _testbed()
    tokens, valid, s, _ = _enumerated(testbed)
    ones = torch.ones(tokens.shape, dtype=torch.float64)
    for grad in ("score", "cumulative", "rb", "token"):
        assert torch.equal(
            _mean_gradient(testbed, grad, weights=ones), _mean_gradient(testbed, grad)
        )
    w = _prefix_weights(tokens, own_token=True)
    value = klest.kl_penalty(
        s.logp, s.logp_ref, mask=valid, estimator="k1", weights=w, reduction="none"
    )
    expected = torch.where(valid, w * (s.logp - s.logp_ref), 0.0).detach()
    assert_close_to_rounding(value, expected, ulps=4)


# -- discount ------------------------------------------------------------------------------


def _discounted_reference(testbed, gamma: float, *, rb: bool) -> torch.Tensor:
    """sum_y p(y) sum_t s_t(y) c_t(y) (+ rb's pathwise exact KLs), c_t by a double loop:
    sum_{u >= t} gamma^(u - t) rho_u (cumulative) or sum_{u > t} gamma^(u - t) KL_u (rb)."""
    _tokens, valid, s, logp = _enumerated(testbed)
    lp, lr = s.logits, s.logits_ref
    kl = torch.where(valid, (lp.exp() * (lp - lr)).sum(-1), 0.0)
    rho = torch.where(valid, s.logp - s.logp_ref, 0.0)
    terms = (kl if rb else rho).detach()
    coef = torch.zeros_like(terms)
    t_len = terms.shape[1]
    for t in range(t_len):
        for u in range(t + (1 if rb else 0), t_len):
            coef[:, t] += gamma ** (u - t) * terms[:, u]
    prob = logp.sum(-1).exp().detach()
    surrogate = (logp * coef).sum(-1) + (kl.sum(-1) if rb else 0.0)
    return _flat_grad((prob * surrogate).sum(), testbed)


@pytest.mark.parametrize("grad", ["cumulative", "rb"])
@pytest.mark.parametrize("gamma", [0.0, 0.35, 0.8, 1.0])
def test_discounted_gradient_has_its_documented_mean(grad, gamma):
    """Mean = sum_u sum_{t<=u} gamma^(u-t) E[s_t rho_u] (cumulative; rb: exact KLs after t)."""
    testbed = _testbed()
    actual = _mean_gradient(testbed, grad, discount=gamma)
    expected = _discounted_reference(testbed, gamma, rb=grad == "rb")
    assert_close_to_rounding(actual, expected, ulps=ULPS)


@pytest.mark.parametrize("grad", ["cumulative", "rb"])
def test_discount_between_the_token_and_the_sequence_gradient(grad):
    """gamma = 1: the sequence KL's gradient; gamma = 0: the token-local gradient."""
    testbed = _testbed()
    sequence = torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad("pi||ref")])
    local = exact_token_level_gradient(testbed, "pi||ref")
    assert_close_to_rounding(_mean_gradient(testbed, grad, discount=1.0), sequence, ulps=ULPS)
    assert_close_to_rounding(_mean_gradient(testbed, grad, discount=0.0), local, ulps=ULPS)
    assert (sequence - local).abs().max() > 1e-2 * sequence.abs().max()


def test_discount_one_is_the_default_bit_for_bit():
    testbed = _testbed()
    for grad in ("cumulative", "rb"):
        assert torch.equal(
            _mean_gradient(testbed, grad, discount=1.0), _mean_gradient(testbed, grad)
        )


def test_discount_zero_cumulative_matches_token_per_sample():
    testbed = _testbed()
    tokens = testbed.draw(6, generator=klest.testbeds.make_generator(0))

    def grads(**options):
        s = testbed.evaluate(tokens)
        loss = klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, **options)
        return torch.autograd.grad(loss, testbed.logits)[0]

    actual = grads(grad="cumulative", discount=0.0)
    expected = grads(grad="token")
    assert_close_to_rounding(actual, expected, ulps=16)


# -- errors --------------------------------------------------------------------------------


def test_bad_options_are_refused_by_name():
    testbed = _testbed()
    s = testbed.sample(4, generator=klest.testbeds.make_generator(1))
    call = lambda **o: klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, **o)  # noqa: E731
    with pytest.raises(ValueError, match="discount must be in"):
        call(grad="cumulative", discount=1.5)
    with pytest.raises(TypeError, match="discount"):
        call(grad="cumulative", discount="0.5")
    with pytest.raises(ValueError, match=r"discount=0\.5 discounts"):
        call(grad="score", discount=0.5)
    with pytest.raises(ValueError, match=r"discount=0\.5 discounts"):
        call(grad="cumulative", discount=0.5, direction="ref||pi")
    w = torch.ones_like(s.logp)
    with pytest.raises(ValueError, match="weights has shape"):
        call(grad="cumulative", weights=w[:, :-1])
    with pytest.raises(ValueError, match="weights= weights each token"):
        call(grad="cumulative", weights=w, direction="ref||pi")
    with pytest.raises(ValueError, match="level='token'"):
        call(grad="score", weights=w, level="sequence")
    with pytest.raises(ValueError, match="on-policy"):
        call(grad="cumulative", weights=w, logp_behavior=s.logp.detach() - 0.1)
    bad = w.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weights is NaN"):
        call(grad="cumulative", weights=bad)


# -- power ---------------------------------------------------------------------------------


def _amari(lp: torch.Tensor, lr: torch.Tensor, alpha: float) -> torch.Tensor:
    """D_alpha(pi||ref) = (1 - sum_v pi^(1-alpha) ref^alpha) / (alpha (1 - alpha)) per row."""
    return -torch.expm1(torch.logsumexp((1 - alpha) * lp + alpha * lr, -1)) / (alpha * (1 - alpha))


@pytest.mark.parametrize("alpha", [0.5, 1.5])
def test_powered_token_gradient_is_the_alpha_divergences(alpha):
    """grad="token", power=alpha: sum_t E_{y<t}[grad D_alpha(pi_t||ref_t)], prefixes fixed."""
    testbed = _testbed()
    _tokens, valid, s, logp = _enumerated(testbed)
    prob = logp.sum(-1).exp().detach()
    d = torch.where(valid, _amari(s.logits, s.logits_ref, alpha), 0.0)
    expected = _flat_grad((prob * d.sum(-1)).sum(), testbed)
    assert_close_to_rounding(_mean_gradient(testbed, "token", power=alpha), expected, ulps=ULPS)


def test_power_one_token_gradient_is_the_token_local_reverse_kls():
    """At alpha = 1 the reward is 1 - ref/pi: per token, KL(ref||pi)'s gradient."""
    testbed = _testbed()
    expected = exact_token_level_gradient(testbed, "ref||pi")
    assert_close_to_rounding(_mean_gradient(testbed, "token", power=1.0), expected, ulps=ULPS)


@pytest.mark.parametrize("grad", ["score", "cumulative"])
@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_powered_sequence_gradient_holds_the_rewards_fixed(grad, alpha):
    """score / cumulative, power=alpha: grad_theta' E_{pi_theta'}[sum_u rho^(alpha)_u] with
    the rewards (1 - (ref_u/pi_u)^alpha)/alpha held fixed."""
    testbed = _testbed()
    _tokens, valid, s, logp = _enumerated(testbed)
    rho = torch.where(valid, s.logp - s.logp_ref, 0.0).detach()
    rewards = -torch.expm1(-alpha * rho) / alpha
    expected = _flat_grad((logp.sum(-1).exp() * rewards.sum(-1)).sum(), testbed)
    actual = _mean_gradient(testbed, grad, power=alpha)
    assert_close_to_rounding(actual, expected, ulps=ULPS)
    sequence_kl = torch.cat([g.reshape(-1) for g in testbed.exact_kl_grad("pi||ref")])
    assert (actual - sequence_kl).abs().max() > 1e-2 * sequence_kl.abs().max()


def test_power_is_refused_where_it_means_nothing():
    testbed = _testbed()
    s = testbed.sample(4, generator=klest.testbeds.make_generator(1))
    call = lambda **o: klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, **o)  # noqa: E731
    with pytest.raises(ValueError, match="power must be a finite float >= 0"):
        call(power=-0.5)
    with pytest.raises(TypeError, match="power must be a float"):
        call(power=None)
    for options in (
        {"grad": "rb", "estimator": "rb", "logits": s.logits, "logits_ref": s.logits_ref},
        {"direction": "ref||pi"},
        {"logp_behavior": s.logp.detach() - 0.1},
    ):
        with pytest.raises(ValueError, match=r"power=0\.5 transforms"):
            call(power=0.5, **options)
    with pytest.raises(ValueError, match="power= and weights="):
        call(power=0.5, weights=torch.ones_like(s.logp))
