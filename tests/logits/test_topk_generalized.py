"""kl_from_topk's ``"generalized"`` estimator, the unnormalized KL of the two measures restricted
to the teacher's top-k set S, against plain float64 formulas from the full distributions: value
and gradient, both directions, masks, temperature, -inf logits; its exact gap to the full KL
(the same sum over the tail), and the bounds it sits in."""

from __future__ import annotations

import math

import pytest
import torch

import klest
from klest.logits.topk import kl_from_topk
from klest.testbeds import make_generator
from tests._tolerance import assert_close_to_rounding, assert_logits_values_close, logit_scale

DIRECTIONS = ("pi||ref", "ref||pi")


def _case(seed=0, shape=(2, 3), v=24, k=5, peak=2.0):
    g = make_generator(seed)
    z = 1.5 * torch.randn(*shape, v, generator=g, dtype=torch.float64)
    teacher = (peak * torch.randn(*shape, v, generator=g, dtype=torch.float64)).log_softmax(-1)
    top, idx = teacher.topk(k, -1)
    perm = torch.randperm(k, generator=g)  # stored order need not be sorted
    return z, teacher, idx[..., perm], top[..., perm]


def _reference(la: torch.Tensor, lb: torch.Tensor, ids: list[int], direction: str) -> float:
    """One position, textbook: sum over ``ids`` of p log(p / q) - p + q, with (p, q) = (pi, ref)
    or (ref, pi), from full log-probs ``la`` (pi) and ``lb`` (ref); 0 log 0 = 0."""
    total = 0.0
    for v in ids:
        pi, ref = math.exp(float(la[v])), math.exp(float(lb[v]))
        p, q = (pi, ref) if direction == "pi||ref" else (ref, pi)
        if p == 0.0:
            total += q
        elif q == 0.0:
            return math.inf
        else:
            total += p * math.log(p / q) - p + q
    return total


def _torch_reference(z, idx, top, direction, temperature):
    """The same sum in plain differentiable torch, float64, for the gradient."""
    a = torch.log_softmax(z / temperature, -1).gather(-1, idx)
    p, q = (a, top) if direction == "pi||ref" else (top, a)
    return (p.exp() * (p - q) - p.exp() + q.exp()).sum(-1)


# Each term: two log-softmax roundings at the row's scale (logit_scale), a difference, an exp and
# a product (at most 4 more, each at most 1 in size); k = 5 terms: 5 x 6 = 30, and the
# reference rounds as often: 64.
VALUE_ULPS = 64


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_the_formula(direction, temperature):
    """Per-position values equal the textbook sum over S (float64 loop) and the gradient to the
    logits equals autograd's of the plain-torch sum, masked positions 0, within rounding: the
    gradient's entries combine terms of at most (1 + P) x the row's scale / T (VALUE_ULPS)."""
    z, teacher, idx, top = _case()
    mask = torch.tensor([[True, False, True], [True, True, True]])
    z = z.requires_grad_(True)
    got = kl_from_topk(
        z,
        idx,
        top,
        estimator="generalized",
        direction=direction,
        temperature=temperature,
        mask=mask,
        reduction="none",
    )
    la = torch.log_softmax(z.detach() / temperature, -1)
    want = (
        torch.tensor(
            [
                [
                    _reference(la[i, j], teacher[i, j], idx[i, j].tolist(), direction)
                    for j in range(3)
                ]
                for i in range(2)
            ],
            dtype=torch.float64,
        )
        * mask
    )
    assert_logits_values_close(got, want, z, ulps=VALUE_ULPS, temperature=temperature)
    (g,) = torch.autograd.grad(got.sum(), z)
    ref_value = _torch_reference(z, idx, top, direction, temperature)
    (g_ref,) = torch.autograd.grad((ref_value * mask).sum(), z)
    scale = 2 * logit_scale(z, temperature=temperature)[..., None] / temperature
    assert_close_to_rounding(g, g_ref, ulps=VALUE_ULPS, scale=scale, what="gradient")
    assert (g[0, 1] == 0).all()


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gap_to_the_full_kl_is_the_same_sum_over_the_tail(direction):
    """Full KL - generalized = sum over the tail of p log(p/q) - p + q (the masses cancel): the
    bias, exactly, from an independent computation (kl_from_logits and a plain-torch tail sum).
    Both sides are sums of V = 60 terms at the row's scale; each rounds up to V times: 4 V ulps.
    Then non-negative, so generalized <= tail-bucket <= KL, and truncated-raw (KL(pi||ref)), which
    drops the masses, goes negative where the generalized KL cannot."""
    v, k = 60, 6
    z, teacher, idx, top = _case(seed=3, shape=(40,), v=v, k=k)
    exact = klest.kl_from_logits(z, teacher, direction=direction, reduction="none")
    gen = kl_from_topk(z, idx, top, estimator="generalized", direction=direction, reduction="none")
    la = torch.log_softmax(z, -1)
    tail = torch.ones_like(la, dtype=torch.bool).scatter(-1, idx, False)
    p, q = (la, teacher) if direction == "pi||ref" else (teacher, la)
    tail_sum = torch.where(tail, p.exp() * (p - q) - p.exp() + q.exp(), 0.0).sum(-1)
    assert_logits_values_close(exact - gen, tail_sum, z, teacher, ulps=4 * v, what="gap")
    assert (gen >= 0).all()
    bucket = kl_from_topk(
        z, idx, top, estimator="tail-bucket", direction=direction, reduction="none"
    )
    slack = 4 * v * torch.finfo(torch.float64).eps * logit_scale(z, teacher)
    assert (gen <= bucket + slack).all()
    assert (bucket <= exact + slack).all()
    assert (tail_sum > 1e-3).all()  # the bound is strict here: the gap is real
    if direction == "pi||ref":  # on the teacher's top-k, pi's terms p log(p/q) can sum below 0
        raw = kl_from_topk(z, idx, top, estimator="truncated-raw", reduction="none")
        assert (raw < 0).any()


