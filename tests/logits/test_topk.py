"""kl_from_topk against hand-written float64 formulas from the full distributions: values,
exact unbiasedness (by enumerating the sampled token) and Monte Carlo unbiasedness of value and
gradient, the lower bound, edge cases (k = V, token in S, -inf logits, masks, bf16), errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import klest
from klest.logits.topk import kl_from_topk
from klest.testbeds import make_generator
from tests._reference import assert_verbose_close
from tests._stats import RATE, assert_failures_consistent, z_for
from tests._tolerance import assert_close_to_rounding, logit_scale, rounding_tolerance

ESTIMATORS = ("unbiased", "unbiased-cv", "tail-bucket", "truncated", "truncated-raw")
SAMPLED = ("unbiased", "unbiased-cv")
DIRECTIONS = ("pi||ref", "ref||pi")


# -- references: plain loops over positions, float64, from the full distributions -----------


def full_kl(la: torch.Tensor, lb: torch.Tensor, direction: str) -> torch.Tensor:
    """Exact KL of one position from full log-probs ``[V]`` (0 log 0 = 0)."""
    p, q = (la, lb) if direction == "pi||ref" else (lb, la)
    terms = [p[v].exp() * (p[v] - q[v]) for v in range(la.numel()) if p[v] > -math.inf]
    return sum(terms, torch.tensor(0.0, dtype=torch.float64))


def reference_value(la, lb, s, y, estimator, direction):
    """One position's estimate by the textbook formula: ``la``, ``lb`` full log-probs [V] of
    pi and ref, ``s`` the list of top-k ids, ``y`` the sampled token."""
    pi, ref = la.exp(), lb.exp()
    set_ = list(s)
    tail = [v for v in range(la.numel()) if v not in set_]
    ps, rs = pi[set_], ref[set_]
    pbar, rbar = 1 - ps.sum(), 1 - rs.sum()
    if len(tail) == 0:
        pbar = rbar = torch.tensor(0.0, dtype=torch.float64)
    pi_dir = direction == "pi||ref"

    def kl(p, q):  # sum p log(p/q), 0 log 0 = 0
        return sum(
            (
                pv * math.log(pv / qv)
                for pv, qv in zip(p.tolist(), q.tolist(), strict=True)
                if pv > 0
            ),
            0.0,
        )

    if estimator == "truncated":
        a, b = ps / ps.sum(), rs / rs.sum()
        return kl(a, b) if pi_dir else kl(b, a)
    in_set = kl(ps, rs) if pi_dir else kl(rs, ps)
    if estimator == "truncated-raw":
        return in_set
    bucket = (
        kl(pbar.reshape(1), rbar.reshape(1)) if pi_dir else kl(rbar.reshape(1), pbar.reshape(1))
    )
    if estimator == "tail-bucket":
        return in_set + bucket
    out = y not in set_
    w = float(ref[y] / pi[y])
    if estimator == "unbiased":
        g = (-math.log(w) if pi_dir else w * math.log(w)) if out else 0.0
        return in_set + g
    u = w * float(pbar / rbar) if out else 1.0
    g = (u - 1 - math.log(u)) if pi_dir else float(rbar / pbar) * (u * math.log(u) - u + 1)
    return in_set + bucket + (g if out else 0.0)


def _case(seed=0, shape=(2, 3), v=24, k=5, peak=2.0, dtype=torch.float64):
    g = make_generator(seed)
    z = (1.5 * torch.randn(*shape, v, generator=g, dtype=torch.float64)).to(dtype)
    teacher = (peak * torch.randn(*shape, v, generator=g, dtype=torch.float64)).log_softmax(-1)
    top, idx = teacher.topk(k, -1)
    perm = torch.randperm(k, generator=g)  # stored order need not be sorted
    return z, teacher, idx[..., perm], top[..., perm]


def _topk(z, idx, top, teacher, y, **kw):
    """kl_from_topk per position, with the teacher's log-prob of each sampled token ``y``."""
    lr = teacher.gather(-1, y[..., None])[..., 0]
    return kl_from_topk(z, idx, top, labels=y, logp_ref_label=lr, reduction="none", **kw)


