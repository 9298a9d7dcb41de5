r"""Exact KL from hidden states and LM-head weights, never holding the ``[N, V]`` logits.

The last layer of a language model maps hidden states ``h`` ``[N, H]`` to logits
``z = h W^T (+ b)`` with ``W`` ``[V, H]``. :func:`kl_from_hidden` computes the per-position exact
KL of :func:`klest.kl_from_logits` between pi's ``softmax(z / T)`` and ref's distribution (from
ref's own hidden states and head, or from ref's logits) chunk by chunk: each chunk of rows makes
its logits, reduces them to a few floats per row (:mod:`klest.logits._rows`), and drops them. The
gradients are

.. math::
    \frac{\partial L}{\partial h} = G\,W, \qquad
    \frac{\partial L}{\partial W} = G^\top h, \qquad
    \frac{\partial L}{\partial b} = \textstyle\sum_n G_n,

with ``G = dL/dz`` of the chunk (the logits gradient of :mod:`klest.logits.from_logits`), and
likewise on ref's side when its tensors require grad. Two ways, chosen automatically:

* **gradient in the forward** (a scalar reduction, the training loss): each chunk's ``G``,
  for the reduction's weights times ``scale``, is written over the chunk's own logits, and
  ``dh = G W`` and ``dW += G^T h`` (float32 accumulation) follow at once; the backward only
  multiplies them by the upstream gradient, on the device and not at all when it is 1.
  Matrix products per trainable head: 2 (the logits of both models; 1 when ref comes as logits)
  + ``dh`` (when ``hidden`` requires grad) + ``dW`` (when the head does), so 4 for a student
  trained against a frozen teacher's head, and none of the teacher's own;
* **recompute** (a per-position result, whose upstream gradients are unknown in the forward;
  ``stash=False``, to backpropagate twice; gradients through the details): the backward makes
  each chunk's logits again, 2 more products.

Peak memory beyond inputs and gradients: one chunk of logits for each model and the chunk
workspace (and, with the gradient in the forward, the gradients from the forward to the
backward: ``dh``, and ``dW`` in float32).

The fused linear + loss idea is Liger-Kernel's fused linear cross-entropy, here applied to the
exact KL of "Better Estimation of the Kullback-Leibler Divergence Between Language Models" by
Afra Amini, Tim Vieira and Ryan Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from klest._checks import (
    ValueChecks,
    check_float_tensor,
    check_linear,
    check_rows_have_distributions,
    check_temperature,
    resolve_validate,
)
from klest._types import DEFAULT_REDUCTION, Backend, Direction, Reduction
from klest.aggregation import GlobalCounts, WithDetails
from klest.logits._call import (
    LogitsDetails,
    Positions,
    check_plan_options,
    finish,
    gradient_in_forward,
    in_sequences,
    plus_grads,
    positions,
    valid_columns,
    value_coefficients,
    value_grads,
    value_of,
    with_result,
)
from klest.logits._rows import (
    chunk_rows,
    resolve_backend,
    row_grads,
    row_stats,
    row_stats_grads,
    workspace_bytes_per_row,
)
from klest.logits._sharded import refuse_sharded_weight
from klest.logits._stats import Grads, KLRowStats
from klest.logits.kernels import scale_
from klest.logits.vocab_parallel import VocabShard

__all__ = ["HiddenRowPlan", "kl_from_hidden", "run_hidden"]


class HiddenRowPlan(Protocol):
    """What the fused Function computes on each chunk of rows' logits ``z_c``, ``y_c``.

    ``stats`` gives ``n_stats`` per-row floats ``[n_stats, n_c]`` (saved for the backward);
    ``stats_grads`` the same and, from the same pass, ``dL/dz_c`` and ``dL/dy_c`` for the
    value's row coefficients ``coef`` (written over ``z_c`` / ``y_c``); ``outputs`` turns them
    into the six outputs of :func:`klest.logits._call.finish` and ``lse`` into the two
    log-normalizers (checked); ``constant`` names the outputs without a gradient; ``grads``
    gives ``dL/dz_c`` and ``dL/dy_c`` from the upstream gradients of the six outputs.
    """

    chunk: int
    n_stats: int
    constant: tuple[int, ...]

    def stats(self, z_c: Tensor, y_c: Tensor, labels: Tensor | None) -> Tensor: ...

    def stats_grads(
        self,
        z_c: Tensor,
        y_c: Tensor,
        labels: Tensor | None,
        coef: Tensor,
        need_z: bool,
        need_y: bool,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]: ...

    def outputs(self, out: Tensor) -> tuple[Tensor, ...]: ...

    def lse(self, out: Tensor) -> tuple[Tensor, Tensor]: ...

    def grads(
        self,
        z_c: Tensor,
        y_c: Tensor,
        saved: Tensor,
        grads: tuple[Tensor | None, ...],
        labels: Tensor | None,
        need_z: bool,
        need_y: bool,
    ) -> tuple[Tensor | None, Tensor | None]: ...


@dataclass(frozen=True)
class _KLPlan:
    """The exact KL's row plan (:mod:`klest.logits._rows`): the seven :class:`KLRowStats`."""

    inv_tau: float
    want_entropy: bool
    backend: str
    chunk: int
    direction: str
    ce_weight: float = 0.0
    n_stats: int = 7
    constant: tuple[int, ...] = ()

    def _options(self, z_c: Tensor, labels: Tensor | None) -> dict:
        return {
            "inv_tau": self.inv_tau,
            "labels": labels,
            "rows": None,
            "want_entropy": self.want_entropy,
            "backend": self.backend,
            "chunk": z_c.shape[0],
            "want_kl_ref_pi": self.direction == "ref||pi",
            "want_kl_pi_ref": self.direction == "pi||ref",
        }

    def stats(self, z_c: Tensor, y_c: Tensor, labels: Tensor | None) -> Tensor:
        return torch.stack(row_stats(z_c, y_c, **self._options(z_c, labels)))

    def stats_grads(self, z_c, y_c, labels, coef, need_z, need_y):
        stats, dz, dy = row_stats_grads(
            z_c,
            y_c,
            value_grads(coef, self.direction, self.ce_weight),
            need_z=need_z,
            need_y=need_y,
            dz=z_c if need_z else None,
            dy=y_c if need_y else None,
            **self._options(z_c, labels),
        )
        return torch.stack(stats), dz, dy

    def outputs(self, out: Tensor) -> tuple[Tensor, ...]:
        stats = KLRowStats(*out.unbind(0))
        return (value_of(stats, self.direction, self.ce_weight), *stats[2:])

    def lse(self, out: Tensor) -> tuple[Tensor, Tensor]:
        return out[0], out[1]

    def grads(self, z_c, y_c, saved, grads, labels, need_z, need_y):
        g_value, *g_stats = grads
        value = None if g_value is None else value_grads(g_value, self.direction, self.ce_weight)
        return row_grads(
            z_c,
            y_c,
            KLRowStats(*saved.unbind(0)),
            plus_grads(Grads(*g_stats), value),
            inv_tau=self.inv_tau,
            labels=labels,
            rows=None,
            need_z=need_z,
            need_y=need_y,
            backend=self.backend,
            chunk=z_c.shape[0],
        )


