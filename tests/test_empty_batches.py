"""A batch with no valid token gives 0 with a zero gradient, for every sampled-token function.

The README's trainer-batch rule ("a batch with no valid token gives 0 with a zero gradient;
``details.diagnostics.n_empty_rows`` counts them"), checked beyond :func:`klest.aggregate`
(``tests/test_aggregation.py``): through each value estimator, each valid gradient estimator
and baseline of :func:`klest.kl_penalty` (sampled tokens, with logits where the estimator needs
them), :func:`klest.kl_reward` and the divergences to the rollout policy
(:mod:`klest.sampled.trust_region`). Deterministic: the answers are exact zeros, not estimates.
The exact-from-logits functions have their own empty-batch tests (``tests/logits``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import klest
from klest.testbeds import make_generator

B, T, V = 4, 5, 7
SCALAR_REDUCTIONS = ("seq-mean-token-sum", "token-mean", "seq-mean-token-mean", "sum")
# (grad, baseline) pairs kl_penalty accepts for sampled tokens and KL(pi||ref)
PENALTIES = [
    ("score", None),
    ("score", "loo"),
    ("score", "loo-fitted"),
    ("score", "mean"),
    ("cumulative", None),
    ("cumulative", "loo"),
    ("cumulative", "loo-fitted"),
    ("cumulative", "mean"),
    ("cumulative", "exact-kl"),
    ("cumulative", "exact-kl+loo"),
    ("rb", None),
    ("rb", "loo"),
    ("rb", "loo-fitted"),
    ("token", None),
    ("token", "exact-kl"),
    ("autodiff", None),
]


def _batch():
    g = make_generator(0)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    logits_ref = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    logp_ref = torch.log_softmax(logits_ref, -1).gather(-1, labels[..., None])[..., 0]
    return logits, logits_ref, logp, logp_ref, torch.zeros(B, T, dtype=torch.bool)


def _assert_zero_with_zero_gradient(value, leaf):
    (grad,) = torch.autograd.grad(value, [leaf])
    assert float(value.detach()) == 0.0
    assert bool(torch.isfinite(grad).all()) and float(grad.abs().max()) == 0.0


@pytest.mark.parametrize("reduction", SCALAR_REDUCTIONS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "rb"])
@pytest.mark.parametrize(("grad", "baseline"), PENALTIES)
def test_kl_penalty_of_an_all_empty_batch_is_zero_with_a_zero_gradient(
    grad, baseline, estimator, reduction
):
    logits, logits_ref, logp, logp_ref, mask = _batch()
    options = {"logits": logits, "logits_ref": logits_ref}
    if baseline is not None:
        options.update(baseline=baseline, group=torch.tensor([0, 0, 1, 1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the biased choices (token, autodiff) warn by design
        value, details = klest.kl_penalty(
            logp,
            logp_ref,
            mask=mask,
            estimator=estimator,
            grad=grad,
            reduction=reduction,
            return_details=True,
            **options,
        )
    assert details.diagnostics.n_empty_rows == B
    _assert_zero_with_zero_gradient(value, logits)


@pytest.mark.parametrize("reduction", SCALAR_REDUCTIONS)
@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
@pytest.mark.parametrize(
    ("estimator", "options"),
    [
        ("k1", {}),
        ("k2", {}),
        ("k3", {}),
        ("abs", {}),
        ("cv", {"alpha": "loo"}),
        ("cv", {"alpha": "crossfit"}),
        ("cv", {"alpha": 0.5}),
    ],
)
def test_value_estimators_of_an_all_empty_batch_are_zero_with_a_zero_gradient(
    estimator, options, direction, reduction
):
    logits, _, logp, logp_ref, mask = _batch()
    value, details = klest.kl_estimate(
        logp,
        logp_ref,
        mask=mask,
        estimator=estimator,
        direction=direction,
        reduction=reduction,
        return_details=True,
        **options,
    )
    assert details.diagnostics.n_empty_rows == B
    _assert_zero_with_zero_gradient(value, logits)


@pytest.mark.parametrize("reward_to_go", [False, True])
def test_kl_reward_of_an_all_empty_batch_is_zero_everywhere(reward_to_go):
    _, _, logp, logp_ref, mask = _batch()
    rewards = klest.kl_reward(logp.detach(), logp_ref, mask=mask, reward_to_go=reward_to_go)
    assert rewards.shape == (B, T) and torch.equal(rewards, torch.zeros_like(rewards))


@pytest.mark.parametrize("reduction", SCALAR_REDUCTIONS)
@pytest.mark.parametrize(
    "name",
    ["binary_tv", "binary_kl", "topk_tv", "topk_kl", "squared_log_ratio", "squared_prob_shift"],
)
def test_rollout_divergences_of_an_all_empty_batch_are_zero_with_a_zero_gradient(name, reduction):
    logits, logits_ref, logp, logp_ref, mask = _batch()
    fn = getattr(klest, name)
    options = {"mask": mask, "reduction": reduction, "return_details": True}
    if name.startswith("topk"):
        top, ids = torch.log_softmax(logits_ref, -1).topk(3, dim=-1)
        options.update(topk_logp_rollout=top, logits=logits, topk_ids=ids)
    value, details = fn(logp, logp_ref, **options)
    assert details.diagnostics.n_empty_rows == B
    _assert_zero_with_zero_gradient(value, logits)
    keep = klest.dppo_mask(logp, logp_ref, torch.ones(B, dtype=logp.dtype), delta=0.1, mask=mask)
    assert not keep.any()
