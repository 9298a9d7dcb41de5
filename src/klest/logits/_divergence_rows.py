r"""Per-row divergences beyond the KL between two logit rows: mixture KLs and total variation.

The chunked PyTorch engine behind :mod:`klest.logits.divergences`, the companion of the KL
engine :mod:`klest.logits._rows` (whose chunking helpers it uses). For pi's logits ``z`` and
ref's logits ``y`` (``[N, V]``), :math:`q = \mathrm{softmax}(z/\tau)` (pi),
:math:`p = \mathrm{softmax}(y/\tau)` (ref), a :class:`Divergence` is one of

* a combination of the two KLs to the mixture :math:`m = w\,p + (1 - w)\,q` (:math:`0 < w < 1`):

  .. math::
      D = c_q\, KL(q\|m) + c_p\, KL(p\|m),

  which is the generalized JSD (:math:`c_q = 1 - w`, :math:`c_p = w`) and both skew KLs
  (one coefficient 1, the other 0). With :math:`\log m = \mathrm{logaddexp}(\log(1-w) + \log q,
  \log w + \log p)` and :math:`r = (c_q q + c_p p)/m`, the gradients with respect to the
  probabilities are :math:`G_q = c_q(\log q - \log m) - (1-w) r` and
  :math:`G_p = c_p(\log p - \log m) - w r` (the ratios :math:`q/m \le 1/(1-w)` and
  :math:`p/m \le 1/w` stay finite);
* the total variation :math:`TV = \tfrac12 \sum_v |q_v - p_v|`, with
  :math:`G_q = \tfrac12 \mathrm{sign}(q - p) = -G_p` (``sign(0) = 0``: at :math:`q_v = p_v` the
  subgradient 0, which at :math:`q = p` is the minimum's zero gradient).

Through the softmax, :math:`\partial D/\partial z = \tfrac1\tau\, q\odot(G_q - \langle q,
G_q\rangle)` and :math:`\partial D/\partial y = \tfrac1\tau\, p\odot(G_p - \langle p,
G_p\rangle)`. Entries ``-inf`` are outside the support (``0 log 0 = 0``); a term with zero
probability contributes nothing, so none of these divergences is ever infinite.

:func:`divergence_rows` gives the per-row values; :func:`divergence_rows_grads` also the
gradients for upstream gradients known before the call, from the same read of each chunk of
rows (the Triton kernel: one read of a row of up to 16384 entries, three in a row of a longer
one); :func:`divergence_grads` recomputes them from the logits (one more read) in a backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klest.logits._chunking import (
    chunks,
    label_logps,
    lse,
    put,
    put_rows,
    scaled,
    take,
    work_dtype,
)
from klest.logits._rows import row_flags, zeroed_rows_buffer
from klest.logits._stats import Divergence
from klest.logits.kernels import (
    divergence_backward,
    divergence_forward,
    divergence_fused,
    kl_logits_forward,
)

# Float32 buffers of V entries per row of a chunk in the backward (the larger pass): a, b,
# log q, log p, q, p, log m, r, G_q, G_p.
BUFFERS_PER_ROW = 10
ROW_OUTPUTS = ("value", "entropy", "logp_label", "logp_ref_label", "lse_z", "lse_y", "s_q", "s_p")
"""The per-row outputs of :func:`divergence_rows`, in order (``s_q = <q, G_q>`` and
``s_p = <p, G_p>``: from the Triton backend, for its backward; 0 from the PyTorch one)."""


def _where_support(w: Tensor, x: Tensor) -> Tensor:
    """``x`` where the probability ``w`` is positive, else 0 (``x`` may be infinite there)."""
    return torch.where(w > 0, x, 0.0)


def _log_mixture(la: Tensor, lb: Tensor, w: float) -> Tensor:
    """``log(w p + (1 - w) q)`` from ``la = log q`` and ``lb = log p``."""
    return torch.logaddexp(la + math.log1p(-w), lb + math.log(w))


def _sum_terms(div: Divergence, la: Tensor, lb: Tensor, q: Tensor, p: Tensor) -> Tensor:
    """The divergence's terms summed over the columns given (a shard's part can be < 0)."""
    if div.kind == "tv":
        return 0.5 * (q - p).abs().sum(-1)
    lm = _log_mixture(la, lb, div.w)
    value = torch.zeros_like(q[:, 0])
    for c, prob, logprob in ((div.c_q, q, la), (div.c_p, p, lb)):
        if c != 0.0:
            value = value + c * (prob * _where_support(prob, logprob - lm)).sum(-1)
    return value


def _value(div: Divergence, la: Tensor, lb: Tensor, q: Tensor, p: Tensor) -> Tensor:
    return _sum_terms(div, la, lb, q, p).clamp_(min=0.0)


def _prob_grads(
    div: Divergence, la: Tensor, lb: Tensor, q: Tensor, p: Tensor
) -> tuple[Tensor, Tensor]:
    """``(G_q, G_p)``: the divergence's gradient w.r.t. the probabilities (module docstring)."""
    if div.kind == "tv":
        half_sign = 0.5 * torch.sign(q - p)
        return half_sign, -half_sign
    lm = _log_mixture(la, lb, div.w)
    r = torch.zeros_like(q)
    for c, prob, logprob in ((div.c_q, q, la), (div.c_p, p, lb)):
        if c != 0.0:
            r += c * _where_support(prob, (logprob - lm).exp())
    g_q = div.c_q * _where_support(q, la - lm) - (1.0 - div.w) * r
    g_p = div.c_p * _where_support(p, lb - lm) - div.w * r
    return g_q, g_p