def _labels(z, seed=1, temperature=1.0):
    g = make_generator(seed)
    probs = torch.softmax(z.double() / temperature, -1).reshape(-1, z.shape[-1])
    return torch.multinomial(probs, 1, generator=g).reshape(z.shape[:-1])


# -- values -------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_match_hand_written_formulas(estimator, direction, temperature):
    z, teacher, idx, top = _case()
    y = _labels(z, temperature=temperature)
    # Force both cases: position (0, 0) samples a top-k token, (0, 1) one outside.
    y[0, 0] = idx[0, 0, 2]
    y[0, 1] = next(v for v in range(24) if v not in idx[0, 1].tolist())
    got = _topk(
        z, idx, top, teacher, y, estimator=estimator, direction=direction, temperature=temperature
    )
    la = torch.log_softmax(z / temperature, -1)
    want = torch.tensor(
        [
            reference_value(
                la[i, j], teacher[i, j], idx[i, j].tolist(), int(y[i, j]), estimator, direction
            )
            for i in range(2)
            for j in range(3)
        ],
        dtype=torch.float64,
    ).reshape(2, 3)
    assert_verbose_close(got, want, atol=1e-12, rtol=1e-12, what=estimator)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_tail_bucket_is_a_lower_bound_and_truncated_is_biased(direction):
    z, teacher, idx, top = _case(seed=3, shape=(40,), v=60, k=6)
    exact = klest.kl_from_logits(z, teacher, direction=direction, reduction="none")
    bucket = kl_from_topk(
        z, idx, top, estimator="tail-bucket", direction=direction, reduction="none"
    )
    assert (bucket <= exact + 1e-12).all()
    assert (exact - bucket).mean() > 0.05  # strictly below on average: a real gap
    for est in ("truncated", "truncated-raw"):
        trunc = kl_from_topk(z, idx, top, estimator=est, direction=direction, reduction="none")
        # Deterministic: the bias is the difference itself (no sampling noise to compare with).
        assert (trunc - exact).abs().mean() > 0.1, est


# -- unbiasedness: exact, by enumerating the sampled token ----------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("estimator", SAMPLED)
@pytest.mark.parametrize("temperature", [1.0, 1.6])
def test_expectation_over_the_sampled_token_is_the_full_kl(estimator, direction, temperature):
    """Sum over every token y of pi(y) times the estimate (and its gradient) equals the exact
    full-vocabulary KL (and its gradient): unbiasedness with no sampling error."""
    z, teacher, idx, top = _case(seed=5, v=20, k=4)
    z = z.requires_grad_(True)
    # the teacher's log-probs are used as given; the student is tempered
    la = torch.log_softmax(z / temperature, -1)
    exact = sum(full_kl(la[i, j], teacher[i, j], direction) for i in range(2) for j in range(3))
    (want_grad,) = torch.autograd.grad(exact, z)
    pi = la.detach().exp()
    mean_value = torch.zeros((), dtype=torch.float64)
    mean_grad = torch.zeros_like(z)
    for v in range(20):
        y = torch.full((2, 3), v)
        est = kl_from_topk(
            z,
            idx,
            top,
            labels=y,
            logp_ref_label=teacher[..., v],
            estimator=estimator,
            direction=direction,
            temperature=temperature,
            reduction="none",
        )
        mean_value = mean_value + (pi[..., v] * est.detach()).sum()
        (g,) = torch.autograd.grad((pi[..., v] * est).sum(), z)
        mean_grad = mean_grad + g
    assert_verbose_close(mean_value, exact, atol=1e-12, what="E[value]")
    assert_verbose_close(mean_grad, want_grad, atol=1e-12, what="E[gradient]")


# -- unbiasedness: Monte Carlo, realistic shape (peaky teacher, larger V) ---------------------


# A gradient coordinate's mean carries the count of its own token, about Poisson(n pi_j); where
# that count is small (a token expected a few times, or drawn not at all) the draws' standard
# deviation misses the rare large draws and the normal comparison fails far more often than it
# states. So only the coordinates whose token is expected at least MIN_COUNT times are compared;
# the rarely drawn ones are tested exactly by the enumeration above.
MIN_COUNT = 50


