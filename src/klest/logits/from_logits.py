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
    check_float_tensor,
    check_logits_pair,
    check_rows_have_distributions,
    check_temperature,
    resolve_validate,
)
from klest._types import DEFAULT_REDUCTION, Backend, Direction, Reduction
from klest.aggregation import GlobalCounts, WithDetails
from klest.logits._call import (
    LogitsDetails,
    Positions,
    RowPlan,
    finish,
    in_sequences,
    plan_for,
    plus_grads,
    positions,
    valid_columns,
    value_coefficients,
    value_grads,
    value_of,
    with_result,
)
from klest.logits._chunking import work_dtype
from klest.logits._rows import (
    rescale_rows_,
    row_flags,
    row_grads,
    row_stats,
    row_stats_grads,
)
from klest.logits._stats import Grads, KLRowStats

__all__ = ["kl_from_logits", "logits_positions", "position_kls", "rows_kl"]


class _RowsKL(torch.autograd.Function):
    """``(z [N, V], y [N, V]) -> six float [N] outputs`` (``OUTPUTS``).

    With ``plan.grad_in_forward`` the forward also writes the value's gradient for the row
    coefficients ``coef`` (:func:`klest.logits._call.value_coefficients`), and the backward
    only rescales the rows whose upstream gradient differs from their coefficient (none when
    the loss reaches it with 1); a gradient through the other outputs (the details) makes the
    backward recompute all of it. Otherwise the backward recomputes everything from the saved
    statistics."""

    @staticmethod
    def forward(ctx, z, y, labels, rows, keep, coef, plan: RowPlan, checks: ValueChecks):
        ctx.set_materialize_grads(False)
        need_z, need_y = ctx.needs_input_grad[:2]
        common = {
            "inv_tau": plan.inv_tau,
            "labels": labels,
            "rows": rows,
            "keep": keep,
            "want_entropy": plan.want_entropy,
            "backend": plan.backend,
            "chunk": plan.chunk,
            "want_kl_ref_pi": plan.direction != "pi||ref",
            "want_kl_pi_ref": plan.direction != "ref||pi",
        }
        in_forward = plan.grad_in_forward and plan.merge is None and coef is not None
        ctx.stash = None
        if in_forward:
            stats, dz, dy = row_stats_grads(
                z,
                y,
                value_grads(coef, plan.direction, plan.ce_weight),
                need_z=need_z,
                need_y=need_y,
                dz=z if plan.overwrite and need_z else None,
                dy=y if plan.overwrite and need_y else None,
                **common,
            )
            ctx.stash = (dz, dy)
        else:
            stats = row_stats(z, y, **common)
        if plan.merge is not None:
            stats = plan.merge(stats, row_flags(rows, keep, z.shape[0]))
        check_rows_have_distributions(stats.lse_z, stats.lse_y, None, checks)
        ctx.plan = plan
        ctx.in_forward = in_forward
        if not in_forward:
            ctx.save_for_backward(z, y, labels, rows, keep, *stats)
        elif plan.want_entropy and not plan.overwrite:  # details: they may be differentiated
            ctx.save_for_backward(coef, z, y, labels, rows, keep, *stats)
        else:
            ctx.save_for_backward(coef)
        return (value_of(stats, plan.direction, plan.ce_weight), *stats[2:])

    @staticmethod
    @once_differentiable
    def backward(ctx, g_value, *g_stats):
        plan: RowPlan = ctx.plan
        need_z, need_y = ctx.needs_input_grad[:2]
        extra = Grads(*g_stats)
        if not ctx.in_forward:
            z, y, labels, rows, keep, *stats = ctx.saved_tensors
            value = (
                None if g_value is None else value_grads(g_value, plan.direction, plan.ce_weight)
            )
            grads = plus_grads(extra, value)
            dz, dy = _recompute(z, y, labels, rows, keep, stats, grads, plan, need_z, need_y)
            return dz, dy, None, None, None, None, None, None
        coef, *saved = ctx.saved_tensors
        if ctx.stash is None:
            raise RuntimeError(
                "kl_from_logits: this graph was already backpropagated (its gradient, written "
                "in the forward pass, is used up); for a second backward (retain_graph=True) "
                "pass stash=False"
            )
        dz, dy = ctx.stash
        ctx.stash = None
        if any(g is not None for g in extra):
            # A gradient through the details: all of it recomputed, rounded once (the written
            # gradient is dropped), as differentiating them is the rare case.
            if not saved:
                raise RuntimeError(
                    "kl_from_logits(overwrite_logits=True) wrote the gradient over the logits: "
                    "the label log-probs and the entropy it returns carry no gradient"
                )
            z, y, labels, rows, keep, *stats = saved
            value = (
                None if g_value is None else value_grads(g_value, plan.direction, plan.ce_weight)
            )
            grads = plus_grads(extra, value)
            dz, dy = _recompute(z, y, labels, rows, keep, stats, grads, plan, need_z, need_y)
        elif g_value is None:
            dz = dy = None
        else:
            for d in (dz, dy):
                if d is not None:
                    rescale_rows_(d, g_value, coef, backend=plan.backend)
        return dz, dy, None, None, None, None, None, None