def _chunk_selections(n: int, rows: Tensor | None, size: int, device: torch.device):
    """Index tensors of at most ``size`` rows (all rows, or the kept ``rows``)."""
    idx = torch.arange(n, device=device) if rows is None else rows
    return idx.split(size)


@dataclass(frozen=True)
class _Head:
    """One model's side: hidden states ``[N, H]``, LM head ``[V, H]`` and bias, or logits."""

    hidden: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    logits: Tensor | None = None

    def chunk_logits(self, idx: Tensor) -> Tensor:
        if self.logits is not None:
            return self.logits.index_select(0, idx)
        assert self.hidden is not None and self.weight is not None
        # In the LM head's dtype (as autocast would; bf16 hidden states with an fp32 head
        # otherwise fail in the matmul): the cast is per chunk, the head is not copied.
        dtype = self.weight.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(
            self.hidden.index_select(0, idx).to(dtype), self.weight, bias
        )


def _low_precision(t: Tensor) -> bool:
    return t.dtype in (torch.bfloat16, torch.float16)


@functools.cache
def _float32_products(device_type: str) -> bool:
    """Whether ``torch.mm`` / ``torch.addmm`` take ``out_dtype=torch.float32`` for bf16 inputs
    on this device (CUDA; checked once on two tiny matrices)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        acc = torch.zeros(2, 2, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return bool(torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _product(a: Tensor, b: Tensor, *, into: Tensor | None = None) -> Tensor:
    """``a @ b`` in float32 at least (added to ``into``, a float32 accumulator, when given):
    low-precision inputs are multiplied with float32 accumulation and a float32 result (CUDA's
    ``out_dtype``, else float32 copies of the operands)."""
    if not _low_precision(a):
        return torch.mm(a, b) if into is None else torch.addmm(into, a, b, out=into)
    if a.is_cuda and _float32_products(a.device.type):
        if into is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(into, a, b, out_dtype=torch.float32, out=into)
    if into is None:
        return torch.mm(a.float(), b.float())
    return torch.addmm(into, a.float(), b.float(), out=into)


class _HeadGrads:
    """Gradients of one side, accumulated over chunks: per-row tensors (hidden states, logits)
    written row by row, weights and biases summed (in float32 at least). ``wide``: hold the
    hidden states' gradient in float32 too (it is scaled in the backward before its rounding)."""

    def __init__(
        self, head: _Head, need: tuple[bool, bool, bool, bool], *, wide: bool = False
    ) -> None:
        self.head = head

        def zeros(t: Tensor | None, needed: bool, *, summed: bool) -> Tensor | None:
            if t is None or not needed:
                return None
            dtype = torch.promote_types(t.dtype, torch.float32) if summed else t.dtype
            return torch.zeros_like(t, dtype=dtype)

        self.hidden = zeros(head.hidden, need[0], summed=wide)
        self.weight = zeros(head.weight, need[1], summed=True)
        self.bias = zeros(head.bias, need[2], summed=True)
        self.logits = zeros(head.logits, need[3], summed=False)

    @property
    def needed(self) -> bool:
        return any(g is not None for g in (self.hidden, self.weight, self.bias, self.logits))

    def buffers(self) -> tuple[Tensor | None, ...]:
        return self.hidden, self.weight, self.bias, self.logits

    def add(self, idx: Tensor, d: Tensor | None) -> None:
        """Fold in ``d = dL/dlogits`` of the chunk ``idx``."""
        if d is None:
            return
        head = self.head
        if self.logits is not None:
            self.logits.index_copy_(0, idx, d.to(self.logits.dtype))
        if head.weight is None or head.hidden is None:
            return
        d = d.to(head.weight.dtype)
        if self.hidden is not None:
            # In float32 (accumulated so inside the product), rounded once into the buffer.
            self.hidden.index_copy_(0, idx, _product(d, head.weight).to(self.hidden.dtype))
        if self.weight is not None:
            # Each chunk's product accumulated in float32 into the float32 sum.
            h_c = head.hidden.index_select(0, idx).to(d.dtype)
            if self.weight.dtype == torch.float32:
                _product(d.T, h_c, into=self.weight)
            else:
                self.weight.add_(_product(d.T, h_c))
        if self.bias is not None:
            self.bias.add_(d.sum(0, dtype=self.bias.dtype))

    def scale(self, r: Tensor, backend: str) -> None:
        """Every gradient held times the one-element ``r`` (the upstream gradient): on the
        device, and not at all where ``r == 1`` (:func:`scale_by`)."""
        for g in self.buffers():
            if g is not None:
                scale_by(g, r, backend=backend)

    def result(self) -> Iterator[Tensor | None]:
        """``(d hidden, d weight, d bias, d logits)`` in the inputs' dtypes."""
        head = self.head
        for g, t in (
            (self.hidden, head.hidden),
            (self.weight, head.weight),
            (self.bias, head.bias),
            (self.logits, head.logits),
        ):
            yield None if g is None or t is None else g.to(t.dtype)