def _monte_carlo_statistic(estimator: str, direction: str, draw_seed: int) -> float:
    """One position (teacher from seed 11) replicated n times, tokens sampled from pi (from
    ``draw_seed``): the largest of |mean - exact| / (z se) over the value and the gradient's
    coordinates whose token pi draws at least MIN_COUNT times in expectation, z the Bonferroni
    threshold over those comparisons (two-sided at RATE). At most 1 passes."""
    v, k, n = 300, 10, 20_000
    g = make_generator(11)
    z0 = torch.randn(v, generator=g, dtype=torch.float64)
    zipf = -1.1 * torch.log(torch.arange(1, v + 1, dtype=torch.float64))  # Zipf-like teacher
    teacher = (zipf[torch.randperm(v, generator=g)] + 0.3 * z0).log_softmax(-1)
    top, idx = teacher.topk(k)
    z = z0.expand(n, v).clone().requires_grad_(True)
    pi = torch.softmax(z0, -1)
    y = torch.multinomial(pi, n, replacement=True, generator=make_generator(draw_seed))
    est = kl_from_topk(
        z,
        idx.expand(n, k),
        top.expand(n, k),
        labels=y,
        logp_ref_label=teacher[y],
        estimator=estimator,
        direction=direction,
        reduction="none",
    )
    (per_row_grad,) = torch.autograd.grad(est.sum(), z)  # row i: the gradient of draw i
    zz = z0.clone().requires_grad_(True)
    exact = full_kl(torch.log_softmax(zz, -1), teacher, direction)
    (exact_grad,) = torch.autograd.grad(exact, zz)
    compared = n * pi >= MIN_COUNT
    threshold = z_for(RATE, int(compared.sum()) + 1)
    se = est.detach().std() / math.sqrt(n)
    value_stat = abs(float(est.detach().mean() - exact.detach())) / float(se)
    dev = (per_row_grad.mean(0) - exact_grad).abs()[compared]
    se_g = (per_row_grad.std(0) / math.sqrt(n))[compared]
    # Rounding (1e-12) is allowed on top, for coordinates that never vary (the set's, in some
    # cases, whose spread is rounding noise itself); one that does not vary and is off by more
    # counts as infinitely far.
    excess = (dev - 1e-12).clamp(min=0)
    grad_stat = torch.where(excess > 0, excess / se_g, 0.0)
    return max(value_stat, float(grad_stat.max())) / threshold


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("estimator", SAMPLED)
def test_monte_carlo_value_and_gradient_are_unbiased(estimator, direction):
    """The mean value and the mean gradient (each coordinate drawn often enough for a normal
    comparison, about 130 of V = 300) within the Bonferroni threshold of the exact ones
    (family false-fail rate RATE = 6.3e-5)."""
    assert _monte_carlo_statistic(estimator, direction, draw_seed=12) <= 1.0


@pytest.mark.calibration
def test_monte_carlo_unbiasedness_holds_over_draw_seeds():
    """The statistic above at 2 more draw seeds per case: no failure expected (8 x 6.3e-5)."""
    stats = [
        _monte_carlo_statistic(estimator, direction, draw_seed)
        for estimator in SAMPLED
        for direction in DIRECTIONS
        for draw_seed in range(100, 102)
    ]
    assert_failures_consistent(stats, 1.0, RATE, "top-k Monte Carlo mean")


def test_unbiased_cv_has_lower_variance_on_a_peaky_teacher():
    """The control-variate form beats the plain tail estimate when the teacher's tail is close
    to proportional to the student's (a distillation late in training); exact variances by
    enumeration, no sampling."""
    v, k = 200, 10
    g = make_generator(2)
    teacher = (-1.1 * torch.log(torch.arange(1, v + 1, dtype=torch.float64))).log_softmax(-1)
    z = teacher + 0.3 * torch.randn(v, generator=g, dtype=torch.float64)
    top, idx = teacher.topk(k)
    pi = torch.softmax(z, -1)
    variances = {}
    for est in SAMPLED:
        vals = kl_from_topk(
            z.expand(v, v),
            idx.expand(v, k),
            top.expand(v, k),
            labels=torch.arange(v),
            logp_ref_label=teacher,
            estimator=est,
            reduction="none",
        )
        mean = (pi * vals).sum()
        variances[est] = float((pi * (vals - mean) ** 2).sum())
    assert variances["unbiased-cv"] < 0.2 * variances["unbiased"], variances


