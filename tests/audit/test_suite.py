"""The top-k and trust-region sections of the audit suite: their estimate functions against
the definitions written out, and the audits' verdicts (unbiased rows unbiased, the bounds below
the divergence)."""

from __future__ import annotations

import pytest
import torch

from klest.audit import (
    TOPK_AUDIT,
    TRUST_REGION_AUDIT,
    audit_grad,
    audit_value,
    sampler_testbed,
    topk_estimate_fn,
    trust_region_audit_section,
    trust_region_estimate_fn,
)
from klest.testbeds import CategoricalTestbed, make_generator
from tests._stats import RATE, z_for
from tests._tolerance import assert_close_to_rounding


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


def test_trust_region_estimates_read_the_rollout_sample():
    """sampler_testbed draws from the rollout (its behavior log-probs are the target's ref); the
    unbiased references are 1/2 |r - 1| and r - 1 - log r (r log r - r + 1 for pi||rollout) of
    r = pi / rollout, written out here. Tolerance: 8 float64 ulps of the terms (r and log r)."""
    tb = sampler_testbed(seed=1)
    s = tb.sample(6, generator=make_generator(0))
    assert torch.equal(s.logp_behavior, s.logp_ref)
    r = (s.logp.detach() - s.logp_ref).exp()
    scale = float(r.max() + (r.log()).abs().max() + 1)
    cases = {
        ("half-abs-ratio", "rollout||pi"): 0.5 * (r - 1).abs(),
        ("k3", "rollout||pi"): r - 1 - r.log(),
        ("k3", "pi||rollout"): r * r.log() - r + 1,
    }
    for (name, direction), want in cases.items():
        got = trust_region_estimate_fn(name, direction=direction)(s).detach()
        assert_close_to_rounding(got, want, ulps=8, scale=scale, what=name)


def test_trust_region_section_tables():
    """The exact tables: the unbiased estimates' mean is the full divergence and their mean
    gradient its gradient (to rounding); binary <= top-k < full, both KLs and the TV; every mean
    gradient of a biased estimate is measurably off the full divergence's; the token sums of k3
    over sequences are the sequence KL(rollout||pi), binary <= top-k below it. The Monte Carlo
    table: k3 within z of the KL, the binary KL far below it (z: Bonferroni at RATE over the 4
    comparisons)."""
    text = trust_region_audit_section(quick=True)
    z = z_for(RATE, 4)
    exact = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 9 and cells[0] != "estimate" and not cells[0].startswith("---"):
            exact[cells[0]] = [float(c) for c in cells[2:]]
    assert len(exact) == len(TRUST_REGION_AUDIT) + 3
    for name in ("half-abs-ratio", "k3 (rollout||pi)", "k3 (pi||rollout)", "squared-prob-shift"):
        full, mean, _, _, _, _, rel = exact[name]
        assert mean == pytest.approx(full, rel=1e-4) and rel < 1e-10, name
    for kind in ("tv", "kl (rollout||pi)", "kl (pi||rollout)"):
        binary, topk = exact[f"binary-{kind}"], exact[f"topk-{kind}"]
        assert binary[1] <= topk[1] < topk[0], kind
        assert binary[-1] > 1e-2 and topk[-1] > 1e-2, kind
    seq = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 6 and cells[0].endswith("(rollout||pi)"):
            seq[cells[0].split()[0]] = [float(c) for c in cells[1:]]
    assert len(seq) == 4
    kl, mean, _, _, dist = seq["k3"]
    assert mean == pytest.approx(kl, rel=1e-4) and dist < 1e-10
    assert seq["binary-kl"][1] <= seq["topk-kl"][1] < kl
    mc = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells[0].startswith("sampler:") and cells[1].startswith("categorical"):
            mc[cells[0]] = float(cells[7])
    assert abs(mc["sampler:k3(rollout||pi)"]) <= z and abs(mc["sampler:k3(pi||rollout)"]) <= z
    assert mc["sampler:binary-kl(rollout||pi)"] < -z and mc["sampler:binary-kl(pi||rollout)"] < -z


def test_generalized_topk_row_is_the_restricted_kl_a_lower_bound():
    """The top-k section's ``generalized`` row on its own testbed (64 outcomes, top 6): every
    draw is the unnormalized KL of the measures restricted to the top-k, sum_S [p log(p/q) - p +
    q], written out here, and so is its gradient (autograd of that sum); it sits below the
    tail bucket, which sits below the KL; the audit calls the value's bias significant and the
    gradient "biased: neither KL" (deterministic draws: exact verdicts, no threshold).
    Tolerance: 6 terms of a few roundings each at the scale of the largest term: 64 ulps."""
    assert "generalized" in TOPK_AUDIT
    tb = CategoricalTestbed.random(64, scale=2.0, seed=0)
    top = torch.log_softmax(tb.logits_ref, -1).topk(6)
    for direction in ("pi||ref", "ref||pi"):
        a, b = torch.log_softmax(tb.logits, -1)[top.indices], top.values
        p, q = (a, b) if direction == "pi||ref" else (b, a)
        want = (p.exp() * (p - q) - p.exp() + q.exp()).sum()
        (want_grad,) = torch.autograd.grad(want, tb.logits)
        fn = topk_estimate_fn("generalized", tb, k=6, direction=direction)
        v = audit_value(fn, tb, direction=direction, batch_size=16, n_trials=3)
        bound = topk_estimate_fn("tail-bucket", tb, k=6, direction=direction)
        t = audit_value(bound, tb, direction=direction, batch_size=4, n_trials=3)
        scale = float((p.exp().max() + (p - q).abs().max()).detach())
        assert_close_to_rounding(torch.tensor(v.mean), want.detach(), ulps=64, scale=scale)
        assert v.std == 0 and v.significant and v.mean < t.mean < v.exact, (v, t)
        g = audit_grad(lambda s, fn=fn: fn(s).mean(), tb, direction=direction, n_trials=3)
        assert g.verdict == "biased: neither KL" and g.variance == 0, g
        assert_close_to_rounding(g.mean_grad, want_grad.double(), ulps=64)
