"""Divergences between pi and the rollout policy from the rollout's tokens, and their masks.

Exact answers only: every token of a categorical pair is enumerated under the rollout, so the
values, their means and the expected gradients are compared with formulas written out here (no
sampling, no statistical thresholds). Float tolerances are rounding bounds
(``tests._tolerance``) with the ulps stated at each call.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext

import pytest
import torch

import klest
from tests._tolerance import assert_close_to_rounding

F64 = torch.float64


def _pair(n: int = 9, *, shift: float = 0.6, seed: int = 0):
    """Logits of pi and of its rollout (pi's plus noise), float64."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=F64) * 1.5
    return z, z + shift * torch.randn(n, generator=g, dtype=F64)


def _all_tokens(z, zr):
    """log pi and log rollout of every token, pi's with graph to ``z``."""
    return torch.log_softmax(z, -1), torch.log_softmax(zr, -1)


def _bernoulli_kl_40_digits(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """KL(Bern(a)||Bern(b)) from the float64 log-probs, in 40-digit decimal arithmetic."""
    out = []
    with localcontext() as ctx:
        ctx.prec = 40
        for x, y in zip(la.tolist(), lb.tolist(), strict=True):
            a, b = Decimal(x).exp(), Decimal(y).exp()
            out.append(float(a * (a / b).ln() + (1 - a) * ((1 - a) / (1 - b)).ln()))
    return torch.tensor(out, dtype=F64)


def test_binary_values_are_the_bernoulli_divergences():
    """binary_tv is |p - q|; binary_kl is KL(Bern(q)||Bern(p)) for "rollout||pi" (the default,
    DPPO's) and KL(Bern(p)||Bern(q)) for "pi||rollout", at every token of 3 random pairs, against
    40-digit decimal arithmetic on the same float64 inputs. Tolerance: 16 float64 ulps of each
    value (klest's terms are non-negative, each a few roundings; the log-ratio's rounding costs
    2 ulps relative)."""
    for seed in range(3):
        lp, lq = _all_tokens(*_pair(seed=seed))
        p, q = lp.exp(), lq.exp()
        assert_close_to_rounding(klest.binary_tv(lp, lq, reduction="none"), (p - q).abs(), ulps=8)
        for direction, (la, lb) in (("rollout||pi", (lq, lp)), ("pi||rollout", (lp, lq))):
            want = _bernoulli_kl_40_digits(la.detach(), lb.detach())
            got = klest.binary_kl(lp, lq, direction=direction, reduction="none")
            assert_close_to_rounding(got, want, ulps=16, scale=want.abs(), what=direction)
        default = klest.binary_kl(lp, lq, reduction="none")
        explicit = klest.binary_kl(lp, lq, direction="rollout||pi", reduction="none")
        assert torch.equal(default, explicit)


def _partition_reference(p, q, members):
    """TV and both KLs over {each member} + {the rest}, written out."""
    rest = [v for v in range(p.numel()) if v not in members]
    a, b = q[members], p[members]
    ar, br = q[rest].sum(), p[rest].sum()
    tv = 0.5 * ((a - b).abs().sum() + (ar - br).abs())

    def kl(x, y, xr, yr):
        return (x * (x / y).log()).sum() + (xr * (xr / yr).log() if xr > 0 else 0.0)

    return tv, kl(a, b, ar, br), kl(b, a, br, ar)


def test_topk_values_are_the_partition_divergences():
    """topk_tv / topk_kl over {rollout's top-k} + {sampled token} + {rest} equal the formulas over
    that partition written out, for every sampled token, with pi's log-probs gathered from logits
    (``labels`` add the sampled token) and given as ``topk_logp`` (ids that hold the sampled
    token already, as DPPO's rollout stores them). Tolerance: 64 float64 ulps of the sum of the
    terms' sizes (each term a few roundings; up to k + 2 terms)."""
    z, zr = _pair(11, seed=3)
    lp, lq = _all_tokens(z, zr)
    p, q = lp.exp(), lq.exp()
    k = 3
    top, ids = lq.topk(k)
    for y in range(z.numel()):
        members = sorted(set(ids.tolist()) | {y})
        tv, kl_rp, kl_pr = _partition_reference(p, q, members)
        ys = torch.tensor([y])
        common = {"topk_ids": ids[None], "labels": ys, "reduction": "none"}
        got_tv = klest.topk_tv(lp[ys], lq[ys], top[None], logits=z[None], **common)
        got_rp = klest.topk_kl(lp[ys], lq[ys], top[None], logits=z[None], **common)
        got_pr = klest.topk_kl(
            lp[ys], lq[ys], top[None], logits=z[None], direction="pi||rollout", **common
        )
        scale = (q + p).sum() * (1 + lq.abs().max() + lp.abs().max())
        for got, want in ((got_tv, tv), (got_rp, kl_rp), (got_pr, kl_pr)):
            assert_close_to_rounding(got, want.reshape(1), ulps=64, scale=scale, what=f"y={y}")
        # The stored form: k ids that include the sampled token, pi's log-probs given.
        stored = torch.tensor(members[-k:] if y in members[-k:] else [*members[: k - 1], y])
        tv_s, kl_s, _ = _partition_reference(p, q, sorted(stored.tolist()))
        got = klest.topk_kl(lp[ys], lq[ys], lq[stored][None], topk_logp=lp[stored][None])
        assert_close_to_rounding(got, kl_s, ulps=64, scale=scale)
        got = klest.topk_tv(lp[ys], lq[ys], lq[stored][None], topk_logp=lp[stored][None])
        assert_close_to_rounding(got, tv_s, ulps=64, scale=scale)


def test_binary_and_topk_are_lower_bounds_token_by_token():
    """binary <= top-k <= the full-vocabulary divergence for every sampled token (the partitions
    refine one another: the data-processing inequality), TV and both KLs, on 4 pairs; equality
    for the top-k when its partition is the whole vocabulary (k = V - 1 plus the token).
    Margin: 1e-12 (float64 rounding of values of order 0.1)."""
    for seed in range(4):
        z, zr = _pair(8, shift=1.0, seed=seed)
        lp, lq = _all_tokens(z, zr)
        p, q = lp.exp(), lq.exp()
        full = {
            "tv": 0.5 * (p - q).abs().sum(),
            "rollout||pi": (q * (lq - lp)).sum(),
            "pi||rollout": (p * (lp - lq)).sum(),
        }
        top, ids = lq.topk(2)
        args = {"logits": z.expand(8, -1), "topk_ids": ids.expand(8, -1), "reduction": "none"}
        labels = torch.arange(8)
        binary = {
            "tv": klest.binary_tv(lp, lq, reduction="none"),
            **{
                d: klest.binary_kl(lp, lq, direction=d, reduction="none") for d in full if d != "tv"
            },
        }
        topk = {"tv": klest.topk_tv(lp, lq, top.expand(8, -1), labels=labels, **args)}
        for d in ("rollout||pi", "pi||rollout"):
            topk[d] = klest.topk_kl(lp, lq, top.expand(8, -1), labels=labels, direction=d, **args)
        for key, value in full.items():
            assert (binary[key] <= topk[key] + 1e-12).all(), (seed, key)
            assert (topk[key] <= value + 1e-12).all(), (seed, key)
            assert (binary[key] < value - 1e-6).all(), (seed, key)
        every, ids_all = lq.topk(7)
        exact = klest.topk_kl(
            lp,
            lq,
            every.expand(8, -1),
            logits=z.expand(8, -1),
            topk_ids=ids_all.expand(8, -1),
            labels=labels,
            reduction="none",
        )
        assert_close_to_rounding(exact, full["rollout||pi"].expand(8), ulps=64)


def _expected_gradient(values, lq, z):
    """sum_y rollout(y) grad values(y): the exact mean gradient over the rollout's tokens."""
    (g,) = torch.autograd.grad((lq.exp() * values).sum(), z, retain_graph=True)
    return g


def test_expected_gradients_are_those_of_their_own_means():
    """Enumerating the token under the rollout, each estimate's mean gradient (w.r.t. pi's
    logits z; d pi_y / dz = pi_y (e_y - pi)) is the closed form written here:

    - binary TV: sum_y mu_y sign(pi_y - mu_y) pi_y (e_y - pi); not the TV's gradient
      (1/2) sum_y sign(pi_y - mu_y) pi_y (e_y - pi) (relative distance > 0.1 here);
    - binary KL(rollout||pi): sum_y mu_y (pi_y - mu_y) / (1 - pi_y) (e_y - pi);
    - binary KL(pi||rollout): sum_y mu_y (log(pi_y/mu_y) - log((1-pi_y)/(1-mu_y))) pi_y (e_y - pi);
    - tau (log r)^2: 2 tau sum_y mu_y log(pi_y/mu_y) (e_y - pi);
    - squared_prob_shift: 2 sum_y (pi_y - mu_y) pi_y (e_y - pi), the gradient of sum (pi - mu)^2;
    - klest.k3 with the rollout as the sampler: pi - mu, the gradient of the full KL(rollout||pi).

    Tolerance: 256 float64 ulps of sum_y mu_y |coefficient_y| (the size of the summed terms)."""
    z, zr = _pair(9, shift=0.8, seed=5)
    z = z.clone().requires_grad_()
    lp, lq = _all_tokens(z, zr)
    pi, mu = lp.exp().detach(), lq.exp()
    jac = torch.diag(pi) - pi[:, None] * pi[None, :]  # row y: d pi_y / dz

    def closed(coef):  # sum_y coef_y d pi_y / dz, with its scale
        return coef @ jac, float((coef.abs() * pi).sum())

    sign = torch.sign(pi - mu)
    cases = {
        "binary_tv": (klest.binary_tv(lp, lq, reduction="none"), closed(mu * sign)),
        "binary_kl": (
            klest.binary_kl(lp, lq, reduction="none"),
            closed(mu * (pi - mu) / (pi * (1 - pi))),
        ),
        "squared_log_ratio": (
            klest.squared_log_ratio(lp, lq, tau=0.3, reduction="none"),
            closed(2 * 0.3 * mu * (lp.detach() - lq) / pi),
        ),
        "squared_prob_shift": (
            klest.squared_prob_shift(lp, lq, reduction="none"),
            closed(2 * (pi - mu)),
        ),
        "binary_kl_pi_first": (
            klest.binary_kl(lp, lq, direction="pi||rollout", reduction="none"),
            closed(mu * ((lp.detach() - lq) - torch.log((1 - pi) / (1 - mu)))),
        ),
        "k3_swapped": (klest.k3(lq, lp, reduction="none"), (pi - mu, 1.0)),
    }
    for name, (values, (want, scale)) in cases.items():
        got = _expected_gradient(values, lq, z)
        assert_close_to_rounding(got, want, ulps=256, scale=scale, what=name)
    tv_grad = 0.5 * sign @ jac
    binary_tv_grad = _expected_gradient(cases["binary_tv"][0], lq, z)
    assert float((binary_tv_grad - tv_grad).norm() / tv_grad.norm()) > 0.1


def test_topk_expected_gradients_are_those_of_the_partition_divergences():
    """Enumerating the token under the rollout, the mean gradient (w.r.t. pi's logits) of
    topk_tv and of topk_kl in both directions is the gradient of sum_y mu_y D_S(y)(pi, mu), D
    the partition formula written out (_partition_reference, autodiff through pi = softmax(z));
    pi's top-k log-probs gathered from ``logits`` with ``labels``, and given as ``topk_logp``
    over ids that hold the sampled token. Not the full divergence's gradient (distance > 1e-3).
    Tolerance: 256 float64 ulps of 1 (each mean gradient is a sum over 9 tokens of up to k + 2
    terms of order 1, each a few roundings)."""
    z, zr = _pair(9, shift=0.8, seed=6)
    z = z.clone().requires_grad_()
    lp, lq = _all_tokens(z, zr)
    p, q = lp.exp(), lq.exp()
    k = 3
    top, ids = lq.topk(k)
    n = z.numel()
    labels = torch.arange(n)
    got_args = {"logits": z.expand(n, -1), "topk_ids": ids.expand(n, -1), "labels": labels}
    refs = [_partition_reference(p, q, sorted(set(ids.tolist()) | {y})) for y in range(n)]
    # The stored form: the sampled token in the last of the k slots when not among the top k.
    stored = torch.stack(
        [ids if y in ids else torch.cat([ids[:-1], ids.new_tensor([y])]) for y in range(n)]
    )
    stored_refs = [_partition_reference(p, q, sorted(stored[y].tolist())) for y in range(n)]
    full = {
        "tv": 0.5 * (p - q).abs().sum(),
        "rollout||pi": (q * (lq - lp)).sum(),
        "pi||rollout": (p * (lp - lq)).sum(),
    }
    for i, (name, direction) in enumerate(
        (("tv", None), ("kl", "rollout||pi"), ("kl", "pi||rollout"))
    ):
        fn = klest.topk_tv if name == "tv" else klest.topk_kl
        kw = {} if direction is None else {"direction": direction}
        want = _expected_gradient(torch.stack([r[i] for r in refs]), lq, z)
        got = _expected_gradient(
            fn(lp, lq, top.expand(n, -1), reduction="none", **got_args, **kw), lq, z
        )
        assert_close_to_rounding(got, want, ulps=256, scale=1.0, what=f"{name} {direction}")
        want_s = _expected_gradient(torch.stack([r[i] for r in stored_refs]), lq, z)
        got_s = _expected_gradient(
            fn(lp, lq, lq[stored], topk_logp=lp[stored], reduction="none", **kw), lq, z
        )
        assert_close_to_rounding(got_s, want_s, ulps=256, scale=1.0, what=f"stored {name}")
        (full_grad,) = torch.autograd.grad(full[direction or "tv"], z, retain_graph=True)
        assert float((got - full_grad).norm() / full_grad.norm()) > 1e-3


def test_sequence_sums_under_the_rollout():
    """Sequences of a tabular autoregressive pair (V = 4, T = 3, eos; the testbed's ref is the
    rollout), every sequence enumerated under the rollout, token values summed per sequence
    (``reduction="per-sequence"``):

    - k3 with the rollout as the sampler: mean and mean gradient are the sequence-level
      KL(rollout||pi) and its gradient (the chain rule; the testbed's exact_kl("ref||pi"));
    - for every sequence, binary KL <= top-1 KL <= the sum of the full per-position
      KL(rollout_t||pi_t), written out from the next-token log-probs;
    - binary KL's mean gradient is that of sum_seq mu(seq) sum_t KL(Bern(q_t)||Bern(p_t)),
      written out.

    Tolerances: 256 float64 ulps of 1 (sums over 40 sequences of terms of order 1); margin of the
    bounds 1e-12 (float64 rounding of values of order 0.1)."""
    base = klest.testbeds.TabularAutoregressive.random(4, 3, eos=3, seed=2, scale=1.5)
    g = torch.Generator().manual_seed(3)
    shifted = base.logits.detach() + 0.5 * torch.randn(base.logits.shape, generator=g, dtype=F64)
    tb = klest.testbeds.TabularAutoregressive(
        base.logits.detach().clone().requires_grad_(), shifted, horizon=3, eos=3
    )
    tokens, _ = tb.all_sequences()
    s = tb.evaluate(tokens)
    lp, lq, mask = s.logp, s.logp_ref, s.mask
    weights = torch.where(mask, lq, 0.0).sum(-1).exp()
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-12)

    def mean_and_grad(per_seq):
        mean = (weights * per_seq).sum()
        (grad,) = torch.autograd.grad(mean, tb.logits, retain_graph=True)
        return mean, grad

    k3 = klest.k3(lq, lp, mask=mask, reduction="per-sequence")
    exact = tb.exact_kl("ref||pi")
    (exact_grad,) = torch.autograd.grad(exact, tb.logits, retain_graph=True)
    mean, grad = mean_and_grad(k3)
    assert_close_to_rounding(mean, exact, ulps=256, scale=1.0)
    assert_close_to_rounding(grad, exact_grad, ulps=256, scale=1.0)

    top, ids = s.logits_ref.detach().topk(1, dim=-1)
    binary = klest.binary_kl(lp, lq, mask=mask, reduction="per-sequence")
    topk = klest.topk_kl(
        lp,
        lq,
        top,
        logits=s.logits,
        topk_ids=ids,
        labels=tokens,
        mask=mask,
        reduction="per-sequence",
    )
    full_t = (s.logits_ref.exp() * (s.logits_ref - s.logits)).sum(-1)
    full = torch.where(mask, full_t, 0.0).sum(-1)
    assert (binary <= topk + 1e-12).all() and (topk <= full + 1e-12).all()
    assert (binary < full - 1e-6).any()

    p, q = lp.exp(), lq.exp()
    bern = q * (lq - lp) + (1 - q) * torch.log((1 - q) / (1 - p))
    _, want = mean_and_grad(torch.where(mask, bern, 0.0).sum(-1))
    _, got = mean_and_grad(binary)
    assert_close_to_rounding(got, want, ulps=256, scale=1.0)


def test_float32_matches_float64_near_equal_policies():
    """No cancellation: at log-ratios 1e-6 to 1e-2, float32 binary / top-k KL and the squared
    shift agree with float64 on the same (float32-rounded) inputs to 64 float32 ulps of the value
    (the naive two-term formula loses ~eps / delta^2 relative)."""
    for q0 in (1e-5, 0.02, 0.5, 0.99):
        for d in (1e-6, 1e-4, 1e-2):
            lq = torch.tensor([math.log(q0)]).float()
            lp = (lq.double() + d * (1 if q0 < 0.9 else -1)).float()
            for fn in (klest.binary_kl, klest.squared_prob_shift):
                want = fn(lp.double(), lq.double(), reduction="none")
                got = fn(lp, lq, reduction="none")
                assert_close_to_rounding(got, want, ulps=64, dtype=torch.float32, what=str((q0, d)))
            ids = torch.tensor([[0, 1]])
            top_q = torch.stack([lq, torch.log1p(-lq.exp()) - math.log(2)], -1)
            top_p = torch.stack([lp, torch.log1p(-lp.exp()) - math.log(2)], -1)
            want = klest.topk_kl(lp.double(), lq.double(), top_q.double(), topk_logp=top_p.double())
            got = klest.topk_kl(lp, lq, top_q, topk_logp=top_p)
            assert_close_to_rounding(got, want, ulps=64, dtype=torch.float32, what=f"topk {q0} {d}")
            assert ids.shape == (1, 2)


def test_limits_where_one_policy_is_certain():
    """q = 1: KL(Bern(q)||Bern(p)) = -log p; p = 1 > q, or p = 0: infinite; TV at p = 0 is q;
    a tiny q far below p stays finite."""
    lp, lq = torch.tensor([-0.5, 0.0, -math.inf]), torch.tensor([0.0, -0.5, -0.5])
    got = klest.binary_kl(lp, lq, reduction="none")
    assert got[0] == pytest.approx(0.5) and torch.isinf(got[1:]).all()
    assert klest.binary_tv(lp, lq, reduction="none")[2] == pytest.approx(math.exp(-0.5))
    # A rollout probability of e^-95 (float32 subnormal) against p = 1/2: the ratio overflows
    # float32, the KL (about 1/2 + 1/2 log(1/2)) does not. 8 float32 ulps of the value.
    lp32, lq32 = torch.tensor([math.log(0.5)]), torch.tensor([-95.0])
    want = klest.binary_kl(lp32.double(), lq32.double(), reduction="none")
    got = klest.binary_kl(lp32, lq32, reduction="none")
    assert_close_to_rounding(got, want, ulps=8, dtype=torch.float32)


def test_masks_reductions_and_packed_sequences():
    """Masked positions (NaN there) get no value and no gradient; the reductions follow klest's
    rule (per-sequence token sums, token mean); packed sequences give the padded result; the same
    for the top-k divergences. Tolerance: 8 float64 ulps (the same terms, summed in another
    order)."""
    g = torch.Generator().manual_seed(0)
    lsp = torch.log_softmax(torch.randn(2, 4, 5, generator=g, dtype=F64), -1)
    lsq = torch.log_softmax(torch.randn(2, 4, 5, generator=g, dtype=F64), -1)
    lp, lq = lsp[..., 0], lsq[..., 0]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    lp_nan = torch.where(mask, lp, math.nan).requires_grad_()
    per_token = klest.binary_kl(lp, lq, reduction="none") * mask
    got = klest.binary_kl(lp_nan, lq, mask=mask, reduction="per-sequence")
    assert_close_to_rounding(got, per_token.sum(-1), ulps=8)
    mean = klest.binary_kl(lp_nan, lq, mask=mask, reduction="token-mean")
    assert_close_to_rounding(mean, per_token.sum() / 5, ulps=8)
    mean.backward()
    assert torch.isfinite(lp_nan.grad).all() and (lp_nan.grad[~mask] == 0).all()
    cu = torch.tensor([0, 3, 5])
    packed_p, packed_q = lp[mask], lq[mask]
    for fn in (klest.binary_tv, klest.binary_kl, klest.squared_log_ratio, klest.squared_prob_shift):
        padded = fn(lp, lq, mask=mask)
        packed = fn(packed_p, packed_q, cu_seqlens=cu)
        assert_close_to_rounding(packed, padded, ulps=8, what=fn.__name__)
    # Top-k: pi's top-k log-probs NaN where masked get no gradient; packed gives the padded result.
    top, ids = lsq.topk(2, dim=-1)
    top_p = lsp.gather(-1, ids)
    top_p_nan = torch.where(mask[..., None], top_p, math.nan).requires_grad_()
    per_token = klest.topk_kl(lp, lq, top, topk_logp=top_p, reduction="none") * mask
    got = klest.topk_kl(lp_nan, lq, top, topk_logp=top_p_nan, mask=mask, reduction="per-sequence")
    assert_close_to_rounding(got, per_token.sum(-1), ulps=8)
    got.sum().backward()
    assert torch.isfinite(top_p_nan.grad).all() and (top_p_nan.grad[~mask] == 0).all()
    for fn in (klest.topk_tv, klest.topk_kl):
        padded = fn(lp, lq, top, topk_logp=top_p, mask=mask)
        packed = fn(packed_p, packed_q, top[mask], topk_logp=top_p[mask], cu_seqlens=cu)
        assert_close_to_rounding(packed, padded, ulps=8, what=fn.__name__)


def test_return_details_reports_diagnostics_and_the_top_k_masses():
    z, zr = _pair(6, seed=1)
    lp, lq = _all_tokens(z, zr)
    top, ids = lq.topk(2)
    value, details = klest.topk_kl(
        lp[:3],
        lq[:3],
        top.expand(3, -1),
        logits=z.expand(3, -1),
        topk_ids=ids.expand(3, -1),
        labels=torch.arange(3),
        reduction="token-mean",
        return_details=True,
    )
    assert details.diagnostics.n_units == 3
    assert details.diagnostics.mean == pytest.approx(float(value))
    for y in range(3):
        members = sorted(set(ids.tolist()) | {y})
        assert float(details.rollout_mass[y]) == pytest.approx(float(lq.exp()[members].sum()))
        assert float(details.pi_mass[y]) == pytest.approx(float(lp.exp()[members].sum()))
    _, plain = klest.binary_tv(lp, lq, return_details=True)
    assert plain.rollout_mass is None


# -- masks --------------------------------------------------------------------------------------


def test_dppo_mask_drops_only_moves_away_from_the_rollout_beyond_the_threshold():
    """DPPO's rule written out: drop iff (A > 0, p > q, D > delta) or (A < 0, p < q,
    D > delta_low); A = 0 kept. Checked on a grid of (p, q, A) for binary TV (where it is
    p - q > delta or q - p > delta_low, DPPO's code) and binary KL(rollout||pi)."""
    ps = torch.tensor([0.01, 0.2, 0.45, 0.5, 0.7, 0.95], dtype=F64)
    p, q = torch.meshgrid(ps, ps, indexing="ij")
    p, q = p.reshape(-1).repeat(3), q.reshape(-1).repeat(3)
    adv = torch.tensor([1.0, -1.0, 0.0], dtype=F64).repeat_interleave(ps.numel() ** 2)
    lp, lq = p.log(), q.log()
    keep = klest.dppo_mask(lp, lq, adv, delta=0.2, delta_low=0.1)
    want = ~(((adv > 0) & (p - q > 0.2)) | ((adv < 0) & (q - p > 0.1)))
    assert torch.equal(keep, want)
    d = q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p)).log()
    keep = klest.dppo_mask(lp, lq, adv, delta=0.05, divergence="binary-kl")
    want = ~(((adv > 0) & (p > q) & (d > 0.05)) | ((adv < 0) & (p < q) & (d > 0.05)))
    assert torch.equal(keep, want)
    assert keep.dtype == torch.bool and not keep.requires_grad


