"""Masks applied by bits equal ``torch.where(valid, x, 0)`` exactly, in value and gradient."""

from __future__ import annotations

import math

import pytest
import torch

import klest
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
    # The backward reuses the forward's bits; twice differentiable (create_graph) as well.
    z = x.detach().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda z: keep_valid(z, valid) * z, (z,))


def _masked_inputs():
    g = make_generator(2)
    logp = -torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.1
    logp_ref = -torch.rand(4, 6, generator=g, dtype=torch.float64) - 0.1
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[0] = True
    return logp, logp_ref, mask


def test_forward_mode_derivatives_pass_through_the_mask():
    """An integer AND carries no tangent: forward-mode AD (``forward_ad``, ``torch.func.jvp``)
    of a masked estimate must still be the directional derivative, not 0."""
    from torch.autograd import forward_ad

    logp, logp_ref, mask = _masked_inputs()
    direction = torch.randn(logp.shape, generator=make_generator(3), dtype=torch.float64)

    def f(x):
        return klest.k1(x, logp_ref, mask=mask, validate=False)

    x = logp.clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(x), x)
    expected = (grad * direction).sum()
    with forward_ad.dual_level():
        tangent = forward_ad.unpack_dual(f(forward_ad.make_dual(logp, direction))).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, expected, rtol=1e-12, atol=1e-15)
    _, tangent = torch.func.jvp(f, (logp,), (direction,))
    torch.testing.assert_close(tangent, expected, rtol=1e-12, atol=1e-15)


def test_torch_func_grad_of_a_masked_penalty_equals_autograd():
    logp, logp_ref, mask = _masked_inputs()
    group = torch.tensor([0, 0, 1, 1])

    def f(x):
        return klest.kl_penalty(x, logp_ref, mask=mask, baseline="loo", group=group)

    x = logp.clone().requires_grad_()
    (expected,) = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(torch.func.grad(f)(logp), expected, rtol=0, atol=0)
