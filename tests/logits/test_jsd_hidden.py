"""jsd_from_hidden against jsd_from_logits on the materialized logits: values and gradients to
every tensor of both LM heads, over chunkings, masks, labels and the beta ends.

The logits path is itself tested against a float64 reference (test_jsd.py); here both paths get
float64 inputs, so they agree to float64 rounding (1e-12).
"""

from __future__ import annotations

import pytest
import torch

from klest.logits import jsd_from_hidden, jsd_from_logits
from tests._reference import assert_verbose_close


def _heads(n_lead=(2, 5), h=6, h_ref=4, v=19, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    return r(*n_lead, h), r(v, h), r(v), r(*n_lead, h_ref), r(v, h_ref), r(v)


def _grads(out, tensors):
    return torch.autograd.grad(out, tensors, allow_unused=True)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_hidden_equals_logits_values_and_gradients(beta, chunk_size):
    tensors = _heads()
    h, w, b, hr, wr, br = tensors
    mask = torch.tensor([[True, True, False, True, True], [False, True, True, True, True]])
    labels = torch.randint(0, 19, (2, 5), generator=torch.Generator().manual_seed(3))
    labels[1, 4] = -100
    kw = dict(beta=beta, mask=mask, labels=labels, temperature=1.4, reduction="token-mean")
    got = jsd_from_hidden(h, w, hr, wr, bias=b, bias_ref=br, chunk_size=chunk_size, **kw)
    z = torch.nn.functional.linear(h, w, b)
    y = torch.nn.functional.linear(hr, wr, br)
    want = jsd_from_logits(z, y, **kw)
    assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-12)
    for g_got, g_want in zip(_grads(got, tensors), _grads(want, tensors), strict=True):
        assert_verbose_close(g_got, g_want, atol=1e-12)


def test_logits_ref_form_and_no_grad_to_frozen_teacher():
    h, w, _, hr, wr, br = _heads()
    y = torch.nn.functional.linear(hr, wr, br).detach().requires_grad_(True)
    got = jsd_from_hidden(h, w, logits_ref=y, beta=0.6, reduction="none")
    want = jsd_from_logits(torch.nn.functional.linear(h, w), y, beta=0.6, reduction="none")
    assert_verbose_close(got, want, atol=1e-12)
    (dh, dw, dy), (eh, ew, ey) = (_grads(t.sum(), (h, w, y)) for t in (got, want))
    for a, e in ((dh, eh), (dw, ew), (dy, ey)):
        assert_verbose_close(a, e, atol=1e-12)
    frozen = jsd_from_hidden(h, w, hr.detach(), wr.detach(), beta=0.5)
    frozen.backward()
    assert h.grad is not None and hr.grad is None


def test_hidden_bad_input():
    h, w, _, hr, wr, _ = _heads()
    with pytest.raises(ValueError, match="beta"):
        jsd_from_hidden(h, w, hr, wr, beta=2.0)
    with pytest.raises(ValueError, match="backend"):
        jsd_from_hidden(h, w, hr, wr, beta=0.5, backend="gpu")
    with pytest.raises(ValueError, match="either"):
        jsd_from_hidden(h, w, beta=0.5)