# -- gradients of the deterministic estimators: gradcheck of the custom Function ---------------


@pytest.mark.parametrize("estimator", ["tail-bucket", "truncated", "truncated-raw"])
def test_gradcheck(estimator):
    """The deterministic estimators' gradients are their values' (the sampled ones' are not:
    they carry the score term, tested by enumeration above)."""
    z, teacher, idx, top = _case(seed=7, shape=(3,), v=9, k=3)
    y = torch.tensor([0, 5, 8])
    mask = torch.tensor([True, False, True])

    def f(x):
        return kl_from_topk(
            x,
            idx,
            top,
            labels=y,
            logp_ref_label=teacher.gather(-1, y[:, None])[:, 0],
            estimator=estimator,
            direction="ref||pi",
            temperature=0.8,
            mask=mask,
            memory_budget=1,  # one row per chunk
        )

    assert torch.autograd.gradcheck(f, (z.clone().requires_grad_(True),))


# -- edge cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_k_equal_to_v_is_exact(estimator, direction):
    z, teacher, idx, top = _case(seed=4, v=7, k=7)
    z = z.requires_grad_(True)
    y = _labels(z.detach())
    exact = klest.kl_from_logits(z, teacher, direction=direction, reduction="none")
    got = _topk(z, idx, top, teacher, y, estimator=estimator, direction=direction)
    assert_verbose_close(got, exact, atol=1e-12, what="value")
    (g1,) = torch.autograd.grad(got.sum(), z)
    (g2,) = torch.autograd.grad(exact.sum(), z)
    assert_verbose_close(g1, g2, atol=1e-12, what="gradient")


def test_sampled_token_in_the_set_adds_nothing():
    z, _, idx, top = _case(seed=8)
    y = idx[..., 0]  # every sampled token in S
    lr = top[..., 0]
    kw = {"labels": y, "logp_ref_label": lr, "reduction": "none"}
    for direction in DIRECTIONS:
        for sampled, known in (("unbiased", "truncated-raw"), ("unbiased-cv", "tail-bucket")):
            a = kl_from_topk(z, idx, top, estimator=sampled, direction=direction, **kw)
            b = kl_from_topk(z, idx, top, estimator=known, direction=direction, **kw)
            assert torch.equal(a, b)


def test_minus_inf_logits():
    """-inf student logits: outside pi's support. In S under KL(ref||pi) the value is +inf
    with no gradient there; elsewhere finite values and finite gradients, never NaN."""
    z, teacher, idx, top = _case(seed=9, shape=(3,), v=12, k=3)
    tail = [v for v in range(12) if v not in idx[1].tolist()]
    z[0, idx[0, 1]] = -math.inf  # a top-k token pi cannot produce
    z[1, tail] = -math.inf  # pi has no tail at all
    z = z.requires_grad_(True)
    y = torch.stack([idx[0, 0], idx[1, 0], _labels(z.detach())[2]])
    kw = {"labels": y, "logp_ref_label": teacher.gather(-1, y[:, None])[:, 0], "reduction": "none"}
    for direction in DIRECTIONS:
        exact = klest.kl_from_logits(z.detach(), teacher, direction=direction, reduction="none")
        for est in ESTIMATORS:
            got = kl_from_topk(z, idx, top, estimator=est, direction=direction, **kw)
            assert not torch.isnan(got).any(), (est, direction)
            (grad,) = torch.autograd.grad(got.sum(), z)
            assert torch.isfinite(grad).all(), (est, direction)
            if est in ("unbiased", "unbiased-cv") and direction == "pi||ref":
                # token in S at rows 0, 1: the estimate there is exact given the student tail
                assert_verbose_close(got[1], exact[1], atol=1e-12, what=est)
        if direction == "ref||pi":
            assert math.isinf(float(got[0].detach()))