def scale_by(x: Tensor, r: Tensor, *, backend: str) -> Tensor:
    """``x *= r`` (``r`` one number on ``x``'s device, ``r == 0`` giving zeros), skipped where
    ``r == 1``: decided on the device on the Triton backend (:func:`~klest.logits.kernels.
    scale_`), on the host on the CPU (free there), and always done otherwise."""
    if backend == "triton" and x.is_contiguous():
        return scale_(x, r)
    if x.device.type == "cpu":
        factor = float(r)
        if factor == 1.0:
            return x
        return x.zero_() if factor == 0.0 else x.mul_(factor)
    return x.copy_(torch.where(r == 0, 0.0, x * r.to(x.dtype)))


def uniform_factor(g: Tensor, c: Tensor) -> Tensor:
    """The one factor ``r`` with ``g = r c`` (a scalar result's upstream gradient ``r``, spread
    over the rows by the reduction's weights ``c``): ``sum g c / sum c^2``, exactly 1 when
    ``g == c`` bit for bit, 0 when every ``c`` is 0. No host synchronisation."""
    cc = (c * c).sum()
    return torch.where(cc > 0, (g * c).sum() / torch.where(cc > 0, cc, 1.0), 0.0).reshape(1)


class _HiddenRows(torch.autograd.Function):
    """``(h, W, b, h_ref, W_ref, b_ref, y) -> six float [N] outputs`` of a
    :class:`HiddenRowPlan`; ref logits ``y`` or ``(h_ref, W_ref, b_ref)``.

    ``coef`` (the value's row coefficients, or None): write the gradients in the forward pass
    (module docstring) and scale them in the backward by the one factor the upstream gradients
    are of ``coef``; else recompute in the backward."""

    @staticmethod
    def forward(
        ctx, h, w, b, h_ref, w_ref, b_ref, y, labels, rows, coef, plan, checks: ValueChecks
    ):
        ctx.set_materialize_grads(False)
        need = ctx.needs_input_grad
        pi, ref = _Head(h, w, b), _Head(h_ref, w_ref, b_ref, y)
        n = h.shape[0]
        dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
        out = torch.zeros(plan.n_stats, n, dtype=dtype, device=h.device)
        in_forward = coef is not None
        if in_forward:
            pi_grads = _HeadGrads(pi, (need[0], need[1], need[2], False), wide=True)
            ref_grads = _HeadGrads(ref, (need[3], need[4], need[5], need[6]), wide=True)
        for idx in _chunk_selections(n, rows, plan.chunk, h.device):
            z_c, y_c = pi.chunk_logits(idx), ref.chunk_logits(idx)
            lab = None if labels is None else labels.index_select(0, idx)
            if in_forward:
                stats, dz_c, dy_c = plan.stats_grads(
                    z_c, y_c, lab, coef.index_select(0, idx), pi_grads.needed, ref_grads.needed
                )
                pi_grads.add(idx, dz_c)
                ref_grads.add(idx, dy_c)
            else:
                stats = plan.stats(z_c, y_c, lab)
            out.index_copy_(1, idx, stats.to(dtype))
        check_rows_have_distributions(*plan.lse(out), None, checks)
        ctx.plan = plan
        ctx.grads = (pi_grads, ref_grads) if in_forward else None
        ctx.in_forward = in_forward
        recompute_inputs = (h, w, b, h_ref, w_ref, b_ref, y, labels, rows, out)
        if not in_forward:
            ctx.save_for_backward(*recompute_inputs)
        elif getattr(plan, "want_entropy", False):  # details: they may be differentiated
            ctx.save_for_backward(coef, *recompute_inputs)
        else:
            ctx.save_for_backward(coef)
        outputs = plan.outputs(out)
        ctx.mark_non_differentiable(*(outputs[i] for i in plan.constant))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        plan: HiddenRowPlan = ctx.plan
        need = ctx.needs_input_grad
        if not ctx.in_forward:
            return (*_recompute(ctx.saved_tensors, grads, plan, need), None, None, None, None, None)
        coef, *saved = ctx.saved_tensors
        stashed = take_stashed(ctx)
        g_value, *g_stats = grads
        if any(g is not None for g in g_stats):
            # A gradient through the details: all of it recomputed, rounded once.
            result = _recompute(saved, grads, plan, need)
        elif g_value is None:
            result = [None] * 7
        else:
            (d_h, d_w, d_b, _), ref = scaled_grads(stashed, g_value, coef, plan)
            result = [d_h, d_w, d_b, *ref]
        return (*result, None, None, None, None, None)


