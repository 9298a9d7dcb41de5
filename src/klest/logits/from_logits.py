r"""Exact KL between next-token distributions from logits, memory-bounded, both directions.

For pi's logits ``z`` and ref's logits ``y`` (``[..., V]``) at temperature :math:`\tau`,
:math:`\pi = \mathrm{softmax}(z/\tau)`, :math:`ref = \mathrm{softmax}(y/\tau)`, each position gets

.. math::
    KL(\pi\|ref) = \sum_v \pi_v (\log \pi_v - \log ref_v) \quad\text{or}\quad
    KL(ref\|\pi) = \sum_v ref_v (\log ref_v - \log \pi_v),

exactly (no sampling: the Rao-Blackwellized per-position term of "Better Estimation of the
Kullback-Leibler Divergence Between Language Models" by Afra Amini, Tim Vieira and Ryan Cotterell,
NeurIPS 2025, https://arxiv.org/abs/2504.10637), with gradients to ``z`` and, when it requires
grad, to ``y``:

.. math::
    \frac{\partial KL(\pi\|ref)}{\partial z} = \tfrac{1}{\tau}\,\pi\odot(\log\pi - \log ref
        - KL(\pi\|ref)), \qquad
    \frac{\partial KL(\pi\|ref)}{\partial y} = \tfrac{1}{\tau}(ref - \pi),

and symmetrically for KL(ref||pi). The same pass can give the sampled tokens' log-probs under
both models and pi's entropy.

Memory: a custom ``autograd.Function`` walks row chunks and saves only a few floats per row.
When the KL is the only output, its gradient is written during the forward pass (into the buffer
that the backward returns, scaled in place: the *stash*), so forward + backward reads the logits
once; otherwise the backward recomputes ``softmax`` chunk by chunk from the saved normalizers.
On CUDA the same Function runs the Triton kernels of :mod:`klest.logits.kernels` (forward: one
read of each tensor; backward: one read of each and one write of each gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from klest._checks import (
    ValueChecks,
    check_logits_pair,
    check_rows_have_distributions,
    check_temperature,
    resolve_validate,
)
from klest._types import DEFAULT_REDUCTION, Backend, Direction, Reduction
from klest.aggregation import GlobalCounts, WithDetails
from klest.logits._call import (
    OUTPUTS,
    LogitsDetails,
    Positions,
    RowPlan,
    finish,
    in_sequences,
    plan_for,
    positions,
)
from klest.logits._rows import row_flags, row_grads, row_stats, zeroed_rows_buffer
from klest.logits._stats import Grads, KLRowStats

__all__ = ["kl_from_logits", "logits_positions", "position_kls", "rows_kl"]


class _RowsKL(torch.autograd.Function):
    """``(z [N, V], y [N, V]) -> five float [N] outputs`` (see ``_OUTPUTS``)."""

    @staticmethod
    def forward(ctx, z, y, labels, rows, keep, plan: RowPlan, checks: ValueChecks):
        ctx.set_materialize_grads(False)
        stash_z = zeroed_rows_buffer(z, rows) if plan.stash and ctx.needs_input_grad[0] else None
        stash_y = zeroed_rows_buffer(y, rows) if plan.stash and ctx.needs_input_grad[1] else None
        stats = row_stats(
            z,
            y,
            inv_tau=plan.inv_tau,
            labels=labels,
            rows=rows,
            keep=keep,
            want_entropy=plan.want_entropy,
            backend=plan.backend,
            chunk=plan.chunk,
            want_kl_ref_pi=plan.direction != "pi||ref",
            want_kl_pi_ref=plan.direction != "ref||pi",
            stash=plan.stash,
            stash_z=stash_z,
            stash_y=stash_y,
        )
        if plan.merge is not None:
            stats = plan.merge(stats, row_flags(rows, keep, z.shape[0]))
        check_rows_have_distributions(stats.lse_z, stats.lse_y, None, checks)
        ctx.plan = plan
        if plan.stash:
            ctx.stash = (stash_z, stash_y)
            ctx.save_for_backward(stats.kl_pi_ref if plan.stash == "pi||ref" else stats.kl_ref_pi)
        else:
            ctx.save_for_backward(z, y, labels, rows, keep, *stats)
        return tuple(getattr(stats, name) for name in OUTPUTS)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        plan: RowPlan = ctx.plan
        if plan.stash:
            return (*_scale_stash(ctx, grads), None, None, None, None, None)
        z, y, labels, rows, keep, *stats = ctx.saved_tensors
        dz, dy = row_grads(
            z,
            y,
            KLRowStats(*stats),
            Grads(*grads),
            inv_tau=plan.inv_tau,
            labels=labels,
            rows=rows,
            keep=keep,
            need_z=ctx.needs_input_grad[0],
            need_y=ctx.needs_input_grad[1],
            backend=plan.backend,
            chunk=plan.chunk,
        )
        return dz, dy, None, None, None, None, None


def _scale_stash(ctx, grads: tuple) -> tuple[Tensor | None, Tensor | None]:
    """The stashed per-unit gradients, scaled in place by the upstream gradient of the KL."""
    plan: RowPlan = ctx.plan
    (kl,) = ctx.saved_tensors
    which = OUTPUTS.index("kl_pi_ref" if plan.stash == "pi||ref" else "kl_ref_pi")
    if any(g is not None for i, g in enumerate(grads) if i != which):
        raise RuntimeError("internal: a stashed KL gradient met the gradient of another output")
    if ctx.stash is None:
        raise RuntimeError(
            "kl_from_logits: this graph was already backpropagated (its gradient buffer is "
            "scaled in place); for a second backward (retain_graph=True) pass stash=False"
        )
    g = grads[which]
    out = ctx.stash
    ctx.stash = None
    if g is None:
        return None, None
    g = g.unsqueeze(1)
    # Rows where the KL is +inf have no gradient; a zero upstream gradient still drops them.
    dead = (torch.isinf(kl) & (g.view(-1) == 0)).nonzero().view(-1)
    return tuple(None if t is None else t.mul_(g).index_fill_(0, dead, 0.0) for t in out)


def rows_kl(
    z: Tensor,
    y: Tensor,
    labels: Tensor | None,
    pos: Positions,
    plan: RowPlan,
    checks: ValueChecks,
) -> tuple[Tensor, ...]:
    """Apply the autograd Function to ``[N, V]`` logits; five float ``[N]`` outputs, 0 on the
    rows ``pos`` does not keep. The Triton kernels skip those by their flags (no host read); the
    PyTorch engine gathers the kept rows (their indices: one host read)."""
    rows, flags = pos.selection(plan.backend)
    return _RowsKL.apply(z, y, labels, rows, flags, plan, checks)


def logits_positions(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    direction: str,
    temperature: float,
    mask: Tensor | None,
    labels: Tensor | None,
    ignore_index: int,
    reduction: str,
    details: bool,
    checks: ValueChecks,
) -> tuple[Tensor, Tensor, Positions, float]:
    """Check a call on logits ``[..., V]``: their rows ``[N, V]``, positions and temperature."""
    logits, logits_ref = check_logits_pair(logits, logits_ref)
    tau = check_temperature(temperature)
    v = logits.shape[-1]
    pos = positions(
        logits.shape[:-1],
        logits.device,
        direction=direction,
        reduction=reduction,
        mask=mask,
        labels=labels,
        vocab_size=v,
        ignore_index=ignore_index,
        details=details,
        checks=checks,
    )
    return logits.reshape(-1, v), logits_ref.reshape(-1, v), pos, tau


def _run(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    direction: str,
    temperature: float,
    mask: Tensor | None,
    labels: Tensor | None,
    ignore_index: int,
    reduction: str,
    details: bool,
    memory_budget: int | None,
    chunk_size: int | None,
    backend: str,
    stash: bool,
    checks: ValueChecks,
) -> tuple[tuple[Tensor, ...], Positions]:
    z, y, pos, tau = logits_positions(
        logits,
        logits_ref,
        direction=direction,
        temperature=temperature,
        mask=mask,
        labels=labels,
        ignore_index=ignore_index,
        reduction=reduction,
        details=details,
        checks=checks,
    )
    plan = plan_for(
        z,
        y,
        pos,
        temperature=tau,
        backend=backend,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        stash=stash,
    )
    return rows_kl(z, y, pos.labels, pos, plan, checks), pos


def position_kls(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    direction: str,
    keep: Tensor | None,
    checks: ValueChecks,
) -> Tensor:
    """Exact per-position KLs ``[...]`` (0 where ``keep`` is False) for klest's estimators.

    The value checks are queued on the caller's ``checks`` (one synchronisation per call).
    """
    outputs, pos = _run(
        logits,
        logits_ref,
        direction=direction,
        temperature=1.0,
        mask=keep,
        labels=None,
        ignore_index=-100,
        reduction="none",
        details=False,
        memory_budget=None,
        chunk_size=None,
        backend="auto",
        stash=True,
        checks=checks,
    )
    return finish(outputs, pos)


def kl_from_logits(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    stash: bool = True,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position KL between ``softmax(logits / T)`` and ``softmax(logits_ref / T)``.

    .. math::
        KL(\pi\|ref)_n = \sum_v \pi_{n,v} (\log \pi_{n,v} - \log ref_{n,v}), \quad
        \pi_n = \mathrm{softmax}(z_n/T), \; ref_n = \mathrm{softmax}(y_n/T)

    (or :math:`KL(ref\|\pi)_n` for ``direction="ref||pi"``). No samples: the sum over the whole
    vocabulary, which is the Rao-Blackwellized per-position term when the positions lie along
    sequences sampled from pi. Gradients:
    :math:`\partial KL(\pi\|ref)/\partial z = \pi\odot(\log\pi - \log ref - KL)/T`,
    :math:`\partial/\partial y = (ref - \pi)/T`, and symmetrically for ``ref||pi``;
    ``logits_ref`` gets a gradient when it requires one (teacher training).

    By default the KL's gradient is written during the forward pass and scaled in place by the
    backward (``stash``), so forward + backward read the logits once, and the graph can be
    backpropagated once only; pass ``stash=False`` to backpropagate twice.

    Memory: at most ``memory_budget`` bytes of chunk workspace (PyTorch path) plus a few floats
    per row; nothing ``[N, V]``-sized beyond the gradients. Math in float32 for float32 / bf16 /
    fp16 inputs (float64 for float64), gradients in the inputs' dtypes.

    Shift: the logits at position t are the model's prediction of token t + 1, so position t's
    label is ``input_ids[:, t + 1]``. Slicing (``logits[:, :-1]``) copies the logits; to avoid
    the copy, pass the whole ``[B, T, V]`` and mask (or label ``ignore_index``) the last position.

    See "Better Estimation of the Kullback-Leibler Divergence Between Language Models" by Afra
    Amini, Tim Vieira and Ryan Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637).

    Args:
      logits: pi's logits ``[..., V]`` (any float dtype), with the trainable graph.
      logits_ref: ref's logits, same shape and device (its dtype may differ).
      direction: ``"pi||ref"`` (the RLHF penalty, on-policy distillation) or ``"ref||pi"``.
      mask: bool ``[...]``, True at positions that count; others give 0 and no gradient, and
        are not read for validity (they may hold anything).
      reduction: over the per-position KLs ``[...]`` by the rule of :mod:`klest.aggregation`
        (default ``"seq-mean-token-sum"``; ``"none"`` keeps ``[...]``).
      temperature: :math:`T > 0`, dividing both logits.
      labels: int ``[...]`` sampled token ids (already shifted). Positions whose label is
        ``ignore_index`` are masked; with ``return_details`` their log-probs are returned too.
      ignore_index: the label of positions to leave out (default -100, as in cross-entropy).
      memory_budget: bytes of chunk workspace (default 32 MiB on the CPU, 1 GiB on a GPU).
      chunk_size: rows per chunk, overriding ``memory_budget``.
      backend: ``"auto"`` (Triton on CUDA when available, else PyTorch), ``"torch"``,
        ``"triton"`` (also on CPU tensors under ``TRITON_INTERPRET=1``, for tests).
      stash: write the KL's gradient during the forward pass when the KL is the only output
        (PyTorch backend); ``False`` recomputes in the backward instead.
      cu_seqlens: packed sequences (:mod:`klest.layout`): the positions ``[total]`` hold the
        tokens of ``S`` sequences one after another, at offsets ``cu_seqlens`` ``[S + 1]``; the
        sequence reductions follow them (``"per-sequence"`` gives ``[S]``).
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known (no host read).
      counts: the step's global counts (:class:`~klest.GlobalCounts`) when this call is one
        piece of it (a data-parallel rank, a micro-batch): the means divide by them.
      validate: check for rows with NaN / ``+inf`` logits or no finite logit, labels out of
        range, non-0/1 masks (None: the global default).
      return_details: also return a :class:`~klest.LogitsDetails` (label log-probs, pi's
        entropy, diagnostics); this computes the entropy and recomputes in the backward.

    Returns:
      The reduced KL in float32 (float64 for float64 inputs); with ``return_details``,
      ``(kl, details)``. ``+inf`` where one distribution has mass that the other lacks;
      ``-inf`` logits are outside the support (``0 log 0 = 0``).

    Raises:
      ValueError: mismatched shapes or V, NaN / ``+inf`` logits or a row of only ``-inf`` at a
        kept position, bad mask / labels / temperature / names.

    Example:
      >>> z = torch.randn(2, 5, 11, requires_grad=True); y = torch.randn(2, 5, 11)
      >>> kl = kl_from_logits(z, y)  # mean over the 2 sequences of the summed per-token KL
      >>> kl.backward()
      >>> labels = torch.randint(0, 11, (2, 5))
      >>> kl, details = kl_from_logits(z, y, labels=labels, return_details=True)
      >>> details.logp.shape, details.entropy.shape
      (torch.Size([2, 5]), torch.Size([2, 5]))
    """
    checks = ValueChecks(resolve_validate(validate))
    outputs, pos = _run(
        logits,
        logits_ref,
        direction=direction,
        temperature=temperature,
        mask=mask,
        labels=labels,
        ignore_index=ignore_index,
        reduction=reduction,
        details=return_details,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        backend=backend,
        stash=stash,
        checks=checks,
    )
    pos = in_sequences(pos, cu_seqlens, max_seqlen, counts, logits.device, checks)
    checks.run()
    return finish(outputs, pos)