def test_mask_and_ignore_index_leave_positions_out():
    z, teacher, idx, top = _case(seed=10, shape=(3, 4))
    y = _labels(z)
    lr = teacher.gather(-1, y[..., None])[..., 0]
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 2:] = False
    mask[2] = False  # an empty row
    z_bad, idx_bad, top_bad, lr_bad = z.clone(), idx.clone(), top.clone(), lr.clone()
    z_bad[~mask] = math.nan  # not read
    idx_bad[~mask] = 10_000
    top_bad[~mask] = 5.0
    lr_bad[~mask] = math.nan
    for reduction in ("none", "per-sequence", "seq-mean-token-sum", "token-mean", "sum"):
        z_bad.grad = None
        zb = z_bad.clone().requires_grad_(True)
        got = kl_from_topk(
            zb, idx_bad, top_bad, labels=y, logp_ref_label=lr_bad, mask=mask, reduction=reduction
        )
        per = kl_from_topk(z, idx, top, labels=y, logp_ref_label=lr, reduction="none")
        want = klest.aggregate(per, mask=mask, reduction=reduction)
        assert_verbose_close(got, want, atol=1e-12, what=reduction)
        (g,) = torch.autograd.grad(got.sum(), zb)
        assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    # labels = ignore_index is the same as masking (logp_ref_label is not read there)
    y_ign = torch.where(mask, y, -100)
    got = kl_from_topk(z, idx, top, labels=y_ign, logp_ref_label=lr_bad, reduction="per-sequence")
    assert_verbose_close(got, klest.aggregate(per, mask=mask, reduction="per-sequence"), atol=1e-12)


def test_bf16_logits_and_small_memory_budget():
    z, teacher, idx, top = _case(seed=12, v=40, k=6)
    y = _labels(z)
    lr = teacher.gather(-1, y[..., None])[..., 0]
    z16 = z.to(torch.bfloat16).requires_grad_(True)
    z32 = z16.detach().float().requires_grad_(True)
    kw = {"labels": y, "logp_ref_label": lr.float()}
    a = kl_from_topk(z16, idx, top.float(), **kw)
    b = kl_from_topk(z32, idx, top.float(), memory_budget=1, **kw)
    assert a.dtype == torch.float32
    # The same float32 numbers in two chunkings: a log-softmax and sums over the row, each
    # rounding at the row's logit and teacher log-prob scale (16 roundings), twice; a mean over
    # rows of 3 positions' sums.
    scale = 3 * float((logit_scale(z32) + top.abs().amax(-1) + lr.abs()).max())
    assert_close_to_rounding(a, b, ulps=32, scale=scale, what="value")
    a.backward()
    b.backward()
    assert z16.grad.dtype == torch.bfloat16
    # float32 arithmetic cancelling at the largest entry's scale (twice 16 roundings), then
    # the rounding to bf16 (2^-8 of each entry)
    atol = rounding_tolerance(z32.grad, ulps=32)
    assert_verbose_close(z16.grad.float(), z32.grad, atol=atol, rtol=2.0**-8, what="gradient")
    # bf16 teacher log-probs pass validation (rounding of their sum)
    kl_from_topk(z32, idx, top.to(torch.bfloat16), estimator="tail-bucket")


def test_details():
    z, teacher, idx, top = _case(seed=13)
    y = _labels(z)
    lr = teacher.gather(-1, y[..., None])[..., 0]
    value, d = kl_from_topk(z, idx, top, labels=y, logp_ref_label=lr, return_details=True)
    pi = torch.softmax(z, -1).gather(-1, idx)
    ref = top.exp()
    assert_verbose_close(d.teacher_mass, ref.sum(-1), atol=1e-12)
    assert_verbose_close(d.student_mass, pi.sum(-1), atol=1e-12)
    assert_verbose_close(d.overlap, torch.minimum(pi, ref).sum(-1), atol=1e-12)
    assert torch.equal(d.in_set, (idx == y[..., None]).any(-1))
    assert d.diagnostics.n_units == 2 and math.isclose(d.diagnostics.mean, float(value))


# -- bad input ------------------------------------------------------------------------------


