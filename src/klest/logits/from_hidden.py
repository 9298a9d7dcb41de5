r"""Exact KL from hidden states and LM-head weights, never holding the ``[N, V]`` logits.

The last layer of a language model maps hidden states ``h`` ``[N, H]`` to logits
``z = h W^T (+ b)`` with ``W`` ``[V, H]``. :func:`kl_from_hidden` computes the per-position exact
KL of :func:`klest.kl_from_logits` between pi's ``softmax(z / T)`` and ref's distribution (from
ref's own hidden states and head, or from ref's logits) chunk by chunk: each chunk of rows makes
its logits, reduces them to a few floats per row (:mod:`klest.logits._rows`), and drops them. The
backward recomputes each chunk's logits and applies

.. math::
    \frac{\partial L}{\partial h} = G\,W, \qquad
    \frac{\partial L}{\partial W} = G^\top h, \qquad
    \frac{\partial L}{\partial b} = \textstyle\sum_n G_n,

with ``G = dL/dz`` of the chunk (DESIGN.md section 3), and likewise on ref's side when its
tensors require grad. Peak memory beyond inputs and gradients: one chunk of logits for each model
and the chunk workspace.

Source: the fused linear + loss idea of Liger-Kernel's fused linear cross-entropy, applied to the
exact KL of seed 003 (arXiv:2504.10637).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from klest._checks import check_choice
from klest.logits._rows import (
    BACKENDS,
    Grads,
    chunk_rows,
    resolve_backend,
    row_grads,
    row_stats,
    workspace_bytes_per_row,
)
from klest.logits._stats import KLRowStats
from klest.logits.from_logits import (
    LogitsKL,
    check_chunking,
    check_rows_finite,
    check_temperature,
    finish,
    positions,
)


@dataclass(frozen=True)
class _HiddenPlan:
    inv_tau: float
    want_entropy: bool
    backend: str
    chunk: int
    direction: str


def _linear(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(h, w, b)


def _chunk_selections(n: int, rows: Tensor | None, size: int, device: torch.device):
    """Index tensors of at most ``size`` rows (all rows, or the kept ``rows``)."""
    idx = torch.arange(n, device=device) if rows is None else rows
    return idx.split(size)


class _HiddenKL(torch.autograd.Function):
    """``(h, W, b, h_ref, W_ref, b_ref, y) -> five float [N] outputs``; ref logits ``y`` or
    ``(h_ref, W_ref, b_ref)``."""

    @staticmethod
    def forward(ctx, h, w, b, h_ref, w_ref, b_ref, y, labels, rows, plan: _HiddenPlan):
        ctx.set_materialize_grads(False)
        n = h.shape[0]
        dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
        out = torch.zeros(7, n, dtype=dtype, device=h.device)
        for idx in _chunk_selections(n, rows, plan.chunk, h.device):
            z_c, y_c = _chunk_logits(idx, h, w, b, h_ref, w_ref, b_ref, y)
            stats = row_stats(
                z_c,
                y_c,
                inv_tau=plan.inv_tau,
                labels=None if labels is None else labels.index_select(0, idx),
                rows=None,
                want_entropy=plan.want_entropy,
                backend=plan.backend,
                chunk=z_c.shape[0],
                want_kl_ref_pi=plan.direction == "ref||pi",
                want_kl_pi_ref=plan.direction == "pi||ref",
            )
            out.index_copy_(1, idx, torch.stack(stats).to(dtype))
        stats = KLRowStats(*out.unbind(0))
        check_rows_finite(stats, rows)
        ctx.plan = plan
        ctx.save_for_backward(h, w, b, h_ref, w_ref, b_ref, y, labels, rows, out)
        return (
            stats.kl_pi_ref,
            stats.kl_ref_pi,
            stats.entropy,
            stats.logp_label,
            stats.logp_ref_label,
        )

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        plan: _HiddenPlan = ctx.plan
        h, w, b, h_ref, w_ref, b_ref, y, labels, rows, out = ctx.saved_tensors
        need = ctx.needs_input_grad
        acc = _GradAccumulators(need, h, w, b, h_ref, w_ref, b_ref, y)
        for idx in _chunk_selections(h.shape[0], rows, plan.chunk, h.device):
            z_c, y_c = _chunk_logits(idx, h, w, b, h_ref, w_ref, b_ref, y)
            dz_c, dy_c = row_grads(
                z_c,
                y_c,
                KLRowStats(*out.index_select(1, idx).unbind(0)),
                Grads(*(None if g is None else g.index_select(0, idx) for g in grads)),
                inv_tau=plan.inv_tau,
                labels=None if labels is None else labels.index_select(0, idx),
                rows=None,
                need_z=any(need[0:3]),
                need_y=any(need[3:7]),
                backend=plan.backend,
                chunk=z_c.shape[0],
            )
            acc.add(idx, dz_c, dy_c)
        return (*acc.result(), None, None, None)


def _chunk_logits(idx, h, w, b, h_ref, w_ref, b_ref, y) -> tuple[Tensor, Tensor]:
    z_c = _linear(h.index_select(0, idx), w, b)
    y_c = (
        y.index_select(0, idx)
        if y is not None
        else _linear(h_ref.index_select(0, idx), w_ref, b_ref)
    )
    return z_c, y_c


class _GradAccumulators:
    """Gradients of the linear layers, accumulated over chunks (weights in float32)."""

    def __init__(self, need, h, w, b, h_ref, w_ref, b_ref, y):
        self.tensors = (h, w, b, h_ref, w_ref, b_ref, y)
        self.need = need[:7]
        self.grads: list[Tensor | None] = []
        for i, t in enumerate(self.tensors):
            if not self.need[i]:
                self.grads.append(None)
            elif i in (0, 3, 6):  # per-row tensors: each row written once
                self.grads.append(torch.zeros_like(t))
            else:  # weights and biases: summed over chunks, in float32 at least
                self.grads.append(
                    torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32))
                )

    def _side(self, offset: int, idx: Tensor, d: Tensor | None) -> None:
        h, w = self.tensors[offset], self.tensors[offset + 1]
        gh, gw, gb = self.grads[offset : offset + 3]
        if d is None or h is None:
            return
        if gh is not None:
            gh.index_copy_(0, idx, (d.to(w.dtype) @ w).to(gh.dtype))
        if gw is not None:
            # The chunk's product in the inputs' dtype (fp32 accumulation inside the matmul),
            # summed over chunks in float32.
            gw.add_(d.T @ h.index_select(0, idx).to(d.dtype))
        if gb is not None:
            gb.add_(d.sum(0).to(gb.dtype))

    def add(self, idx: Tensor, dz: Tensor | None, dy: Tensor | None) -> None:
        self._side(0, idx, dz)
        self._side(3, idx, dy)
        if self.grads[6] is not None and dy is not None:
            self.grads[6].index_copy_(0, idx, dy.to(self.grads[6].dtype))

    def result(self) -> tuple[Tensor | None, ...]:
        return tuple(
            None if g is None else g.to(t.dtype)
            for g, t in zip(self.grads, self.tensors, strict=True)
        )


def _check_linear(prefix: str, h: object, w: object, b: object) -> tuple[Tensor, Tensor]:
    for name, t in ((f"hidden{prefix}", h), (f"weight{prefix}", w)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
    assert isinstance(h, Tensor) and isinstance(w, Tensor)
    if w.dim() != 2:
        raise ValueError(f"weight{prefix} must be [V, H], got shape {tuple(w.shape)}")
    if h.dim() < 1 or h.shape[-1] != w.shape[1]:
        raise ValueError(
            f"hidden{prefix} has shape {tuple(h.shape)} but weight{prefix} has shape "
            f"{tuple(w.shape)}; hidden{prefix}'s last dim must equal weight{prefix}'s H"
        )
    if b is not None and (not isinstance(b, Tensor) or b.shape != (w.shape[0],)):
        raise ValueError(
            f"bias{prefix} must be a tensor of shape ({w.shape[0]},), got "
            f"{tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__}"
        )
    if h.device != w.device:
        raise ValueError(f"hidden{prefix} is on {h.device} but weight{prefix} is on {w.device}")
    return h, w


def kl_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    *,
    logits_ref: Tensor | None = None,
    bias: Tensor | None = None,
    bias_ref: Tensor | None = None,
    direction: str = "pi||ref",
    temperature: float = 1.0,
    mask: Tensor | None = None,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "none",
    return_entropy: bool = False,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> Tensor | LogitsKL:
    r"""Exact per-position KL between pi = softmax(h W^T / T) and ref, fused with the LM head.

    .. math::
        KL(\pi\|ref)_n = \sum_v \pi_{n,v}(\log\pi_{n,v} - \log ref_{n,v}), \quad
        \pi_n = \mathrm{softmax}((W h_n + b)/T),\;
        ref_n = \mathrm{softmax}((W_{ref} h^{ref}_n + b_{ref})/T)

    (or :math:`KL(ref\|\pi)`), equal to :func:`klest.kl_from_logits` on the materialized logits,
    with gradients to ``hidden``, ``weight``, ``bias`` and, when they require grad, to ref's
    tensors (module docstring). No samples: the exact per-position term (seed 003).

    Args:
      hidden: pi's final hidden states ``[..., H]``.
      weight: pi's LM head ``[V, H]`` (``nn.Linear(H, V).weight``).
      hidden_ref: ref's hidden states ``[..., H_ref]`` (same positions), with ``weight_ref``
        ``[V, H_ref]``; or give ``logits_ref`` ``[..., V]`` instead.
      weight_ref: ref's LM head.
      logits_ref: ref's logits, instead of ``hidden_ref`` / ``weight_ref``.
      bias, bias_ref: optional LM-head biases ``[V]``.
      direction, temperature, mask, labels, ignore_index, reduction, return_entropy, backend:
        as in :func:`klest.kl_from_logits`.
      memory_budget: bytes for one chunk's logits and workspace (default 32 MiB on the CPU,
        1 GiB on a GPU).
      chunk_size: rows per chunk, overriding ``memory_budget``.

    Returns:
      As :func:`klest.kl_from_logits`: the reduced KL, or a :class:`~klest.LogitsKL` with labels
      or ``return_entropy``.
    """
    check_choice("backend", backend, BACKENDS)
    check_chunking(memory_budget, chunk_size)
    inv_tau = check_temperature(temperature)
    _check_linear("", hidden, weight, bias)
    lead = hidden.shape[:-1]
    v = weight.shape[0]
    if (logits_ref is None) == (hidden_ref is None and weight_ref is None):
        raise ValueError("give ref's distribution as either (hidden_ref, weight_ref) or logits_ref")
    if logits_ref is not None:
        if not isinstance(logits_ref, Tensor) or not logits_ref.is_floating_point():
            raise TypeError("logits_ref must be a floating-point torch.Tensor")
        if logits_ref.shape != (*lead, v):
            raise ValueError(
                f"logits_ref has shape {tuple(logits_ref.shape)}; expected {(*lead, v)} "
                f"(hidden's positions {tuple(lead)} and weight's V = {v})"
            )
        y = logits_ref.reshape(-1, v)
        h_ref = w_ref = None
    else:
        if hidden_ref is None or weight_ref is None:
            raise ValueError("hidden_ref and weight_ref go together")
        _check_linear("_ref", hidden_ref, weight_ref, bias_ref)
        if hidden_ref.shape[:-1] != lead or weight_ref.shape[0] != v:
            raise ValueError(
                f"hidden_ref {tuple(hidden_ref.shape)} / weight_ref {tuple(weight_ref.shape)} do "
                f"not match hidden {tuple(hidden.shape)} / weight {tuple(weight.shape)}: same "
                "positions and the same vocabulary V are needed"
            )
        y = None
        h_ref, w_ref = hidden_ref.reshape(-1, hidden_ref.shape[-1]), weight_ref
    if hidden.numel() == 0:
        raise ValueError(f"hidden is empty (shape {tuple(hidden.shape)})")
    pos = positions(
        lead,
        hidden.device,
        direction=direction,
        reduction=reduction,
        mask=mask,
        labels=labels,
        vocab_size=v,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
    )
    h = hidden.reshape(-1, hidden.shape[-1])
    resolved = resolve_backend(backend, h)
    # Per row: pi's and ref's logits and a gradient in their dtype, plus the PyTorch workspace.
    per_row = v * hidden.element_size() * 3
    per_row += workspace_bytes_per_row(v) if resolved == "torch" else 0
    plan = _HiddenPlan(
        inv_tau=inv_tau,
        want_entropy=return_entropy,
        backend=resolved,
        chunk=chunk_rows(per_row, h.device, memory_budget, chunk_size),
        direction=direction,
    )
    outputs = _HiddenKL.apply(
        h, weight, bias, h_ref, w_ref, bias_ref, y, pos.labels, pos.rows, plan
    )
    return finish(outputs, pos)
