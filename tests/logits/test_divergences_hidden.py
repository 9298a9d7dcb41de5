"""The from-hidden-states divergences (jsd_from_hidden, skew_kl_from_hidden, tv_from_hidden)
against their materialized-logits forms: values and gradients to every tensor of both LM heads,
over chunkings, masks, labels, temperature and the parameter ends.

The logits forms are themselves tested against a float64 reference written from the
definitions (test_jsd.py); here both paths get float64 inputs, so they agree to float64
rounding (1e-12). ``gradcheck`` (float64 finite differences) checks the fused backward
directly, independently of the logits path. The Triton path (float32 kernels, run by the
interpreter on CPU under ``TRITON_INTERPRET=1``) is compared with the PyTorch one.
"""

from __future__ import annotations

import pytest
import torch

from klest.logits import (
    jsd_from_hidden,
    jsd_from_logits,
    skew_kl_from_hidden,
    skew_kl_from_logits,
    tv_from_hidden,
    tv_from_logits,
)
from klest.logits.kernels import triton_available
from tests._reference import assert_verbose_close
from tests._tolerance import assert_close_to_rounding, logit_scale

# name -> (from hidden, from logits, the divergence's options); the parameter ends (beta 0 / 1,
# alpha 0) are the KLs, taken by kl_from_hidden.
CASES = {
    "jsd-0.3": (jsd_from_hidden, jsd_from_logits, dict(beta=0.3)),
    "jsd-0": (jsd_from_hidden, jsd_from_logits, dict(beta=0.0)),
    "jsd-1": (jsd_from_hidden, jsd_from_logits, dict(beta=1.0)),
    "skew-pi-0.2": (skew_kl_from_hidden, skew_kl_from_logits, dict(alpha=0.2)),
    "skew-ref-0.7": (
        skew_kl_from_hidden,
        skew_kl_from_logits,
        dict(alpha=0.7, direction="ref||pi"),
    ),
    "skew-pi-0": (skew_kl_from_hidden, skew_kl_from_logits, dict(alpha=0.0)),
    "skew-ref-0": (
        skew_kl_from_hidden,
        skew_kl_from_logits,
        dict(alpha=0.0, direction="ref||pi"),
    ),
    "tv": (tv_from_hidden, tv_from_logits, {}),
}
SMOOTH = ("jsd-0.3", "skew-pi-0.2", "skew-ref-0.7", "tv")


def _heads(n_lead=(2, 5), h=6, h_ref=4, v=19, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)

    return r(*n_lead, h), r(v, h), r(v), r(*n_lead, h_ref), r(v, h_ref), r(v)


def _grads(out, tensors):
    return torch.autograd.grad(out, tensors, allow_unused=True)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_hidden_equals_logits_values_and_gradients(case, chunk_size):
    from_hidden, from_logits, div = CASES[case]
    tensors = _heads()
    h, w, b, hr, wr, br = tensors
    mask = torch.tensor([[True, True, False, True, True], [False, True, True, True, True]])
    labels = torch.randint(0, 19, (2, 5), generator=torch.Generator().manual_seed(3))
    labels[1, 4] = -100
    kw = dict(div, mask=mask, labels=labels, temperature=1.4, reduction="token-mean")
    got = from_hidden(h, w, hr, wr, bias=b, bias_ref=br, chunk_size=chunk_size, **kw)
    z = torch.nn.functional.linear(h, w, b)
    y = torch.nn.functional.linear(hr, wr, br)
    want = from_logits(z, y, **kw)
    assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-12)
    for g_got, g_want in zip(_grads(got, tensors), _grads(want, tensors), strict=True):
        assert_verbose_close(g_got, g_want, atol=1e-12, what=case)


@pytest.mark.parametrize("case", SMOOTH)
def test_per_position_values_details_and_upstream_gradient(case):
    """``reduction="none"`` row by row with a non-unit upstream gradient, and the details (label
    log-probs) equal to the logits form's."""
    from_hidden, from_logits, div = CASES[case]
    tensors = _heads(gen_seed=1)
    h, w, b, hr, wr, br = tensors
    labels = torch.randint(0, 19, (2, 5), generator=torch.Generator().manual_seed(5))
    kw = dict(div, labels=labels, reduction="none", return_details=True)
    got, got_details = from_hidden(h, w, hr, wr, bias=b, bias_ref=br, chunk_size=4, **kw)
    want, want_details = from_logits(
        torch.nn.functional.linear(h, w, b), torch.nn.functional.linear(hr, wr, br), **kw
    )
    assert_verbose_close(got, want, atol=1e-12)
    assert_verbose_close(got_details.logp, want_details.logp, atol=1e-12)
    upstream = torch.linspace(-1.0, 2.0, 10, dtype=torch.float64).reshape(2, 5)
    for g_got, g_want in zip(
        _grads((got * upstream).sum(), tensors),
        _grads((want * upstream).sum(), tensors),
        strict=True,
    ):
        assert_verbose_close(g_got, g_want, atol=1e-12, what=case)


