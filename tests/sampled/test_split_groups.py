"""Baselines computed where the whole group is visible keep the gradient unbiased, exactly.

On an enumerable tabular policy (V = 3 with an end token, T = 2: 7 sequences), every ordered
pair of samples of one prompt is enumerated with its probability. Each sample's loss takes the
baseline that :func:`klest.group_baselines` computed from the pair's targets
(:func:`klest.penalty_targets`), as a trainer that puts the two samples on different ranks
would. The probability-weighted mean gradient must equal the exact gradient of the KL: float64
sums over 49 pairs, so within 1e-12 of the gradient's scale.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import klest
from klest.testbeds import TabularAutoregressive


@pytest.mark.parametrize(
    ("grad", "direction"),
    [("cumulative", "pi||ref"), ("score", "pi||ref"), ("rb", "pi||ref"), ("cumulative", "ref||pi")],
)
def test_split_group_baselines_give_the_exact_gradient_in_expectation(grad, direction):
    tb = TabularAutoregressive.random(3, 2, eos=2, seed=4, scale=1.5)
    tokens, _ = tb.all_sequences()
    total = None
    for i, j in itertools.product(range(len(tokens)), repeat=2):
        s = tb.evaluate(tokens[[i, j]])
        weight = torch.exp((s.logp * s.mask).sum(-1)).prod().detach()  # p_i p_j
        kw = {"logits": s.logits, "logits_ref": s.logits_ref} if grad == "rb" else {}
        t = klest.penalty_targets(
            s.logp.detach(), s.logp_ref, grad=grad, direction=direction, mask=s.mask, **kw
        )
        b = klest.group_baselines(t.targets, mask=t.mask, group=torch.tensor([0, 0]))
        loss = 0.0
        for row in ([0], [1]):  # each sample alone, as on its own rank
            piece_kw = {k: v[row] for k, v in kw.items()}
            loss = loss + klest.kl_penalty(
                s.logp[row],
                s.logp_ref[row],
                estimator="rb" if grad == "rb" else "k3",
                grad=grad,
                direction=direction,
                mask=s.mask[row],
                baseline=b[row].reshape(-1) if grad == "score" else b[row],
                reduction="sum",
                **piece_kw,
            )
        total = weight * loss / 2 if total is None else total + weight * loss / 2
    (got,) = torch.autograd.grad(total, tb.parameters())
    (exact,) = tb.exact_kl_grad(direction)
    scale = float(exact.abs().max())
    assert float((got - exact).abs().max()) <= 1e-12 * max(scale, 1.0)
    assert scale > 1e-3  # a gradient far from 0: the comparison has something to compare


def test_a_baseline_that_includes_the_sample_is_biased():
    """The check above has power: with kind="mean" (the sample's own target included) the
    same enumeration misses the exact gradient."""
    tb = TabularAutoregressive.random(3, 2, eos=2, seed=4, scale=1.5)
    tokens, _ = tb.all_sequences()
    total = 0.0
    for i, j in itertools.product(range(len(tokens)), repeat=2):
        s = tb.evaluate(tokens[[i, j]])
        weight = torch.exp((s.logp * s.mask).sum(-1)).prod().detach()
        t = klest.penalty_targets(s.logp.detach(), s.logp_ref, mask=s.mask)
        b = klest.group_baselines(t.targets, mask=t.mask, group=torch.tensor([0, 0]), kind="mean")
        loss = klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, baseline=b, reduction="sum")
        total = total + weight * loss / 2
    (got,) = torch.autograd.grad(total, tb.parameters())
    (exact,) = tb.exact_kl_grad("pi||ref")
    assert float((got - exact).abs().max()) > 1e-3 * float(exact.abs().max())


def test_a_given_baseline_is_checked_by_shape_and_detached():
    logp = -torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"one per token, the log-probs' shape: \(3, 4\)"):
        klest.kl_penalty(logp, logp.detach() * 0.5, baseline=torch.zeros(3))
    with pytest.raises(ValueError, match=r"one per sequence: \(3,\)"):
        klest.kl_penalty(logp, logp.detach() * 0.5, grad="score", baseline=torch.zeros(3, 4))
    b = torch.ones(3, 4, dtype=torch.float64, requires_grad=True)
    klest.kl_penalty(logp, logp.detach() * 0.5, baseline=b).backward()
    assert b.grad is None  # the baseline passes no gradient
    with pytest.raises(ValueError, match="takes no baseline"):
        klest.penalty_targets(logp, logp.detach(), grad="token")
