"""decouple: exactly the value forward and exactly the surrogate's gradient backward."""

from __future__ import annotations

import pytest
import torch

import klest
from klest.testbeds import make_generator


def test_decouple_gives_exactly_the_value_and_exactly_the_surrogate_gradient():
    g = make_generator(2)
    a = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.exp(a) * 3.7
    surrogate = b**3 + a
    out = klest.decouple(value, surrogate)
    assert torch.equal(out, value.detach())
    out.sum().backward()
    assert torch.equal(a.grad, torch.ones(5, dtype=torch.float64))  # only through the surrogate
    assert torch.equal(b.grad, 3 * b.detach() ** 2)


def test_decouple_errors():
    with pytest.raises(ValueError, match="value has shape"):
        klest.decouple(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="surrogate is not finite"):
        klest.decouple(torch.zeros(1), torch.tensor([float("inf")]))
    with pytest.raises(TypeError, match=r"value must be a torch\.Tensor"):
        klest.decouple(1.0, torch.zeros(1))
    out = klest.decouple(torch.zeros(1), torch.tensor([float("inf")]), validate=False)
    assert torch.isnan(out).all()  # unchecked: inf - inf