def _through_softmax(prob: Tensor, g: Tensor) -> Tensor:
    """``prob * (g - <prob, g>)``: a gradient w.r.t. probabilities, taken to the logits."""
    mean = (prob * g).sum(-1, keepdim=True)
    return g.sub_(mean).mul_(prob)


def _log_probs(z: Tensor, y: Tensor, sel: slice | Tensor, inv_tau: float, dtype: torch.dtype):
    a = scaled(take(z, sel), inv_tau, dtype)
    b = scaled(take(y, sel), inv_tau, dtype)
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    return a, b, la, lb


def divergence_rows(
    z: Tensor,
    y: Tensor,
    div: Divergence,
    *,
    inv_tau: float,
    labels: Tensor | None,
    rows: Tensor | None,
    want_entropy: bool,
    chunk: int,
    backend: str = "torch",
    keep: Tensor | None = None,
) -> Tensor:
    """``[8, N]`` per-row outputs (``ROW_OUTPUTS``) of the selected rows (others 0): by ``rows``
    (int indices, or None for all) or, on the Triton backend, ``keep`` (a bool flag per row).

    Rows whose logits have NaN, ``+inf`` or nothing but ``-inf`` get a non-finite ``lse``
    (the caller rejects them).
    """
    n = z.shape[0]
    if backend == "triton":
        tau = 1.0 / inv_tau
        keep = row_flags(rows, keep, n)
        stats = kl_logits_forward(
            z,
            y,
            temperature=tau,
            labels=labels,
            want_kl_pi_ref=False,
            want_kl_ref_pi=False,
            want_entropy=want_entropy,
            keep=keep,
        )
        mix = divergence_forward(z, y, stats.lse_z, stats.lse_y, div, temperature=tau, keep=keep)
        out = torch.stack(
            (mix[0], stats.entropy, stats.logp_label, stats.logp_ref_label,
             stats.lse_z, stats.lse_y, mix[1], mix[2])
        )  # fmt: skip
        return out
    out, _, _ = _torch_rows(z, y, div, inv_tau, labels, rows, want_entropy, chunk, None, None, None)
    return out


