"""Exact categorical KL against a slow float64 loop, gradcheck, and the closed-form gradients."""

from __future__ import annotations

import math

import pytest
import torch

import klest
from klest.testbeds import make_generator
from tests._tolerance import assert_logits_values_close


def slow_kl(z: torch.Tensor, y: torch.Tensor) -> float:
    """KL(softmax z || softmax y) for one row, by a Python loop in float64."""
    z, y = z.double().tolist(), y.double().tolist()
    lz = math.log(sum(math.exp(v) for v in z if v != -math.inf))
    ly = math.log(sum(math.exp(v) for v in y if v != -math.inf))
    total = 0.0
    for a, b in zip(z, y, strict=True):
        if a == -math.inf:
            continue
        q = math.exp(a - lz)
        total += q * ((a - lz) - (b - ly)) if b != -math.inf else math.inf
    return total


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 11), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_matches_slow_reference(shape, dtype, direction):
    g = make_generator(len(shape))
    z = (torch.randn(shape, generator=g) * 2).to(dtype)
    y = (torch.randn(shape, generator=g) * 2).to(dtype)
    out = klest.categorical_kl(z, y, direction=direction, reduction="none")
    a, b = (z, y) if direction == "pi||ref" else (y, z)
    flat_a, flat_b = a.reshape(-1, shape[-1]), b.reshape(-1, shape[-1])
    expected = torch.tensor(
        [slow_kl(r, s) for r, s in zip(flat_a, flat_b, strict=True)], dtype=torch.float64
    )
    # Inputs are cast exactly to float32/64, so the tolerance is float32 (float64) arithmetic's:
    # a log-softmax and a sum over V <= 11, a few roundings (8) of the row's logit scale.
    assert_logits_values_close(out.reshape(-1), expected, flat_a, flat_b, ulps=8)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_minus_inf_logits_are_outside_the_support():
    z = torch.tensor([0.3, float("-inf"), -1.0, 0.2], dtype=torch.float64)
    y = torch.tensor([0.1, 0.5, float("-inf"), -0.4], dtype=torch.float64)
    # pi puts mass where ref has none: KL(pi||ref) = inf; the converse is finite.
    assert math.isinf(float(klest.categorical_kl(z, y)))
    y2 = torch.tensor([0.1, 0.5, 2.0, -0.4], dtype=torch.float64)
    assert float(klest.categorical_kl(z, y2)) == pytest.approx(slow_kl(z, y2), rel=1e-12)
    out = klest.categorical_kl(z, y2, direction="ref||pi", reduction="none")
    assert math.isinf(float(out))
    z3 = torch.tensor([0.3, float("-inf"), -1.0, 0.2], dtype=torch.float64)
    y3 = torch.tensor([0.1, float("-inf"), 2.0, -0.4], dtype=torch.float64)
    val = klest.categorical_kl(z3, y3, direction="ref||pi", reduction="none")
    assert math.isfinite(float(val)) and float(val) == pytest.approx(slow_kl(y3, z3), rel=1e-12)


def test_identical_inputs_give_exactly_zero():
    z = torch.randn(4, 9, generator=make_generator(1))
    for direction in ("pi||ref", "ref||pi"):
        assert torch.equal(
            klest.categorical_kl(z, z.clone(), direction=direction, reduction="none"),
            torch.zeros(4),
        )


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_gradcheck_both_sides(direction):
    g = make_generator(2)
    z = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: klest.categorical_kl(a, b, direction=direction, reduction="none"), (z, y)
    )


def test_gradients_match_the_closed_forms():
    g = make_generator(3)
    z = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    q, p = torch.softmax(z.detach(), -1), torch.softmax(y.detach(), -1)
    lq, lp = q.log(), p.log()
    kl_qp = (q * (lq - lp)).sum()
    kl_pq = (p * (lp - lq)).sum()
    dz, dy = torch.autograd.grad(klest.categorical_kl(z, y), (z, y))
    assert torch.allclose(dz, q * (lq - lp - kl_qp)) and torch.allclose(dy, p - q)
    dz, dy = torch.autograd.grad(klest.categorical_kl(z, y, direction="ref||pi"), (z, y))
    assert torch.allclose(dz, q - p) and torch.allclose(dy, p * (lp - lq - kl_pq))


def test_mask_and_reduction():
    g = make_generator(4)
    z, y = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    mask = torch.rand(3, 4, generator=g) > 0.3
    mask[:, 0] = True
    per_position = klest.categorical_kl(z, y, reduction="none")
    out = klest.categorical_kl(z, y, mask=mask, reduction="seq-mean-token-sum")
    assert torch.allclose(out, (per_position * mask).sum(-1).mean())