def test_errors_name_the_argument():
    z, teacher, idx, top = _case(seed=14)
    y = _labels(z)
    lr = teacher.gather(-1, y[..., None])[..., 0]
    kw = {"labels": y, "logp_ref_label": lr}
    out_of_range = idx.clone()
    out_of_range[0, 0, 0] = 24
    top_zero, lr_zero = top.clone(), lr.clone()
    top_zero[0, 1, -1] = -math.inf  # the teacher gives a top-k token probability 0
    lr_zero[1, 0] = -math.inf  # ... or the sampled token (KL(pi||ref) infinite)
    cases = [
        ({"topk_logp": top_zero}, r"topk_logp is -inf .*index \(0, 1, 4\)"),
        ({"logp_ref_label": lr_zero}, r"logp_ref_label is -inf .*index \(1, 0\)"),
        ({"logp_ref_label": lr[:, :2]}, "logp_ref_label has shape"),
        ({"topk_indices": out_of_range}, "outside"),
        ({"topk_indices": torch.cat([idx[..., :1], idx[..., :-1]], -1)}, "distinct"),
        ({"topk_logp": top + 1.0}, "above 0"),
        ({"topk_logp": top.clamp(max=-0.01) * 0 - 0.01}, "sum to more than 1"),
        ({"topk_indices": idx[:1]}, "topk_indices has shape"),
        ({"topk_logp": top[..., :2]}, "topk_logp has shape"),
        ({"topk_indices": idx.float()}, "integer"),
        ({"labels": None}, "needs labels"),
        ({"estimator": "unbiassed"}, "estimator"),
        ({"direction": "forward"}, "direction"),
    ]
    for change, message in cases:
        args = {"topk_indices": idx, "topk_logp": top, **kw, **change}
        with pytest.raises((ValueError, TypeError), match=message):
            kl_from_topk(z, args.pop("topk_indices"), args.pop("topk_logp"), **args)
    z_inf = z.clone()
    z_inf[0, 0, y[0, 0]] = -math.inf
    with pytest.raises(ValueError, match="not sampled from pi"):
        kl_from_topk(z_inf, idx, top, **kw)
    with pytest.raises(ValueError, match="k=25"):
        kl_from_topk(z, torch.zeros(2, 3, 25, dtype=torch.long), torch.zeros(2, 3, 25), **kw)


def test_student_without_mass_in_the_set_and_rows_without_a_distribution():
    """A student giving S probability 0 is valid (finite KL(pi||ref)); a row of NaN or all -inf
    logits at a counted position is an error."""
    z, teacher, idx, top = _case(seed=15, shape=(2,), v=10, k=3)
    z[0].scatter_(-1, idx[0], -math.inf)
    y = torch.tensor([int(next(v for v in range(10) if v not in idx[0].tolist())), 0])
    y[1] = int(torch.argmax(z[1]))
    lr = teacher.gather(-1, y[:, None])[:, 0]
    got = kl_from_topk(z, idx, top, labels=y, logp_ref_label=lr, reduction="none")
    assert torch.isfinite(got).all()
    for bad in (math.nan, -math.inf):
        zb = z.clone()
        zb[1] = bad
        with pytest.raises(ValueError, match="no distribution"):
            kl_from_topk(zb, idx, top, labels=y, logp_ref_label=lr)


def test_single_position_empty_batch_and_all_masked():
    """A 1-D [V] input is one position; a batch with no position, or none counted, gives 0 with
    a zero gradient."""
    z, teacher, idx, top = _case(seed=16, shape=(), v=30, k=4)
    y = torch.tensor(int(next(v for v in range(30) if v not in idx.tolist())))
    got = kl_from_topk(z, idx, top, labels=y, logp_ref_label=teacher[y])
    want = reference_value(z.log_softmax(-1), teacher, idx.tolist(), int(y), "unbiased", "pi||ref")
    assert_verbose_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    for shape, mask in (((0, 4), None), ((2, 3), torch.zeros(2, 3, dtype=torch.bool))):
        z, teacher, idx, top = _case(seed=17, shape=shape, v=30, k=4)
        z = z.requires_grad_(True)
        y = torch.zeros(shape, dtype=torch.long)
        got = kl_from_topk(z, idx, top, labels=y, logp_ref_label=teacher[..., 0], mask=mask)
        got.backward()
        assert float(got.detach()) == 0.0 and (z.grad == 0).all()


