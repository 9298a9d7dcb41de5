"""The top-k section of the audit suite: its estimate functions against kl_from_topk's
definition, and the audit's verdicts (unbiased rows unbiased, the bound below the KL)."""

from __future__ import annotations

import torch

from klest.audit import audit_grad, audit_value, topk_estimate_fn
from klest.testbeds import CategoricalTestbed, make_generator
from tests._stats import RATE, z_for


def test_estimate_fn_reads_the_teachers_top_k_and_the_sample():
    """The function's per-sample values are the tail-bucket formula written out by hand."""
    tb = CategoricalTestbed.random(12, scale=2.0, seed=3)
    s = tb.sample(5, generator=make_generator(0))
    got = topk_estimate_fn("tail-bucket", tb, k=3, direction="pi||ref")(s).detach()
    lq = torch.log_softmax(tb.logits.detach(), -1)
    lp = torch.log_softmax(tb.logits_ref, -1)
    top = lp.topk(3).indices
    q, p = lq.exp()[top], lp.exp()[top]
    want = (q * (q / p).log()).sum() + (1 - q.sum()) * ((1 - q.sum()) / (1 - p.sum())).log()
    assert torch.allclose(got, want.expand(5), atol=1e-12)


def test_unbiased_rows_pass_and_the_bound_is_below():
    """audit_value: "unbiased" within z of the exact KL in both directions, "tail-bucket" below
    it; audit_grad: "unbiased-cv"'s mean gradient within the threshold of the exact gradient.
    Thresholds: Bonferroni at RATE (6.3e-5) over the 4 comparisons (2 values two-sided, 2
    gradient statistics one-sided)."""
    tb = CategoricalTestbed.random(30, scale=2.0, seed=1)
    z_two, z_one = z_for(RATE, 4), z_for(RATE, 4, two_sided=False)
    for direction in ("pi||ref", "ref||pi"):
        fn = topk_estimate_fn("unbiased", tb, k=4, direction=direction)
        a = audit_value(fn, tb, direction=direction, batch_size=16, n_trials=300, seed=2)
        assert abs(a.z) <= z_two, a
        bound = topk_estimate_fn("tail-bucket", tb, k=4, direction=direction)
        b = audit_value(bound, tb, direction=direction, batch_size=4, n_trials=3)
        assert b.mean < b.exact
        cv = topk_estimate_fn("unbiased-cv", tb, k=4, direction=direction)
        g = audit_grad(
            lambda s, cv=cv: cv(s).mean(), tb, direction=direction, batch_size=8, n_trials=300
        )
        assert g.z_target <= z_one, g
        assert g.z_zero > z_one  # the test has power: the gradient is far from 0
