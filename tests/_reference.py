"""Slow, obviously correct references for the exact-from-logits path, and one verbose assert.

Every fast path of :mod:`klest.logits` (the chunked PyTorch engine, the Triton kernels, the fused
LM head, the vocabulary-parallel merge) is tested against :func:`logits_reference`: plain float64
``log_softmax`` formulas, differentiable, with ``0 log 0 = 0`` and ``+inf`` where one
distribution has mass the other lacks.
"""

from __future__ import annotations

import math

import torch

INF = math.inf
OUTPUTS = ("kl_pi_ref", "kl_ref_pi", "entropy", "logp_label", "logp_ref_label")


def logits_reference(z, y, temperature=1.0, labels=None):
    """The seven per-row statistics of ``z``, ``y`` ``[..., V]`` in float64, by log_softmax.

    Keys: ``lse_z``, ``lse_y``, ``kl_pi_ref``, ``kl_ref_pi``, ``entropy``, ``logp_label``,
    ``logp_ref_label`` (0 where the label is outside ``[0, V)`` or ``labels`` is None).
    Differentiable: a row with an infinite KL still has a finite, zero-weighted gradient.
    """
    a = z.double() / temperature
    b = y.double() / temperature
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    q, p = la.exp(), lb.exp()
    fa, fb = a > -INF, b > -INF

    def kl(w, lw, lv, fw, fv):
        both = fw & fv
        diff = torch.where(both, lw - lv, torch.zeros_like(lw))
        finite = (w * diff).sum(-1)
        return torch.where((fw & ~fv).any(-1), torch.full_like(finite, INF), finite)

    out = {
        "lse_z": a.logsumexp(-1),
        "lse_y": b.logsumexp(-1),
        "kl_pi_ref": kl(q, la, lb, fa, fb),
        "kl_ref_pi": kl(p, lb, la, fb, fa),
        "entropy": -(q * torch.where(fa, la, torch.zeros_like(la))).sum(-1),
    }
    v = z.shape[-1]
    zero = torch.zeros(z.shape[:-1], dtype=torch.float64, device=z.device)
    if labels is None:
        out["logp_label"] = out["logp_ref_label"] = zero
    else:
        valid = (labels >= 0) & (labels < v)
        idx = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(-1)
        out["logp_label"] = torch.where(valid, la.gather(-1, idx).squeeze(-1), zero)
        out["logp_ref_label"] = torch.where(valid, lb.gather(-1, idx).squeeze(-1), zero)
    return out


def reference_grads(z, y, temperature, labels, grads):
    """Float64 autograd of ``sum_k g_k * output_k`` (``grads`` in ``OUTPUTS`` order, None
    skipped) with respect to ``z`` and ``y``."""
    zz = z.detach().double().requires_grad_(True)
    yy = y.detach().double().requires_grad_(True)
    out = logits_reference(zz, yy, temperature, labels)
    loss = sum(
        (g.double() * out[k]).sum() for k, g in zip(OUTPUTS, grads, strict=True) if g is not None
    )
    dz, dy = torch.autograd.grad(loss, (zz, yy), allow_unused=True)
    dz = torch.zeros_like(zz) if dz is None else dz
    return dz, (torch.zeros_like(yy) if dy is None else dy)


def assert_verbose_close(got, want, *, atol, rtol=0.0, what=""):
    """Elementwise ``|got - want| <= atol + rtol |want|`` (``atol`` may be a tensor), with equal
    infinities and no NaN; on failure, says how many entries differ and shows the worst."""
    got = got.detach().cpu().double()
    want = want.detach().cpu().double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN at {torch.isnan(got).nonzero().tolist()}"
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    assert torch.equal(inf_got, inf_want), f"{what}: infinities differ: {got} vs {want}"
    assert torch.equal(got[inf_got], want[inf_want]), f"{what}: signs of infinities differ"
    atol = torch.as_tensor(atol, dtype=torch.float64).cpu().expand_as(got)
    g, w, a = got[~inf_got], want[~inf_want], atol[~inf_got]
    err = (g - w).abs()
    bound = a + rtol * w.abs()
    bad = err > bound
    if bad.any():
        i = int((err - bound).argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} entries off; worst at flat index {i}: "
            f"got {float(g[i]):.9g}, want {float(w[i]):.9g}, |diff| {float(err[i]):.3g} > "
            f"{float(bound[i]):.3g}"
        )


def random_log_probs(shape, generator, *, dtype=torch.float64, scale=1.0):
    """Valid log-probabilities (<= 0) of a random size: ``-scale * |N(0, 1)|``."""
    return (-scale * torch.randn(shape, generator=generator, dtype=torch.float64).abs()).to(dtype)