def divergence_rows_grads(
    z: Tensor,
    y: Tensor,
    div: Divergence,
    grad: Tensor,
    *,
    inv_tau: float,
    labels: Tensor | None,
    rows: Tensor | None,
    want_entropy: bool,
    chunk: int,
    need_z: bool,
    need_y: bool,
    backend: str = "torch",
    keep: Tensor | None = None,
    dz: Tensor | None = None,
    dy: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`divergence_rows` and, from the same read of each row, ``grad[n] * dD_n/dz`` and
    ``... /dy`` (``grad``: the upstream gradients, known before the call), written into ``dz`` /
    ``dy`` when given (e.g. the logits themselves), else into new tensors; 0 on rows not
    selected."""
    n = z.shape[0]
    if backend == "triton":
        stats, mix, dz, dy = divergence_fused(
            z, y, grad, div, temperature=1.0 / inv_tau, labels=labels,
            want_entropy=want_entropy, need_grad_z=need_z, need_grad_y=need_y, dz=dz, dy=dy,
            keep=row_flags(rows, keep, n),
        )  # fmt: skip
        out = torch.stack(
            (mix[0], stats[4], stats[5], stats[6], stats[0], stats[1], mix[1], mix[2])
        )
        return out, dz, dy
    dz = zeroed_rows_buffer(z, rows, into=dz) if need_z else None
    dy = zeroed_rows_buffer(y, rows, into=dy) if need_y else None
    return _torch_rows(z, y, div, inv_tau, labels, rows, want_entropy, chunk, grad, dz, dy)


def _torch_rows(
    z: Tensor,
    y: Tensor,
    div: Divergence,
    inv_tau: float,
    labels: Tensor | None,
    rows: Tensor | None,
    want_entropy: bool,
    chunk: int,
    grad: Tensor | None,
    dz: Tensor | None,
    dy: Tensor | None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The chunked PyTorch engine: ``[8, N]`` outputs, and the gradients for ``grad`` into
    ``dz`` / ``dy`` (those given) from each chunk while it is in cache."""
    n = z.shape[0]
    out = torch.zeros(len(ROW_OUTPUTS), n, dtype=work_dtype(z), device=z.device)
    for sel in chunks(n, rows, chunk):
        a, b, la, lb = _log_probs(z, y, sel, inv_tau, out.dtype)
        q, p = la.exp(), lb.exp()
        value = _value(div, la, lb, q, p)
        lab = None if labels is None else take(labels, sel)
        zeros = torch.zeros_like(value)
        entropy = -(q * _where_support(q, la)).sum(-1) if want_entropy else zeros
        stats = (value, entropy, label_logps(la, lab), label_logps(lb, lab))
        put(out, sel, torch.stack((*stats, lse(a, la), lse(b, lb), zeros, zeros)))
        if grad is not None and (dz is not None or dy is not None):
            _write_grads(div, la, lb, q, p, take(grad, sel), inv_tau, sel, dz, dy)
    return out, dz, dy


def _write_grads(div, la, lb, q, p, grad, inv_tau, sel, dz, dy) -> None:
    """``grad / tau * prob (G - <prob, G>)`` of one chunk into ``dz`` / ``dy`` (those given)."""
    g_q, g_p = _prob_grads(div, la, lb, q, p)
    scale = grad.to(q.dtype).unsqueeze(1) * inv_tau
    for target, prob, g in ((dz, q, g_q), (dy, p, g_p)):
        if target is not None:
            put_rows(target, sel, _through_softmax(prob, g).mul_(scale))


def divergence_grads(
    z: Tensor,
    y: Tensor,
    div: Divergence,
    grad: Tensor,
    *,
    inv_tau: float,
    rows: Tensor | None,
    need_z: bool,
    need_y: bool,
    chunk: int,
    backend: str = "torch",
    saved: Tensor | None = None,
    keep: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """``grad[n] * dD_n/dz`` and ``... /dy`` (in the inputs' dtypes; 0 on rows not selected,
    by ``rows`` or ``keep`` as in :func:`divergence_rows`).

    The Triton backend reads ``lse_z``, ``lse_y``, ``s_q`` and ``s_p`` from ``saved`` (what
    :func:`divergence_rows` returned); the PyTorch one recomputes everything."""
    if backend == "triton":
        assert saved is not None
        lse_z, lse_y, s_q, s_p = (saved[ROW_OUTPUTS.index(k)] for k in ROW_OUTPUTS[4:])
        dz, dy = divergence_backward(
            z, y, lse_z, lse_y, s_q, s_p, grad.float(), div, temperature=1.0 / inv_tau,
            need_grad_z=need_z, need_grad_y=need_y,
            keep=row_flags(rows, keep, z.shape[0]),
        )  # fmt: skip
        return dz, dy
    dz = zeroed_rows_buffer(z, rows) if need_z else None
    dy = zeroed_rows_buffer(y, rows) if need_y else None
    if not (need_z or need_y):
        return dz, dy
    dtype = work_dtype(z)
    for sel in chunks(z.shape[0], rows, chunk):
        _, _, la, lb = _log_probs(z, y, sel, inv_tau, dtype)
        q, p = la.exp(), lb.exp()
        _write_grads(div, la, lb, q, p, take(grad, sel), inv_tau, sel, dz, dy)
    return dz, dy


def _given_normalizers(
    z: Tensor, y: Tensor, lse_z: Tensor, lse_y: Tensor, inv_tau: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(log q, log p, q, p)`` of these columns for the whole rows' log-normalizers."""
    dtype = work_dtype(z)
    la = scaled(z, inv_tau, dtype) - lse_z.to(dtype).unsqueeze(1)
    lb = scaled(y, inv_tau, dtype) - lse_y.to(dtype).unsqueeze(1)
    return la, lb, la.exp(), lb.exp()


def divergence_part(
    z: Tensor,
    y: Tensor,
    div: Divergence,
    lse_z: Tensor,
    lse_y: Tensor,
    *,
    inv_tau: float,
    backend: str = "torch",
) -> Tensor:
    """``[3, N]``: the divergence's terms, :math:`S_q` and :math:`S_p` summed over the columns
    of ``z`` / ``y`` only, given the whole rows' ``lse_z`` / ``lse_y``: a vocabulary shard's
    part of each sum (the parts over all shards add up to them; not clamped)."""
    if backend == "triton":
        return divergence_forward(
            z, y, lse_z, lse_y, div, temperature=1.0 / inv_tau, clamp=False
        ).to(work_dtype(z))
    la, lb, q, p = _given_normalizers(z, y, lse_z, lse_y, inv_tau)
    g_q, g_p = _prob_grads(div, la, lb, q, p)
    s_q, s_p = (q * g_q).sum(-1), (p * g_p).sum(-1)
    return torch.stack((_sum_terms(div, la, lb, q, p), s_q, s_p))


def divergence_part_grads(
    z: Tensor,
    y: Tensor,
    div: Divergence,
    whole: Tensor,
    grad: Tensor,
    *,
    inv_tau: float,
    need_z: bool,
    need_y: bool,
    backend: str = "torch",
) -> tuple[Tensor | None, Tensor | None]:
    """``grad[n] * dD_n/dz`` and ``... /dy`` on the columns of ``z`` / ``y`` (a vocabulary
    shard), given the whole rows' ``whole = (lse_z, lse_y, S_q, S_p)`` ``[4, N]``: the
    gradient of a column needs only its own logits and these four numbers per row."""
    lse_z, lse_y, s_q, s_p = whole.unbind(0)
    if backend == "triton":
        return divergence_backward(
            z, y, lse_z, lse_y, s_q, s_p, grad.float(), div, temperature=1.0 / inv_tau,
            need_grad_z=need_z, need_grad_y=need_y,
        )  # fmt: skip
    la, lb, q, p = _given_normalizers(z, y, lse_z, lse_y, inv_tau)
    g_q, g_p = _prob_grads(div, la, lb, q, p)
    scale = grad.to(q.dtype).unsqueeze(1) * inv_tau
    out = []
    for need, prob, g, s, t in ((need_z, q, g_q, s_q, z), (need_y, p, g_p, s_p, y)):
        d = None
        if need:
            d = g.sub_(s.to(q.dtype).unsqueeze(1)).mul_(prob).mul_(scale).to(t.dtype)
        out.append(d)
    return out[0], out[1]