def _recompute(z, y, labels, rows, keep, stats, grads: Grads, plan: RowPlan, need_z, need_y):
    return row_grads(
        z,
        y,
        KLRowStats(*stats),
        grads,
        inv_tau=plan.inv_tau,
        labels=labels,
        rows=rows,
        keep=keep,
        need_z=need_z,
        need_y=need_y,
        backend=plan.backend,
        chunk=plan.chunk,
    )


def rows_kl(
    z: Tensor,
    y: Tensor,
    labels: Tensor | None,
    pos: Positions,
    plan: RowPlan,
    checks: ValueChecks,
) -> tuple[Tensor, ...]:
    """Apply the autograd Function to ``[N, V]`` logits; six float ``[N]`` outputs
    (``OUTPUTS``), 0 on the rows ``pos`` does not keep. The Triton kernels skip those by their
    flags (no host read); the PyTorch engine gathers the kept rows (their indices: one host
    read). ``pos`` must hold its layout and counts (:func:`~klest.logits._call.in_sequences`)
    when the plan writes the gradient in the forward pass."""
    rows, flags = pos.selection(plan.backend)
    coef = None
    if plan.grad_in_forward:
        coef = value_coefficients(pos, z.shape[0], work_dtype(z), z.device)
    return _RowsKL.apply(z, y, labels, rows, flags, coef, plan, checks)


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
    valid_vocab_size: int | None = None,
) -> tuple[Tensor, Tensor, Positions, float]:
    """Check a call on logits ``[..., V]``: their rows ``[N, V]``, positions and temperature
    (with ``valid_vocab_size``, of the first V' columns)."""
    if valid_vocab_size is not None:
        for name, t in (("logits", logits), ("logits_ref", logits_ref)):
            check_float_tensor(name, t, what="logits")
        logits, logits_ref = valid_columns(valid_vocab_size, logits, logits_ref)
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
    stash: bool | None,
    checks: ValueChecks,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    scale: float | Tensor | None = None,
    ce_weight: float = 0.0,
    overwrite: bool = False,
    valid_vocab_size: int | None = None,
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
        valid_vocab_size=valid_vocab_size,
    )
    pos = in_sequences(pos, cu_seqlens, max_seqlen, counts, logits.device, checks)
    pos = with_result(pos, scale=scale, ce_weight=ce_weight)
    plan = plan_for(
        z,
        y,
        pos,
        temperature=tau,
        backend=backend,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        stash=stash,
        overwrite=overwrite,
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
    stash: bool | None = None,
    scale: float | Tensor | None = None,
    ce_weight: float = 0.0,
    overwrite_logits: bool = False,
    valid_vocab_size: int | None = None,
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

    Work: for a scalar ``reduction`` (or with ``scale``) the gradient is written during the
    forward pass, so forward + backward read each logits tensor once and write the gradient once
    (3 passes over ``[N, V]``); the backward touches it only where the upstream gradient is not
    the one expected (fold a loss coefficient into ``scale`` and it is), and the graph can be
    backpropagated once only. A per-position result without ``scale``, or ``stash=False``,
    recomputes in the backward instead (5 passes; backpropagate as often as you like).

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
      stash: None (default) chooses (module docstring): the gradient in the forward pass for a
        scalar result, or a per-position one with ``scale``; True: always in the forward (a
        per-position result's rows are then rescaled by their upstream gradients in the
        backward); False: recomputed in the backward (needed to backpropagate twice).
      scale: multiplies the result and its gradient (a loss coefficient such as ``beta``, or
        ``1 / count``; a number, or a one-element tensor, which may require grad): then
        ``loss = pg + kl_from_logits(..., scale=beta)`` reaches the backward with 1 and the
        backward does nothing. A per-position result with a ``scale`` is taken to be summed
        (its upstream gradients 1); it must not be 0 there.
      ce_weight: add ``ce_weight`` times the labels' cross-entropy ``-log pi(label)`` to each
        position's KL before the reduction (SFT + distillation from the same pass; needs
        ``labels``). The diagnostics describe the KL alone.
      overwrite_logits: write the gradient over ``logits`` (and ``logits_ref``, when it
        requires grad) instead of a new ``[N, V]`` tensor: the logits are gone after the call
        (off by default: trainers reuse them). The details then carry no gradient.
      valid_vocab_size: the real vocabulary :math:`V'`: only the first :math:`V'` columns of
        each model's logits count, the rest being padding (Megatron pads V to a multiple of
        the tensor-parallel size times 128; a teacher and a student may pad to different
        sizes, 152064 and 151936 for two Qwen models): the distributions over the first
        :math:`V'` tokens, padding's gradient 0. The two logits may then differ in width.
        Costs a copy of those columns where they are not the whole row.
      cu_seqlens: packed sequences (:mod:`klest.layout`): the positions ``[total]`` hold the
        tokens of ``S`` sequences one after another, at offsets ``cu_seqlens`` ``[S + 1]``; the
        sequence reductions follow them (``"per-sequence"`` gives ``[S]``).
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known (no host read).
      counts: the step's global counts (:class:`~klest.GlobalCounts`) when this call is one
        piece of it (a data-parallel rank, a micro-batch): the means divide by them.
      validate: check for rows with NaN / ``+inf`` logits or no finite logit, labels out of
        range, non-0/1 masks (None: the global default).
      return_details: also return a :class:`~klest.LogitsDetails` (label log-probs, pi's
        entropy, diagnostics), from the same pass as the KL.

    Returns:
      The reduced KL in float32 (float64 for float64 inputs); with ``return_details``,
      ``(kl, details)``. ``+inf`` where one distribution has mass that the other lacks;
      ``-inf`` logits are outside the support (``0 log 0 = 0``).

    Raises:
      ValueError: mismatched shapes or V, NaN / ``+inf`` logits or a row of only ``-inf`` at a
        kept position, bad mask / labels / temperature / names.

    DTensor ``logits`` and ``logits_ref`` (a device mesh whose tensor-parallel dimension shards
    the vocabulary: torchtitan, NeMo-RL's DTensor policy) run the vocabulary-parallel path over
    that dimension's group and return a DTensor (:mod:`klest.logits.dtensor`).

    Example:
      >>> z = torch.randn(2, 5, 11, requires_grad=True); y = torch.randn(2, 5, 11)
      >>> kl = kl_from_logits(z, y)  # mean over the 2 sequences of the summed per-token KL
      >>> kl.backward()
      >>> labels = torch.randint(0, 11, (2, 5))
      >>> kl, details = kl_from_logits(z, y, labels=labels, return_details=True)
      >>> details.logp.shape, details.entropy.shape
      (torch.Size([2, 5]), torch.Size([2, 5]))
      >>> loss = kl_from_logits(z, y, scale=0.05, labels=labels, ce_weight=1.0)
      >>> loss.backward()  # reaches the backward with 1: nothing left to do there
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
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        scale=scale,
        ce_weight=ce_weight,
        overwrite=overwrite_logits,
        valid_vocab_size=valid_vocab_size,
    )
    checks.run()
    return finish(outputs, pos)
