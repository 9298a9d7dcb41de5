"""``valid_vocab_size``: padding columns (rows of an LM head) are left out, exactly.

The answer with ``valid_vocab_size=V'`` must be the answer on the first V' columns given
directly (the same arithmetic on the same numbers: bit for bit in value and gradient), the
padding's gradient 0, whatever the padding holds; and two models padded to different widths
(a teacher's 152064 against a student's 151936) meet on their common V'.
"""

from __future__ import annotations

import pytest
import torch

import klest

V_REAL, V_STUDENT, V_TEACHER = 11, 13, 16


def _logits():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 4, V_STUDENT, generator=g, dtype=torch.float64)
    y = torch.randn(2, 4, V_TEACHER, generator=g, dtype=torch.float64)
    z[..., V_REAL:] = 30.0  # padding that would dominate if it counted
    y[..., V_REAL:] = -30.0
    labels = torch.randint(0, V_REAL, (2, 4), generator=g)
    return z, y, labels


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
@pytest.mark.parametrize("reduction", ["seq-mean-token-sum", "none"])
def test_logits_of_different_padded_widths_meet_on_the_real_vocabulary(direction, reduction):
    z, y, labels = _logits()
    w = torch.rand(2, 4, dtype=torch.float64) if reduction == "none" else 1.0

    def run(a, b, **kw):
        a = a.clone().requires_grad_()
        kl, d = klest.kl_from_logits(
            a,
            b,
            direction=direction,
            reduction=reduction,
            labels=labels,
            return_details=True,
            **kw,
        )
        (g,) = torch.autograd.grad((kl * w).sum() + d.logp.sum(), [a])
        return kl.detach(), d.logp, g

    got = run(z, y, valid_vocab_size=V_REAL)
    want = run(z[..., :V_REAL].contiguous(), y[..., :V_REAL].contiguous())
    for a, e in zip(got[:2], want[:2], strict=True):
        assert torch.equal(a, e)
    assert torch.equal(got[2][..., :V_REAL], want[2])
    assert torch.equal(got[2][..., V_REAL:], torch.zeros_like(got[2][..., V_REAL:]))


def test_hidden_heads_of_different_padded_sizes_meet_on_the_real_vocabulary():
    g = torch.Generator().manual_seed(4)
    h, h_ref = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 4, generator=g)
    w, w_ref = torch.randn(V_STUDENT, 5, generator=g), torch.randn(V_TEACHER, 4, generator=g)
    b = torch.randn(V_STUDENT, generator=g)

    def run(w_, w_ref_, b_, **kw):
        leaves = [t.clone().requires_grad_() for t in (h, w_, b_)]
        kl = klest.kl_from_hidden(leaves[0], leaves[1], h_ref, w_ref_, bias=leaves[2], **kw)
        return (kl.detach(), *torch.autograd.grad(kl, leaves))

    got = run(w, w_ref, b, valid_vocab_size=V_REAL)
    want = run(w[:V_REAL], w_ref[:V_REAL], b[:V_REAL])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2][:V_REAL], want[2]) and torch.equal(got[3][:V_REAL], want[3])
    assert not got[2][V_REAL:].any() and not got[3][V_REAL:].any()


def test_mismatched_widths_point_to_valid_vocab_size():
    z, y, _ = _logits()
    with pytest.raises(ValueError, match="valid_vocab_size=<the tokenizer's vocabulary size>"):
        klest.kl_from_logits(z, y)
    with pytest.raises(ValueError, match=r"valid_vocab_size must be in \[1, V = 13\]"):
        klest.kl_from_logits(z, y, valid_vocab_size=14)
    with pytest.raises(TypeError, match="valid_vocab_size must be an int"):
        klest.kl_from_logits(z, y, valid_vocab_size=11.0)


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b, **kw: klest.jsd_from_logits(a, b, beta=0.3, **kw),
        lambda a, b, **kw: klest.skew_kl_from_logits(a, b, alpha=0.2, **kw),
        lambda a, b, **kw: klest.tv_from_logits(a, b, **kw),
    ],
    ids=["jsd", "skew", "tv"],
)
def test_divergences_leave_the_padding_out(call):
    z, y, _ = _logits()

    def run(a, b, **kw):
        a = a.clone().requires_grad_()
        value = call(a, b, **kw)
        return value.detach(), torch.autograd.grad(value, [a])[0]

    got = run(z, y, valid_vocab_size=V_REAL)
    want = run(z[..., :V_REAL].contiguous(), y[..., :V_REAL].contiguous())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][..., :V_REAL], want[1])
    assert not got[1][..., V_REAL:].any()


def test_divergences_from_hidden_leave_the_padding_out():
    g = torch.Generator().manual_seed(7)
    h, h_ref = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 4, generator=g)
    w, w_ref = torch.randn(V_STUDENT, 5, generator=g), torch.randn(V_TEACHER, 4, generator=g)
    for fn in (klest.jsd_from_hidden, klest.tv_from_hidden):
        options = {"beta": 0.5} if fn is klest.jsd_from_hidden else {}
        got = fn(h, w, h_ref, w_ref, valid_vocab_size=V_REAL, **options)
        assert torch.equal(got, fn(h, w[:V_REAL], h_ref, w_ref[:V_REAL], **options))