@settings(max_examples=40, deadline=None)
@given(
    v=st.integers(2, 12),
    k_frac=st.floats(0.0, 1.0),
    scale=st.floats(0.1, 6.0),
    seed=st.integers(0, 2**16),
    direction=st.sampled_from(DIRECTIONS),
)
def test_bound_and_exact_expectation_hold_for_any_pair(v, k_frac, scale, seed, direction):
    """For any pair of distributions and any k: tail-bucket <= KL, and the expectation of each
    sampled estimator over the token (enumerated) is the KL."""
    k = max(1, round(k_frac * v))
    g = make_generator(seed)
    z = scale * torch.randn(v, generator=g, dtype=torch.float64)
    teacher = (scale * torch.randn(v, generator=g, dtype=torch.float64)).log_softmax(-1)
    top, idx = teacher.topk(k)
    exact = full_kl(z.log_softmax(-1), teacher, direction)
    bound = kl_from_topk(z, idx, top, estimator="tail-bucket", direction=direction)
    assert float(bound) <= float(exact) + 1e-9
    pi = z.softmax(-1)
    # The teacher's tail mass is known only as 1 - sum(top-k probs), to an absolute rounding
    # error of a few eps: relative error eps / tail. The tail terms weigh it by the student's tail
    # mass, so the tolerance grows with student tail / teacher tail (conditioning, not bias).
    eps = torch.finfo(torch.float64).eps
    outside = torch.ones(v, dtype=torch.bool)
    outside[idx] = False
    tail_ref = float(1 - top.exp().sum())
    tail_pi = float(pi[outside].sum())
    atol = 1e-9 + (16 * eps * tail_pi / tail_ref if tail_ref > 0 else 0.0)
    for est in SAMPLED:
        vals = kl_from_topk(
            z.expand(v, v),
            idx.expand(v, k),
            top.expand(v, k),
            labels=torch.arange(v),
            logp_ref_label=teacher,
            estimator=est,
            direction=direction,
            reduction="none",
        )
        assert_verbose_close((pi * vals).sum(), exact, atol=atol, rtol=1e-9, what=est)


def test_truncated_with_minus_inf_student_logits_in_the_set():
    """truncated, KL(pi||ref): a -inf student logit in S takes no part in the student's
    normaliser over S (the value is the renormalised KL over S of the reference's formula), and
    a student with no mass on S gives 0; both with finite gradients."""
    z, teacher, idx, top = _case(seed=18, shape=(2,), v=10, k=3)
    z[0, idx[0, 1]] = -math.inf  # one token of S outside pi's support
    z[1].scatter_(-1, idx[1], -math.inf)  # no mass on S at all
    z = z.requires_grad_(True)
    y = torch.stack([idx[0, 0], torch.tensor(next(v for v in range(10) if v not in idx[1]))])
    got = _topk(z, idx, top, teacher, y, estimator="truncated")
    la = z.detach().log_softmax(-1)
    for row in range(2):
        want = reference_value(
            la[row], teacher[row], idx[row].tolist(), int(y[row]), "truncated", "pi||ref"
        )
        assert_verbose_close(got[row], torch.tensor(want, dtype=torch.float64), atol=1e-12)
    (grad,) = torch.autograd.grad(got.sum(), z)
    assert torch.isfinite(grad).all()
    # Row 0's gradient: autograd of the formula over S's supported tokens, written here.
    z0 = z[0].detach().clone().requires_grad_(True)
    s = idx[0][z0.detach()[idx[0]] > -math.inf]
    la_s = z0[s] - torch.logsumexp(z0[s], -1)
    lb_s = (teacher[0, idx[0]] - torch.logsumexp(teacher[0, idx[0]], -1))[
        z0.detach()[idx[0]] > -math.inf
    ]
    (want_grad,) = torch.autograd.grad((la_s.exp() * (la_s - lb_s)).sum(), z0)
    assert_verbose_close(grad[0], want_grad, atol=1e-12)
