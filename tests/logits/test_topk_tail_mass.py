"""kl_from_topk where the teacher's top-k set holds (nearly) all the mass: its stored log-probs
sum, after rounding, to exactly 1, to 1 minus less than the sampled tail token's probability,
or to a little more than 1 (within the documented rounding). The tail mass is then read as at
least the sampled tail token's probability (the teacher's tail holds that token) and never
below 0, so the sampled estimators stay finite.

With one tail token (``V = k + 1``) the teacher is completed exactly by the sampled token's
log-prob, and the estimates have exact answers: the tail-bucket is exact (the tail is one
outcome), the ``"unbiased-cv"`` correction is 0 when the sampled token is that tail token
(``u = 1``), so the value is the exact KL to the completed teacher, in both directions. The
expected values are the plain float64 sums over the vocabulary, compared within the rounding
of a sum of V terms at the size of the largest term.
"""

from __future__ import annotations

import math

import pytest
import torch

from klest.logits.topk import kl_from_topk
from tests._tolerance import assert_close_to_rounding

DIRECTIONS = ("pi||ref", "ref||pi")


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``sum_v p_v log(p_v / q_v)`` over the last dimension, float64 (0 log 0 = 0)."""
    terms = torch.where(logp > -math.inf, logp.exp() * (logp - logq), 0.0)
    return terms.sum(-1)


def _student(v: int, rows: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 1.5 * torch.randn(rows, v, generator=g, dtype=torch.float64)


def _exact_and_scale(z, teacher_logp, direction):
    """The exact KL per row from the student's logits and the completed teacher, and the size
    of its largest term (the rounding scale)."""
    la = z.log_softmax(-1)
    p, q = (la, teacher_logp) if direction == "pi||ref" else (teacher_logp, la)
    terms = torch.where(p > -math.inf, p.exp() * (p - q), 0.0)
    return terms.sum(-1), float(terms.abs().max())


def _per_position(z, idx, top, y, ly, estimator, direction):
    return kl_from_topk(
        z,
        idx,
        top,
        labels=y,
        logp_ref_label=ly,
        estimator=estimator,
        direction=direction,
        reduction="none",
    )


# Stored top-k log-probs (k = 2 of V = 3) whose masses round to: exactly 1 (the second token's
# 4e-18 vanishes in 1 + 4e-18), 1 - 1e-15 (less than the tail token's 1e-10: log-probs rounded
# apart), and 1 + 2e-9 (above 1, within the float64 tolerance 1e-4); the tail token's log-prob.
CASES = {
    "rounds to 1": ([0.0, -40.0], -45.0),
    "below the tail token": ([math.log1p(-1e-15) - math.log(2.0)] * 2, math.log(1e-10)),
    "above 1": ([math.log(0.5) + 1e-9] * 2, math.log(1e-7)),
}


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("estimator", ["unbiased-cv", "unbiased"])
def test_tail_mass_rounded_away_is_at_least_the_sampled_tail_token(case, estimator, direction):
    """Sampled token in the one-token tail: unbiased-cv's value is the exact KL to the teacher
    completed by that token (finite, >= 0); unbiased's is exact over S plus its tail term."""
    top_list, tail_logp = CASES[case]
    z = _student(3)
    rows = z.shape[0]
    top = torch.tensor(top_list, dtype=torch.float64).expand(rows, 2)
    idx = torch.tensor([0, 1]).expand(rows, 2)
    y = torch.full((rows,), 2)
    ly = torch.full((rows,), tail_logp, dtype=torch.float64)
    teacher = torch.cat([top, ly[:, None]], -1)
    got = _per_position(z, idx, top, y, ly, estimator, direction)
    assert torch.isfinite(got).all(), got
    if estimator == "unbiased-cv":
        want, scale = _exact_and_scale(z, teacher, direction)
        # V = 3 terms and the tail's log-ratio, each rounded once at the largest term's size
        assert_close_to_rounding(got, want, ulps=16, scale=scale, what=case)
        # a KL of measures whose masses differ from 1 by at most the tail token's probability
        assert (got >= -math.exp(tail_logp)).all()
    else:
        la = z.log_softmax(-1)
        in_set = _kl(la[:, :2], top) if direction == "pi||ref" else _kl(top, la[:, :2])
        log_w = ly - la[:, 2]
        tail = -log_w if direction == "pi||ref" else log_w.exp() * log_w
        assert_close_to_rounding(
            got, in_set + tail, ulps=16, scale=float((in_set.abs() + tail.abs()).max())
        )


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("estimator", ["unbiased-cv", "tail-bucket"])
def test_a_sampled_token_in_the_set_does_not_set_the_tail_mass(estimator, direction):
    """A teacher with a real tail (one token, 0.1) and the sampled token in S, whose probability
    (0.6) exceeds the tail's: the tail mass is 1 - R = 0.1, not that token's probability, and
    the value is the exact KL (tail-bucket with a one-token tail)."""
    z = _student(3, seed=1)
    rows = z.shape[0]
    teacher = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64).log().expand(rows, 3)
    idx = torch.tensor([0, 1]).expand(rows, 2)
    y = torch.zeros(rows, dtype=torch.long)
    got = _per_position(z, idx, teacher[:, :2], y, teacher[:, 0], estimator, direction)
    want, scale = _exact_and_scale(z, teacher, direction)
    assert_close_to_rounding(got, want, ulps=16, scale=scale)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("estimator", ["unbiased-cv", "tail-bucket", "unbiased"])
