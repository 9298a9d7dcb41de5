"""Slow, obviously correct references, and one verbose assert.

Every fast path of :mod:`klest.logits` (the chunked PyTorch engine, the Triton kernels, the fused
LM head, the vocabulary-parallel merge) is tested against :func:`logits_reference`: plain float64
``log_softmax`` formulas, differentiable, with ``0 log 0 = 0`` and ``+inf`` where one
distribution has mass the other lacks.

The sample-based estimators (:func:`klest.kl_estimate`, the value of :func:`klest.kl_penalty`)
are tested against :func:`estimator_formula` and :func:`values_reference`: the textbook formula
of each estimator, written out here in float64 without any of klest's code (no cancellation-free
forms, no shared helpers), with masks, levels and importance weights applied by hand.
"""

from __future__ import annotations

import math

import torch

from klest.testbeds import TabularAutoregressive

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


def estimator_formula(delta, estimator, direction, alpha=None):
    """The per-sample value of an estimator at log-ratios ``delta = log pi - log ref``, float64.

    With ``r = ref / pi = exp(-delta)``: KL(pi||ref) ``k1 = -log r``, ``k2 = (log r)^2 / 2``,
    ``k3 = (r - 1) - log r``, ``abs = |log r|``, ``cv = -log r + alpha (r - 1)``; KL(ref||pi)
    ``k1 = r log r``, ``k2`` the same, ``k3 = r log r - (r - 1)``, ``abs = |r log r|``,
    ``cv = r log r - alpha (r - 1)`` (Schulman, "Approximating KL Divergence", 2020).
    ``alpha`` may be a tensor broadcastable to ``delta``.
    """
    delta = delta.double()
    r = torch.exp(-delta)
    log_r = -delta
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if direction == "pi||ref":
        k1, control = -log_r, r - 1.0
    else:
        k1, control = r * log_r, -(r - 1.0)
    if estimator == "k1":
        return k1
    if estimator == "abs":
        return k1.abs()
    if estimator == "k3":
        return k1 + control
    if estimator == "cv":
        return k1 + alpha * control
    raise ValueError(estimator)


def values_reference(
    logp,
    logp_ref,
    *,
    estimator,
    direction,
    alpha=None,
    mask=None,
    level="token",
    logp_behavior=None,
):
    """What ``kl_estimate(..., reduction="none")`` (token level, ``[..., T]``) or
    ``reduction="per-sequence"`` (sequence level, ``[...]``) must return, in float64.

    Token level: the formula at each token's log-ratio, times ``w = pi / behavior`` of that token
    when off-policy, 0 where masked. Sequence level: the formula at each row's summed log-ratio
    over its valid tokens, times the row's weight ``prod_t w_t``; 0 for a row with no valid token.
    ``alpha``: a number, or ``"loo"`` (each row's coefficient from the other rows by
    :func:`loo_alpha_reference`).
    """
    lp, lr = logp.detach().double(), logp_ref.detach().double()
    keep = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask.bool()
    delta = torch.where(keep, lp - lr, 0.0)
    log_w = torch.zeros_like(delta)
    if logp_behavior is not None:
        log_w = torch.where(keep, lp - logp_behavior.detach().double(), 0.0)
    if level == "sequence" and lp.ndim >= 2:
        delta, log_w, keep = delta.sum(-1), log_w.sum(-1), keep.any(-1)
    w = torch.exp(log_w)
    if alpha == "loo":
        naive = w * estimator_formula(delta, "k1", direction)
        control = w * (
            estimator_formula(delta, "k3", direction) - estimator_formula(delta, "k1", direction)
        )
        coef = loo_alpha_reference(naive, control, keep)
        coef = coef.reshape(coef.shape + (1,) * (delta.ndim - coef.ndim))
        values = naive + coef * control
    else:
        values = w * estimator_formula(delta, estimator, direction, alpha)
    return torch.where(keep, values, 0.0)