def test_dppo_mask_with_top_k_divergences_and_per_sequence_advantages():
    """The top-k masks threshold topk_tv / topk_kl; a per-sequence advantage broadcasts over its
    tokens; positions masked out come back False."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 3, 6, generator=g, dtype=F64)
    zr = z + 0.8 * torch.randn(2, 3, 6, generator=g, dtype=F64)
    lsp, lsq = z.log_softmax(-1), zr.log_softmax(-1)
    y = torch.randint(0, 6, (2, 3), generator=g)
    lp, lq = lsp.gather(-1, y[..., None])[..., 0], lsq.gather(-1, y[..., None])[..., 0]
    top, ids = lsq.topk(2, dim=-1)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    for div, fn in (("topk-tv", klest.topk_tv), ("topk-kl", klest.topk_kl)):
        d = fn(lp, lq, top, logits=z, topk_ids=ids, labels=y, reduction="none")
        delta = float(d.median())
        keep = klest.dppo_mask(
            lp,
            lq,
            adv,
            delta=delta,
            divergence=div,
            topk_logp_rollout=top,
            logits=z,
            topk_ids=ids,
            labels=y,
            mask=mask,
        )
        a = adv[:, None].expand(2, 3)
        want = ~(((a > 0) & (lp > lq) & (d > delta)) | ((a < 0) & (lp < lq) & (d > delta)))
        assert torch.equal(keep, want & mask), div


def test_icepop_log_ratio_and_kpop_masks():
    """IcePop keeps ratios in [low, high] (low = 1/high by default), bounds included; Kimi's keeps
    log-ratios in [low, high]; KPop keeps binary KL <= phi in both directions."""
    r = torch.tensor([0.1, 0.19, 0.21, 0.49, 0.51, 1.0, 4.99, 5.01, 6.0], dtype=F64)
    lq = torch.full_like(r, math.log(0.1))
    lp = lq + r.log()
    assert torch.equal(klest.icepop_mask(lp, lq, high=5.0), (r >= 0.2) & (r <= 5.0))
    assert torch.equal(klest.icepop_mask(lp, lq, low=0.5, high=5.0), (r >= 0.5) & (r <= 5.0))
    assert torch.equal(
        klest.log_ratio_mask(lp, lq, low=-1.0, high=1.5), (r.log() >= -1) & (r.log() <= 1.5)
    )
    # Bounds are included: a ratio of exactly 1 against [1, 1].
    assert klest.icepop_mask(lq, lq, low=1.0, high=1.0).all()
    assert klest.log_ratio_mask(lq, lq, low=0.0, high=0.0).all()
    p, q = lp.exp(), lq.exp()

    def bkl(a, b):
        return a * (a / b).log() + (1 - a) * ((1 - a) / (1 - b)).log()

    want = (bkl(p, q) <= 0.05) & (bkl(q, p) <= 0.05)
    assert want.any() and not want.all()
    assert torch.equal(klest.kpop_mask(lp, lq, phi=0.05), want)
    mask = torch.ones_like(r, dtype=torch.bool)
    mask[3] = False
    assert not klest.icepop_mask(lp, lq, high=5.0, mask=mask)[3]


# -- bad input ----------------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    lp, lq = torch.tensor([[-0.5, -1.0]]), torch.tensor([[-0.4, -1.2]])
    top = torch.tensor([[[-0.4, -1.5], [-1.2, -0.9]]])
    ids = torch.tensor([[[0, 1], [2, 1]]])
    with pytest.raises(ValueError, match="logp_rollout is -inf"):
        klest.binary_kl(lp, torch.tensor([[-math.inf, -1.0]]))
    with pytest.raises(ValueError, match="logp_rollout has shape"):
        klest.binary_tv(lp, lq[:, :1])
    with pytest.raises(ValueError, match="direction"):
        klest.binary_kl(lp, lq, direction="pi||ref")
    with pytest.raises(ValueError, match="exactly one"):
        klest.topk_kl(lp, lq, top)
    with pytest.raises(ValueError, match="topk_logp_rollout has shape"):
        klest.topk_kl(lp, lq, top[0], topk_logp=top[0])
    with pytest.raises(ValueError, match=r"topk_ids .* is needed"):
        klest.topk_tv(lp, lq, top, logits=torch.randn(1, 2, 3))
    with pytest.raises(ValueError, match="topk_ids holds a token twice"):
        klest.topk_tv(lp, lq, top, logits=torch.randn(1, 2, 3), topk_ids=ids.clone().fill_(1))
    with pytest.raises(ValueError, match=r"topk_ids must be token ids in \[0, 3\)"):
        klest.topk_tv(lp, lq, top, logits=torch.randn(1, 2, 3), topk_ids=ids + 2)
    with pytest.raises(ValueError, match="sums to more than 1"):
        klest.topk_kl(lp, lq, torch.full((1, 2, 2), -0.1), topk_logp=top)
    with pytest.raises(TypeError, match="topk_ids must hold integer ids"):
        klest.topk_tv(lp, lq, top, logits=torch.randn(1, 2, 3), topk_ids=ids.float())
    with pytest.raises(ValueError, match="tau"):
        klest.squared_log_ratio(lp, lq, tau=-1.0)
    with pytest.raises(ValueError, match="delta must be"):
        klest.dppo_mask(lp, lq, torch.ones(1), delta=-0.1)
    with pytest.raises(ValueError, match="advantages has shape"):
        klest.dppo_mask(lp, lq, torch.ones(3), delta=0.1)
    with pytest.raises(ValueError, match="advantages contains NaN"):
        klest.dppo_mask(lp, lq, torch.tensor([math.nan]), delta=0.1)
    with pytest.raises(ValueError, match="needs topk_logp_rollout"):
        klest.dppo_mask(lp, lq, torch.ones(1), delta=0.1, divergence="topk-kl")
    with pytest.raises(ValueError, match="apply to the top-k"):
        klest.dppo_mask(lp, lq, torch.ones(1), delta=0.1, topk_ids=ids)
    with pytest.raises(ValueError, match="low must be at most high"):
        klest.icepop_mask(lp, lq, low=6.0, high=5.0)
    with pytest.raises(ValueError, match="high must be"):
        klest.icepop_mask(lp, lq, high=0.0)
    with pytest.raises(ValueError, match="low must be at most high"):
        klest.log_ratio_mask(lp, lq, low=1.0, high=-1.0)
    with pytest.raises(ValueError, match="phi"):
        klest.kpop_mask(lp, lq, phi=-0.1)