def test_zero_where_the_models_agree_on_the_set():
    """A teacher equal to the student on S (different elsewhere) gives 0 up to rounding; the
    full KL is positive. The differences a - b are rounding (the row's scale) and each term is
    of their square: far below eps."""
    z, _, idx, _ = _case(seed=5, shape=(4,), v=30, k=4)
    la = torch.log_softmax(z, -1)
    g = make_generator(6)
    other = torch.log_softmax(la + torch.randn(la.shape, generator=g, dtype=torch.float64), -1)
    # the teacher: the student's probabilities on S, the rest of its mass spread like `other`
    in_s = torch.zeros_like(la, dtype=torch.bool).scatter(-1, idx, True)
    rest = torch.log1p(-la.gather(-1, idx).exp().sum(-1, keepdim=True))
    other_rest = torch.where(in_s, -math.inf, other).logsumexp(-1, keepdim=True)
    teacher = torch.where(in_s, la, other - other_rest + rest)
    top = teacher.gather(-1, idx)
    for direction in DIRECTIONS:
        gen = kl_from_topk(z, idx, top, estimator="generalized", direction=direction)
        full = klest.kl_from_logits(z, teacher, direction=direction)
        assert abs(float(gen)) <= 1e-14 < float(full)


def test_minus_inf_logit_in_the_set():
    """pi_v = 0 at a top-k token: KL(pi||ref)'s term is ref_v (finite, with a finite gradient);
    KL(ref||pi) is +inf there and passes no gradient."""
    z, teacher, idx, top = _case(seed=8, shape=(2,), v=12, k=3)
    z[0, idx[0, 1]] = -math.inf
    z = z.requires_grad_(True)
    la = torch.log_softmax(z.detach(), -1)
    gen = kl_from_topk(z, idx, top, estimator="generalized", reduction="none")
    want = torch.tensor(
        [_reference(la[i], teacher[i], idx[i].tolist(), "pi||ref") for i in (0, 1)],
        dtype=torch.float64,
    )
    assert_logits_values_close(gen, want, z, ulps=VALUE_ULPS)
    (g,) = torch.autograd.grad(gen.sum(), z)
    assert torch.isfinite(g).all()
    rev = kl_from_topk(z, idx, top, estimator="generalized", direction="ref||pi", reduction="none")
    assert math.isinf(float(rev[0].detach())) and math.isfinite(float(rev[1].detach()))
    (g,) = torch.autograd.grad(rev[1], z)
    assert (g[0] == 0).all() and torch.isfinite(g).all()
