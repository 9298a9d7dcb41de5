"""Off-policy samples at the edges: behavior samples pi cannot produce, and prefix weights that
underflow. Every estimator gives finite values and gradients there, and the audit-style means
stay those of the exact answers (tests/sampled/test_penalty.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import klest
from klest.testbeds import make_generator
from tests._reference import random_log_probs


def _batch(seed=0):
    g = make_generator(seed)
    logp = random_log_probs((4, 5), g, scale=2.0)
    logp[1, 2] = -math.inf  # behavior sampled a token pi gives probability 0
    logp_ref = random_log_probs((4, 5), g, scale=2.0)
    logp_behavior = random_log_probs((4, 5), g, scale=2.0)
    logits = torch.randn(4, 5, 6, generator=g, dtype=torch.float64)
    return logp.requires_grad_(), logp_ref, logp_behavior, logits


# Every estimator with each baseline it takes ("token", and "rb" for KL(ref||pi), take none).
_COMBINATIONS = [
    (grad, baseline, direction)
    for grad in ("score", "cumulative", "token", "rb")
    for baseline in (None, "loo", "ema")
    for direction in ("pi||ref", "ref||pi")
    if not baseline or not (grad == "token" or (grad == "rb" and direction == "ref||pi"))
]


@pytest.mark.parametrize(("grad", "baseline", "direction"), _COMBINATIONS)
def test_a_sample_pi_cannot_produce_gives_finite_values_and_gradients(grad, baseline, direction):
    logp, logp_ref, logp_behavior, logits = _batch()
    logits_ref = torch.randn(4, 5, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", klest.KLGradientWarning)
        loss = klest.kl_penalty(
            logp,
            logp_ref,
            logp_behavior=logp_behavior,
            grad=grad,
            direction=direction,
            baseline=klest.BaselineEMA() if baseline == "ema" else baseline,
            group=torch.tensor([0, 0, 1, 1]) if baseline == "loo" else None,
            logits=logits.requires_grad_(),
            logits_ref=logits_ref,
        )
    loss.backward()
    # (rb for KL(ref||pi) is pathwise through the logits only: no gradient reaches logp.)
    grad_logp = torch.zeros_like(logp) if logp.grad is None else logp.grad
    assert torch.isfinite(loss) and torch.isfinite(grad_logp).all()
    if grad == "rb":
        assert torch.isfinite(logits.grad).all()
    assert float(grad_logp[1, 2]) == 0.0  # no score where pi has no mass


def test_rb_value_off_policy_is_finite_where_pi_cannot_produce_the_prefix():
    logp, logp_ref, logp_behavior, logits = _batch(1)
    for direction in ("pi||ref", "ref||pi"):
        per_token = klest.kl_estimate(
            logp,
            logp_ref,
            estimator="rb",
            direction=direction,
            logp_behavior=logp_behavior,
            logits=logits,
            logits_ref=torch.randn(4, 5, 6, dtype=torch.float64),
            reduction="none",
        )
        assert torch.isfinite(per_token).all()
        # The prefix weight W_{<n} is 0 after the token pi cannot produce.
        assert float(per_token[1, 3:].abs().max()) == 0.0


@pytest.mark.parametrize("baseline", ["loo", "ema"])
def test_prefix_weights_that_underflow_poison_no_baseline(baseline):
    """200 tokens of log-weight -0.59: W underflows float32 (e^-118) by the end of each row."""
    logp = torch.full((4, 200), -0.6, requires_grad=True)
    logp_ref = torch.full((4, 200), -0.7)
    logp_behavior = torch.full((4, 200), -0.01)
    ema = klest.BaselineEMA() if baseline == "ema" else None
    for _ in range(2):
        loss = klest.kl_penalty(
            logp,
            logp_ref,
            logp_behavior=logp_behavior,
            baseline=ema if ema is not None else "loo",
        )
        (grad,) = torch.autograd.grad(loss, [logp])
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
    if ema is not None:
        assert torch.isfinite(ema.sums).all() and torch.isfinite(ema.weights).all()