def take_stashed(ctx) -> tuple[_HeadGrads, ...]:
    """The gradients a Function wrote in its forward pass (``ctx.grads``), handed out once: a
    second backward of the graph is refused with the way to do it."""
    if ctx.grads is None:
        raise RuntimeError(
            "this graph was already backpropagated (its gradients, written in the forward "
            "pass, are used up); for a second backward (retain_graph=True) pass stash=False"
        )
    stashed, ctx.grads = ctx.grads, None
    return stashed


def scaled_grads(
    sides: tuple[_HeadGrads, ...], g: Tensor, coef: Tensor, plan: HiddenRowPlan
) -> list[tuple[Tensor | None, ...]]:
    """Each side's ``(d hidden, d weight, d bias, d logits)`` written in the forward pass for
    the upstream gradients ``coef``, times the one factor ``g`` (the backward's upstream
    gradients, of ``coef``'s shape) is of ``coef`` (:func:`uniform_factor`)."""
    backend = getattr(plan, "backend", "torch")
    r = uniform_factor(g, coef)
    for side in sides:
        side.scale(r, backend)
    return [tuple(side.result()) for side in sides]


def _recompute(saved, grads, plan: HiddenRowPlan, need) -> list[Tensor | None]:
    """The seven input gradients, each chunk's logits made again (2 more products)."""
    h, w, b, h_ref, w_ref, b_ref, y, labels, rows, out = saved
    pi = _HeadGrads(_Head(h, w, b), (need[0], need[1], need[2], False))
    ref = _HeadGrads(_Head(h_ref, w_ref, b_ref, y), (need[3], need[4], need[5], need[6]))
    for idx in _chunk_selections(h.shape[0], rows, plan.chunk, h.device):
        z_c, y_c = pi.head.chunk_logits(idx), ref.head.chunk_logits(idx)
        dz_c, dy_c = plan.grads(
            z_c,
            y_c,
            out.index_select(1, idx),
            tuple(None if g is None else g.index_select(0, idx) for g in grads),
            None if labels is None else labels.index_select(0, idx),
            pi.needed,
            ref.needed,
        )
        pi.add(idx, dz_c)
        ref.add(idx, dy_c)
    d_h, d_w, d_b, _ = pi.result()
    d_h_ref, d_w_ref, d_b_ref, d_y = ref.result()
    return [d_h, d_w, d_b, d_h_ref, d_w_ref, d_b_ref, d_y]