def test_k_equal_to_v_with_a_mass_below_one_has_no_tail(estimator, direction):
    """k = V: there is no tail, whatever the stored log-probs' rounding leaves of 1 - R (here
    1e-9): the value is the sum over the vocabulary, finite in both directions (a tail mass
    against the student's empty tail would make KL(ref||pi) infinite)."""
    z = _student(4, seed=2)
    rows = z.shape[0]
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(rows, 4, generator=g, dtype=torch.float64).log_softmax(-1)
    teacher = teacher + math.log1p(-1e-9)  # mass 1 - 1e-9
    idx = torch.arange(4).expand(rows, 4)
    y = torch.tensor([0, 1, 2])
    got = _per_position(
        z, idx, teacher, y, teacher.gather(-1, y[:, None])[:, 0], estimator, direction
    )
    want, scale = _exact_and_scale(z, teacher, direction)
    assert_close_to_rounding(got, want, ulps=16, scale=scale)


@pytest.mark.parametrize("case", list(CASES))
def test_reported_teacher_mass_is_a_mass(case):
    """details.teacher_mass is R read as a mass: in [0, 1], 1 where the stored log-probs sum
    to 1 or (by rounding) more."""
    top_list, _tail_logp = CASES[case]
    z = _student(3)
    top = torch.tensor(top_list, dtype=torch.float64).expand(3, 2)
    idx = torch.tensor([0, 1]).expand(3, 2)
    _, details = kl_from_topk(z, idx, top, estimator="tail-bucket", return_details=True)
    mass = float(top[0].exp().sum())
    assert details.teacher_mass.shape == (3,)
    assert ((details.teacher_mass >= 0) & (details.teacher_mass <= 1)).all()
    assert_close_to_rounding(
        details.teacher_mass, torch.full((3,), min(mass, 1.0), dtype=torch.float64), ulps=4
    )


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_unbiased_cv_is_never_below_the_tail_bucket_bound(direction):
    """Per position and per sampled token (every token of the vocabulary in turn, in S or
    not), unbiased-cv = tail-bucket + a k3 term >= 0."""
    g = torch.Generator().manual_seed(6)
    v, k = 9, 3
    z = 2 * torch.randn(v, generator=g, dtype=torch.float64)
    teacher = (2 * torch.randn(v, generator=g, dtype=torch.float64)).log_softmax(-1)
    top, idx = teacher.topk(k)
    kw = {"labels": torch.arange(v), "logp_ref_label": teacher, "direction": direction}
    zs, idxs, tops = z.expand(v, v), idx.expand(v, k), top.expand(v, k)
    cv = kl_from_topk(zs, idxs, tops, estimator="unbiased-cv", reduction="none", **kw)
    bound = kl_from_topk(zs, idxs, tops, estimator="tail-bucket", reduction="none", **kw)
    assert (cv >= bound).all()
    assert (cv > bound).sum() >= v - k - 1  # strictly above where y is outside S (u != 1)


def test_a_position_with_an_infinite_value_passes_no_gradient():
    """KL(ref||pi) with a top-k token the student cannot produce is +inf at that position: its
    gradient is 0 there (and finite, nonzero, at the other positions)."""
    z = _student(5, rows=2, seed=7)
    z[0, 1] = -math.inf
    z = z.requires_grad_(True)
    teacher = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05], dtype=torch.float64).log().expand(2, 5)
    idx = torch.tensor([0, 1]).expand(2, 2)
    for estimator in ("tail-bucket", "truncated-raw", "unbiased", "unbiased-cv"):
        got = _per_position(
            z, idx, teacher[:, :2], torch.tensor([0, 3]), teacher[:, 0], estimator, "ref||pi"
        )
        assert math.isinf(float(got[0].detach())) and math.isfinite(float(got[1].detach()))
        (grad,) = torch.autograd.grad(got.sum(), z)
        assert torch.count_nonzero(grad[0]) == 0, estimator
        assert torch.isfinite(grad[1]).all() and torch.count_nonzero(grad[1]) > 0, estimator


def test_details_without_labels_have_no_in_set():
    z = _student(4, rows=2)
    idx = torch.tensor([0, 1]).expand(2, 2)
    top = torch.tensor([0.4, 0.3], dtype=torch.float64).log().expand(2, 2)
    _, details = kl_from_topk(z, idx, top, estimator="tail-bucket", return_details=True)
    assert details.in_set is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_top_k_mass_above_one_by_more_than_rounding_is_refused(dtype):
    """The teacher's top-k probabilities sum to at most 1 up to rounding: 1 + 1e-3 is refused
    by name; a sum above 1 by a few roundings (1 + 8 eps) is not."""
    z = torch.zeros(2, 5, dtype=dtype)
    idx = torch.tensor([0, 1]).expand(2, 2)
    eps = torch.finfo(dtype).eps
    for excess, refused in ((1e-3, True), (8 * eps, False)):
        top = torch.tensor([math.log(0.5 * (1 + excess))] * 2, dtype=dtype).expand(2, 2)
        if refused:
            with pytest.raises(ValueError, match=r"^topk_logp: the teacher's top-k probabilities"):
                kl_from_topk(z, idx, top, estimator="tail-bucket")
        else:
            kl_from_topk(z, idx, top, estimator="tail-bucket")
