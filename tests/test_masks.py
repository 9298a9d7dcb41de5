"""Masks applied by bits equal ``torch.where(valid, x, 0)`` exactly, in value and gradient."""

from __future__ import annotations

import math

import pytest
import torch

from klest._masks import keep_valid, keep_valid_into
from klest.testbeds import make_generator


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_keep_valid_equals_where_for_every_value(dtype):
    g = make_generator(0)
    x = torch.randn(5, 7, generator=g).to(dtype)
    x[0, :4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=dtype)
    x[1, :4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0], dtype=dtype)
    valid = torch.rand(5, 7, generator=g) > 0.4
    valid[0, :4] = False  # hidden NaN / inf become +0.0
    valid[1, :4] = True  # kept NaN / inf stay
    expected = torch.where(valid, x, torch.zeros((), dtype=dtype))
    got = keep_valid(x, valid)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # bit for bit
    out = torch.full((5, 14), 7.0, dtype=dtype)[:, ::2]  # a strided destination
    keep_valid_into(out, x, valid)
    assert torch.equal(out.contiguous().view(torch.uint8), expected.view(torch.uint8))


def test_keep_valid_passes_the_gradient_where_valid_only():
    g = make_generator(1)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    valid = torch.rand(4, 6, generator=g) > 0.5
    weights = torch.randn(4, 6, generator=g, dtype=torch.float64)
    (keep_valid(x, valid) * weights).sum().backward()
    assert torch.equal(x.grad, torch.where(valid, weights, 0.0))
    assert torch.autograd.gradcheck(lambda z: keep_valid(z, valid), (x.detach().requires_grad_(),))