def _ref_side(
    lead: torch.Size,
    v: int,
    hidden_ref: Tensor | None,
    weight_ref: Tensor | None,
    bias_ref: Tensor | None,
    logits_ref: Tensor | None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Ref's distribution as ``(h_ref [N, H_ref], W_ref, y [N, V])``: one of the two forms."""
    if (logits_ref is None) == (hidden_ref is None and weight_ref is None):
        raise ValueError("give ref's distribution as either (hidden_ref, weight_ref) or logits_ref")
    if logits_ref is not None:
        check_float_tensor("logits_ref", logits_ref, what="logits")
        if logits_ref.shape != (*lead, v):
            raise ValueError(
                f"logits_ref has shape {tuple(logits_ref.shape)}; expected {(*lead, v)} "
                f"(hidden's positions {tuple(lead)} and weight's V = {v})"
            )
        return None, None, logits_ref.reshape(-1, v)
    if hidden_ref is None or weight_ref is None:
        raise ValueError("hidden_ref and weight_ref go together")
    check_linear("_ref", hidden_ref, weight_ref, bias_ref)
    if hidden_ref.shape[:-1] != lead or weight_ref.shape[0] != v:
        raise ValueError(
            f"hidden_ref {tuple(hidden_ref.shape)} / weight_ref {tuple(weight_ref.shape)} do not "
            f"match hidden's positions {tuple(lead)} and V = {v}: same positions and the same "
            "vocabulary V are needed"
        )
    return hidden_ref.reshape(-1, hidden_ref.shape[-1]), weight_ref, None


def kl_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    *,
    logits_ref: Tensor | None = None,
    bias: Tensor | None = None,
    bias_ref: Tensor | None = None,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    stash: bool | None = None,
    scale: float | Tensor | None = None,
    ce_weight: float = 0.0,
    valid_vocab_size: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position KL between pi = softmax(h W^T / T) and ref, fused with the LM head.

    .. math::
        KL(\pi\|ref)_n = \sum_v \pi_{n,v}(\log\pi_{n,v} - \log ref_{n,v}), \quad
        \pi_n = \mathrm{softmax}((W h_n + b)/T),\;
        ref_n = \mathrm{softmax}((W_{ref} h^{ref}_n + b_{ref})/T)

    (or :math:`KL(ref\|\pi)`), equal to :func:`klest.kl_from_logits` on the materialized logits,
    with gradients to ``hidden``, ``weight``, ``bias`` and, when they require grad, to ref's
    tensors. No samples: the exact per-position term; no ``[N, V]`` tensor ever exists.

    Work: with a scalar ``reduction`` (the training loss) the gradients are made in the forward
    pass, chunk by chunk (each chunk's logits gradient written over its logits, then
    ``dh = G W`` and ``dW += G^T h`` in float32), and the backward only multiplies them by the
    upstream gradient (nothing at all when it is 1: fold a loss coefficient into ``scale``).
    Matrix products: the logits of each model given by hidden states (2, or 1 with
    ``logits_ref``), plus ``dh`` and ``dW`` for each side whose hidden states / head require
    grad: 4 for a student against a frozen teacher. A per-position result
    (``reduction="none"`` / ``"per-sequence"``), ``stash=False``, or a gradient through the
    details recompute the logits in the backward instead (2 more products).

    DTensor hidden states and heads whose rows are sharded over a mesh dimension (``Shard(0)``:
    tensor parallelism, torchtitan's column-wise ``lm_head``) run
    :func:`klest.kl_from_hidden_vocab_parallel` over that dimension's group and return a DTensor
    (:mod:`klest.logits.dtensor`).

    See "Better Estimation of the Kullback-Leibler Divergence Between Language Models" by Afra
    Amini, Tim Vieira and Ryan Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637).

    Args:
      hidden: pi's final hidden states ``[..., H]`` (positions already shifted: position t
        predicts token t + 1).
      weight: pi's LM head ``[V, H]`` (``nn.Linear(H, V).weight``). The logits are computed
        in its dtype (bf16 hidden states from an autocast forward with a float32 head: float32
        logits), chunk by chunk; each gradient comes back in its input's dtype.
      hidden_ref: ref's hidden states ``[..., H_ref]`` (same positions), with ``weight_ref``
        ``[V, H_ref]``; or give ``logits_ref`` ``[..., V]`` instead.
      weight_ref: ref's LM head.
      logits_ref: ref's logits, instead of ``hidden_ref`` / ``weight_ref``.
      bias: pi's LM-head bias ``[V]``, if any.
      bias_ref: ref's LM-head bias ``[V]``, if any.
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      mask: bool ``[...]``, True at positions that count (found with one host read, so that the
        others cost no matrix product).
      reduction: as in :func:`klest.kl_from_logits` (default ``"seq-mean-token-sum"``).
      temperature: :math:`T > 0`, dividing both models' logits.
      labels: int ``[...]`` sampled token ids; ``ignore_index`` positions are masked.
      ignore_index: the label of positions to leave out.
      memory_budget: bytes for one chunk's logits and workspace (default 32 MiB on the CPU,
        1 GiB on a GPU).
      chunk_size: rows per chunk, overriding ``memory_budget``.
      backend: as in :func:`klest.kl_from_logits`.
      stash: None (default) writes the gradients in the forward pass for a scalar
        ``reduction`` and recomputes for a per-position one; False always recomputes (needed to
        backpropagate twice); True insists on the forward pass (a scalar ``reduction`` only).
      scale: multiplies the result (and its gradient), e.g. the loss coefficient ``beta``, so
        that ``loss = pg + kl_from_hidden(..., scale=beta)`` reaches the backward with 1.
      ce_weight: add ``ce_weight`` times the labels' cross-entropy ``-log pi(label)`` to each
        position's KL (SFT + distillation in one pass; needs ``labels``).
      valid_vocab_size: the real vocabulary :math:`V'`: only each head's first :math:`V'` rows
        count (the rest padding, as in :func:`klest.kl_from_logits`); the heads may then differ
        in rows. No copy: the rows are a view.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`klest.kl_from_logits`.
      return_details: also return a :class:`~klest.LogitsDetails`.

    Returns:
      As :func:`klest.kl_from_logits`.

    Example:
      >>> head, ref_head = torch.nn.Linear(8, 50), torch.nn.Linear(8, 50)
      >>> h, h_ref = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
      >>> kl = kl_from_hidden(h, head.weight, h_ref, ref_head.weight, bias=head.bias,
      ...                     bias_ref=ref_head.bias)
      >>> kl.backward()  # gradients reach head.weight and head.bias
      >>> head.weight.grad.shape
      torch.Size([50, 8])
    """

    def make_plan(inv_tau: float, resolved: str, chunk: int) -> _KLPlan:
        return _KLPlan(inv_tau, return_details, resolved, chunk, direction, float(ce_weight))

    return run_hidden(
        hidden,
        weight,
        hidden_ref,
        weight_ref,
        logits_ref=logits_ref,
        bias=bias,
        bias_ref=bias_ref,
        direction=direction,
        mask=mask,
        reduction=reduction,
        temperature=temperature,
        labels=labels,
        ignore_index=ignore_index,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        backend=backend,
        stash=stash,
        scale=scale,
        ce_weight=ce_weight,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        validate=validate,
        return_details=return_details,
        make_plan=make_plan,
        workspace=workspace_bytes_per_row,
        valid_vocab_size=valid_vocab_size,
    )


def run_hidden(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None,
    weight_ref: Tensor | None,
    *,
    logits_ref: Tensor | None,
    bias: Tensor | None,
    bias_ref: Tensor | None,
    direction: str,
    mask: Tensor | None,
    reduction: str,
    temperature: float,
    labels: Tensor | None,
    ignore_index: int,
    memory_budget: int | None,
    chunk_size: int | None,
    backend: str,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    counts: GlobalCounts | None,
    validate: bool | None,
    return_details: bool,
    make_plan: Callable[[float, str, int], HiddenRowPlan],
    workspace: Callable[[int], int],
    stash: bool | None = None,
    scale: float | Tensor | None = None,
    ce_weight: float = 0.0,
    shard: VocabShard | None = None,
    valid_vocab_size: int | None = None,
) -> Tensor | WithDetails[LogitsDetails]:
    """Check a fused call's arguments, plan its chunks (``make_plan(1 / T, backend, rows)``;
    ``workspace(V)``: the PyTorch path's bytes per row), run it and shape the result. With
    ``shard``, the heads are this rank's shard of a vocabulary split over ranks: labels are
    global ids, and every rank plans the same chunks."""
    refuse_sharded_weight(weight, hidden, "weight")
    refuse_sharded_weight(weight_ref, hidden_ref, "weight_ref")
    if valid_vocab_size is not None:  # the heads' first V' rows, ref's logits' first columns
        weight, bias, weight_ref, bias_ref = valid_columns(
            valid_vocab_size, weight, bias, weight_ref, bias_ref, dim=0
        )
        (logits_ref,) = valid_columns(valid_vocab_size, logits_ref)
    check_plan_options(backend, memory_budget, chunk_size)
    tau = check_temperature(temperature)
    check_linear("", hidden, weight, bias)
    lead, v = hidden.shape[:-1], weight.shape[0]
    h_ref, w_ref, y = _ref_side(lead, v, hidden_ref, weight_ref, bias_ref, logits_ref)
    checks = ValueChecks(resolve_validate(validate))
    pos = positions(
        lead,
        hidden.device,
        direction=direction,
        reduction=reduction,
        mask=mask,
        labels=labels,
        vocab_size=v if shard is None else shard.vocab_size,
        ignore_index=ignore_index,
        details=return_details,
        checks=checks,
    )
    h = hidden.reshape(-1, hidden.shape[-1])
    v_plan = v if shard is None else shard.widest
    resolved, chunk = plan_chunks(
        h,
        weight,
        v_plan,
        backend=backend,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        workspace=workspace,
    )
    plan = make_plan(1.0 / tau, resolved, chunk)
    pos = in_sequences(pos, cu_seqlens, max_seqlen, counts, hidden.device, checks)
    pos = with_result(pos, scale=scale, ce_weight=ce_weight)
    inputs = (h, weight, bias, h_ref, w_ref, bias_ref, y)
    coef = None
    if stash_in_forward(pos, grad_wanted(inputs), stash, dtype=weight.dtype):
        coef = value_coefficients(
            pos, h.shape[0], torch.float64 if h.dtype == torch.float64 else torch.float32, h.device
        )
    labels_in = pos.labels
    if shard is not None and labels_in is not None:
        labels_in = shard.local_labels(labels_in, ignore_index)
    outputs = _HiddenRows.apply(*inputs, labels_in, pos.rows, coef, plan, checks)
    checks.run()
    return finish(outputs, pos)


def plan_chunks(
    h: Tensor,
    weight: Tensor,
    v: int,
    *,
    backend: str,
    memory_budget: int | None,
    chunk_size: int | None,
    workspace: Callable[[int], int],
    buffers: int = 3,
) -> tuple[str, int]:
    """``(backend, rows per chunk)`` of a fused call over heads of ``v`` rows: per row,
    ``buffers`` vectors of ``v`` logits or gradients in the inputs' dtype (pi's and ref's
    logits and a gradient: 3), plus ``workspace(v)`` on the PyTorch path."""
    resolved = resolve_backend(backend, h)
    per_row = v * max(h.element_size(), weight.element_size()) * buffers
    per_row += workspace(v) if resolved == "torch" else 0
    return resolved, chunk_rows(per_row, h.device, memory_budget, chunk_size)


def grad_wanted(inputs: tuple[Tensor | None, ...]) -> bool:
    """Whether autograd will want a gradient of any of ``inputs``."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


def stash_in_forward(
    pos: Positions, wanted: bool, stash: bool | None, *, dtype: torch.dtype
) -> bool:
    """Whether a fused call writes its gradients in the forward pass: a scalar reduction whose
    gradient is ``wanted`` (:func:`~klest.logits._call.gradient_in_forward`, ``stash`` as in
    :func:`kl_from_hidden`); ``stash=True`` with a per-position reduction is refused."""
    if stash is True and not pos.scalar:
        raise ValueError(
            f"stash=True writes the head's gradients in the forward pass, which needs a scalar "
            f"reduction (one upstream gradient for every row); reduction={pos.reduction!r} is per "
            "position: leave stash=None"
        )
    return gradient_in_forward(pos, wanted, stash, dtype=dtype) and pos.scalar