def loo_alpha_reference(naive, control, keep):
    """Leave-one-out control-variate coefficient of each row, by a Python loop.

    Row i's coefficient is ``-Cov(a, b) / Var(b)`` over the valid values of every *other* row
    (a row = the last dimension's values; a 1-D input: each sample is a row), with the moments
    centred on those values' own means; 0 when fewer than two values or no variance.
    """
    a = naive.reshape(-1, naive.shape[-1] if naive.ndim >= 2 else 1)
    b = control.reshape(a.shape)
    k = keep.reshape(a.shape)
    coefs = []
    for i in range(a.shape[0]):
        others = torch.ones(a.shape[0], dtype=torch.bool)
        others[i] = False
        sel = k & others.unsqueeze(-1)
        av, bv = a[sel].tolist(), b[sel].tolist()
        n = len(av)
        if n < 2:
            coefs.append(0.0)
            continue
        ma, mb = sum(av) / n, sum(bv) / n
        cov = sum((x - ma) * (y - mb) for x, y in zip(av, bv, strict=True))
        var = sum((y - mb) ** 2 for y in bv)
        coefs.append(-cov / var if var > 0 else 0.0)
    shape = naive.shape[:-1] if naive.ndim >= 2 else naive.shape
    return torch.tensor(coefs, dtype=torch.float64).reshape(shape)


def reduce_reference(values, mask, reduction):
    """Reduce per-token values ``[B, T]`` (or per-row values ``[B]`` with a row mask) by hand:
    row sums over valid tokens, means over non-empty rows / valid tokens (0 when there are none).
    Python floats, loops."""
    rows_v = values.detach().double().reshape(-1, values.shape[-1] if values.ndim >= 2 else 1)
    rows_m = mask.reshape(rows_v.shape).tolist()
    sums, means, total, count = [], [], 0.0, 0
    for vr, mr in zip(rows_v.tolist(), rows_m, strict=True):
        kept = [v for v, m in zip(vr, mr, strict=True) if m]
        total, count = total + sum(kept), count + len(kept)
        if kept:
            sums.append(sum(kept))
            means.append(sum(kept) / len(kept))
    if reduction == "sum":
        return total
    if reduction == "token-mean":
        return total / count if count else 0.0
    per_row = sums if reduction == "seq-mean-token-sum" else means
    return sum(per_row) / len(per_row) if per_row else 0.0


def exact_token_level_gradient(
    target: TabularAutoregressive, direction: str, sampler: TabularAutoregressive | None = None
) -> torch.Tensor:
    r"""The mean of ``grad="token"``: :math:`\nabla \sum_t E_{y_{<t}\sim D}[KL_t(y_{<t})]`
    with the prefix distribution D held fixed (D = pi on-policy; ``sampler`` off-policy, whose
    per-token weights w_t = pi_t / behavior_t reweight only the token at t). By enumeration.
    """
    tokens, valid = target.all_sequences()
    s = target.evaluate(tokens)
    with torch.no_grad():
        lq = (sampler or target).evaluate(tokens).logp
        prob = torch.where(valid, lq, 0.0).sum(-1).exp()  # D(y), no gradient
    lp, lr = s.logits, s.logits_ref
    kl_t = (
        (lp.exp() * (lp - lr)).sum(-1) if direction == "pi||ref" else (lr.exp() * (lr - lp)).sum(-1)
    )
    total = (prob * torch.where(valid, kl_t, 0.0).sum(-1)).sum()
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(total, target.parameters())])


def left_padded(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move each right-padded row's valid tokens to the end of the row (``x`` ``[B, T, ...]``)."""
    shift = mask.shape[1] - mask.sum(1)
    cols = (torch.arange(mask.shape[1]) - shift.unsqueeze(1)) % mask.shape[1]
    index = cols.reshape(*cols.shape, *([1] * (x.ndim - 2))).expand_as(x)
    return x.gather(1, index)