@pytest.mark.parametrize("case", SMOOTH)
def test_gradcheck_both_heads(case):
    """Finite differences in float64 through the fused Function, both models' hidden states,
    weights and biases at once (TV: no ties between pi and ref at these random logits, so it
    is differentiable there)."""
    from_hidden, _, div = CASES[case]
    h, w, b, hr, wr, br = _heads(n_lead=(2, 3), h=3, h_ref=2, v=7, gen_seed=2)
    mask = torch.tensor([[True, False, True], [True, True, True]])

    def f(h, w, b, hr, wr, br, stash=False):
        return from_hidden(
            h, w, hr, wr, bias=b, bias_ref=br, mask=mask, temperature=1.3, chunk_size=2,
            stash=stash, **div,
        )  # fmt: skip

    tensors = (h, w, b, hr, wr, br)
    assert torch.autograd.gradcheck(f, tensors)
    # gradcheck backpropagates one graph several times: the recomputing backward. The default
    # (the gradients made in the forward pass) matches it to float64 rounding (8 ulps of the
    # largest entry: the same sums and products in other orders).
    got = torch.autograd.grad(f(*tensors, stash=None), tensors)
    want = torch.autograd.grad(f(*tensors), tensors)
    for a, e in zip(got, want, strict=True):
        assert_close_to_rounding(a, e, ulps=8, what=f"{case} gradient in the forward")


@pytest.mark.parametrize("case", CASES)
def test_logits_ref_form_and_no_grad_to_frozen_teacher(case):
    from_hidden, from_logits, div = CASES[case]
    h, w, _, hr, wr, br = _heads()
    y = torch.nn.functional.linear(hr, wr, br).detach().requires_grad_(True)
    got = from_hidden(h, w, logits_ref=y, reduction="none", **div)
    want = from_logits(torch.nn.functional.linear(h, w), y, reduction="none", **div)
    assert_verbose_close(got, want, atol=1e-12)
    (dh, dw, dy), (eh, ew, ey) = (_grads(t.sum(), (h, w, y)) for t in (got, want))
    for a, e in ((dh, eh), (dw, ew), (dy, ey)):
        assert_verbose_close(a, e, atol=1e-12)
    frozen = from_hidden(h, w, hr.detach(), wr.detach(), **div)
    frozen.backward()
    assert h.grad is not None and hr.grad is None


def test_gradient_to_masked_positions_is_zero():
    h, w, _, hr, wr, _ = _heads()
    mask = torch.zeros(2, 5, dtype=torch.bool)
    mask[0, 1] = True
    for from_hidden, _, div in (CASES["skew-pi-0.2"], CASES["tv"]):
        dh, dhr = _grads(from_hidden(h, w, hr, wr, mask=mask, **div), (h, hr))
        keep = torch.zeros(2, 5, 1, dtype=torch.bool)
        keep[0, 1] = True
        assert bool((dh.masked_select(~keep) == 0).all())
        assert bool((dhr.masked_select(~keep) == 0).all())
        assert float(dh[0, 1].abs().sum()) > 0


def test_hidden_bad_input():
    h, w, _, hr, wr, _ = _heads()
    with pytest.raises(ValueError, match="beta"):
        jsd_from_hidden(h, w, hr, wr, beta=2.0)
    with pytest.raises(ValueError, match="alpha"):
        skew_kl_from_hidden(h, w, hr, wr, alpha=1.0)
    with pytest.raises(TypeError, match="alpha"):
        skew_kl_from_hidden(h, w, hr, wr, alpha="0.5")
    with pytest.raises(ValueError, match="direction"):
        skew_kl_from_hidden(h, w, hr, wr, alpha=0.5, direction="forward")
    with pytest.raises(ValueError, match="backend"):
        tv_from_hidden(h, w, hr, wr, backend="gpu")
    for from_hidden, _, div in (CASES["jsd-0.3"], CASES["skew-pi-0.2"], CASES["tv"]):
        with pytest.raises(ValueError, match="either"):
            from_hidden(h, w, **div)
    with pytest.raises(ValueError, match="shape"):
        tv_from_hidden(h, w[:, :4], hr, wr)


needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="needs triton with CUDA or TRITON_INTERPRET=1 (make test sets it)",
)


@needs_triton
@pytest.mark.parametrize("case", SMOOTH)
def test_triton_hidden_matches_torch(case):
    """Float32 kernels against the float32 PyTorch path on the same inputs. The value (a mean
    over 3 rows of 4 positions' sums): each path rounds each position's divergence at its
    row's logit scale (:func:`logit_scale`), a few roundings of terms that size (16), twice; so
    32 x 4 positions x the largest row's scale (measured: at most 0.05). The weight's gradient
    sums the logits' gradient, which cancels at the scale of its largest entries, over V = 37
    and N = 12 terms: twice 64 roundings of its largest entry (measured: at most 33)."""
    from_hidden, _, div = CASES[case]
    g = torch.Generator().manual_seed(4)
    h, w, hr, wr = (torch.randn(*s, generator=g) for s in ((3, 4, 8), (37, 8), (3, 4, 5), (37, 5)))
    w.requires_grad_(True)
    got, want = (
        from_hidden(h, w, hr, wr, backend=backend, chunk_size=5, **div)
        for backend in ("triton", "torch")
    )
    scale = 4 * logit_scale(h @ w.T, hr @ wr.T).max()
    assert_close_to_rounding(got, want, ulps=32, scale=scale, what=case)
    (dw_got,), (dw_want,) = (torch.autograd.grad(t, (w,)) for t in (got, want))
    assert_close_to_rounding(dw_got, dw_want, ulps=128, what=case)
