r"""Multi-teacher distillation: a weighted sum of exact KLs to K teachers, or rows routed to one.

On-policy distillation from several teachers (a math teacher for math prompts, a code teacher for
code prompts, ...) trains the student :math:`\pi = \mathrm{softmax}(z/\tau)` towards teachers
:math:`ref_k = \mathrm{softmax}(y_k/\tau)`, :math:`k = 1..K`, with, at each position :math:`n`,

.. math::
    \sum_k w_{n,k}\, KL(\pi_n\|ref_{k,n}) \quad\text{or}\quad
    \sum_k w_{n,k}\, KL(ref_{k,n}\|\pi_n), \qquad w_{n,k} \ge 0,\ \sum_k w_{n,k} = 1,

exact over the whole vocabulary (as :func:`klest.kl_from_logits`). The weights are global
(``[K]``: the averaged multi-teacher KL), per position (``[..., K]``), or a *route*: one teacher
index per row (sequence), so that each prompt's completion is distilled from its domain's teacher
only (MOPD: "Multi-Teacher On-Policy Distillation", https://arxiv.org/abs/2606.30406; MiMo,
https://arxiv.org/abs/2601.02780; slime's and ms-swift's multi-teacher OPD).

Work. A teacher's KL is computed only at the positions where its weight is positive (and the
position counts): a routed row costs one KL, to its teacher, whatever K. From logits, the
positions are arranged in *slots*, slot j holding each position's j-th teacher of positive
weight (one slot when routing); each slot is one :func:`klest.kl_from_logits` call against the
slot's teacher logits, gathered row by row from the K tensors (no copy when the whole slot has
one teacher, as with global weights). From hidden states, the rows are grouped by their set of
teachers (one group a teacher when routing) and chunked within each group: a chunk makes the
student's logits once and each of its teachers' logits with that teacher's LM head, and, for a
scalar loss, writes the gradients in the forward pass as :func:`klest.kl_from_hidden` does
(the logits gradients summed over the chunk's teachers, then ``dh`` and ``dW`` once); a
per-position result recomputes, one :func:`klest.kl_from_hidden` call a teacher masked to its
rows. Rows no teacher counts cost no matrix product. The reduction is klest's one rule
(:mod:`klest.aggregation`) over the weighted per-position sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from klest._checks import (
    ValueChecks,
    check_choice,
    check_direction,
    check_float_tensor,
    check_int_ids,
    check_linear,
    check_mask,
    check_rows_have_distributions,
    check_temperature,
    first_bad,
    resolve_validate,
)
from klest._types import DEFAULT_REDUCTION, Backend, Direction, Reduction
from klest.aggregation import GlobalCounts, WithDetails, check_counts, reduce_rows
from klest.layout import Layout, PaddedLayout, layout_of
from klest.logits._call import Positions, check_plan_options
from klest.logits._rows import workspace_bytes_per_row
from klest.logits._sharded import refuse_sharded_weight
from klest.logits.from_hidden import (
    _Head,
    _HeadGrads,
    _KLPlan,
    _ref_side,
    grad_wanted,
    kl_from_hidden,
    plan_chunks,
    scaled_grads,
    stash_in_forward,
    take_stashed,
)
from klest.logits.from_logits import kl_from_logits

__all__ = ["MultiTeacherDetails", "multi_teacher_kl_from_hidden", "multi_teacher_kl_from_logits"]


class MultiTeacherDetails(NamedTuple):
    """What the multi-teacher KLs report besides the value (``return_details=True``).

    Attributes:
      teacher_kls: ``[..., K]``, each teacher's per-position KL where it was computed (its
        weight positive and the position counted), 0 elsewhere; no graph.
      teacher_positions: int64 ``[K]``, the positions computed per teacher (a teacher's mean
        KL is ``teacher_kls[..., k].sum() / teacher_positions[k]``).
    """

    teacher_kls: Tensor
    teacher_positions: Tensor


class _Plan(NamedTuple):
    """The checked weighting on ``N`` flat positions: ``weights`` ``[N, K]`` (0 where not
    counted), ``keep`` bool ``[N]``, the layout and the mask as given (bool) or None."""

    weights: Tensor
    keep: Tensor
    layout: Layout
    mask: Tensor | None


def _per_position(per_row: Tensor, layout: Layout) -> Tensor:
    """One value per row (sequence) ``[rows]`` repeated over its positions (flat ``[N]``)."""
    if isinstance(layout, PaddedLayout):
        if layout.samples:
            return per_row.reshape(-1)
        return per_row.reshape(-1, 1).expand(-1, layout.shape[-1]).reshape(-1)
    return layout.tokens(per_row.reshape(-1, 1).expand(-1, layout.max_len)).reshape(-1)


def _plan(
    lead: torch.Size,
    device: torch.device,
    k: int,
    weights: Tensor | Sequence[float] | None,
    route: Tensor | None,
    reduction: str,
    counts: GlobalCounts | None,
    validate: bool | None,
    layout_args: dict,
    name: str,
) -> _Plan:
    """Check ``weights`` / ``route`` and the reduction's arguments (``layout_args``: mask,
    cu_seqlens, max_seqlen) against ``lead`` positions and K teachers; the value checks run
    here (one host synchronisation)."""
    check_choice("reduction", reduction, Reduction)
    check_counts(counts, reduction)
    checks = ValueChecks(resolve_validate(validate))
    plan = _weighting(lead, device, k, weights, route, checks, name=name, **layout_args)
    checks.run()
    return plan


def _weighting(
    lead: torch.Size,
    device: torch.device,
    k: int,
    weights: Tensor | Sequence[float] | None,
    route: Tensor | None,
    checks: ValueChecks,
    *,
    mask: Tensor | None,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    name: str,
) -> _Plan:
    """:func:`_plan`'s weighting, its value checks queued in ``checks``."""
    layout = layout_of(lead, device, cu_seqlens, max_seqlen, checks, name=name)
    n = lead.numel()
    keep = torch.ones(n, dtype=torch.bool, device=device)
    bool_mask = None
    if mask is not None:
        bool_mask = check_mask(mask, lead, device, checks, of=f"{name}'s positions")
        keep = bool_mask.reshape(-1)
    if route is not None:
        if weights is not None:
            raise ValueError("give weights or route, not both (a route is one-hot weights)")
        rows_shape = layout.sequences_shape
        route = check_int_ids(
            "route", route, rows_shape, device, of=f"the sequences of {name} ({tuple(rows_shape)})"
        )
        # Only rows with a counted position must name a teacher (padding rows may hold anything).
        counted = layout.rows(keep.reshape(lead)).any(-1).reshape(-1)
        flat = route.reshape(-1)
        checks.add(
            ((flat < 0) | (flat >= k)) & counted,
            lambda f: (
                f"route holds teacher indices outside [0, {k}) (K = {k} teachers) at "
                f"{first_bad(f.reshape(rows_shape))}"
            ),
        )
        teacher = _per_position(flat.clamp(0, k - 1).to(torch.int64), layout)
        w = torch.nn.functional.one_hot(teacher, k).to(torch.float32)
        return _Plan(torch.where(keep[:, None], w, 0.0), keep, layout, bool_mask)
    if weights is None:
        w = torch.full((n, k), 1.0 / k, dtype=torch.float64, device=device)
        return _Plan(torch.where(keep[:, None], w, 0.0), keep, layout, bool_mask)
    if not isinstance(weights, Tensor):
        weights = torch.as_tensor(weights, dtype=torch.float64, device=device)
    check_float_tensor("weights", weights, what="teacher weights")
    if weights.device != device:
        raise ValueError(f"weights is on {weights.device} but {name} is on {device}")
    if weights.shape == (k,):
        w = weights.expand(n, k)
    elif weights.shape == (*lead, k):
        w = weights.reshape(n, k)
    else:
        raise ValueError(
            f"weights has shape {tuple(weights.shape)}; expected [K] = ({k},) or per position "
            f"[..., K] = {(*lead, k)} (K = {k} teachers, {name}'s positions {tuple(lead)})"
        )
    tol = 8 * k * torch.finfo(weights.dtype).eps  # a sum of K rounded weights, each rounded
    wd = w.detach()
    checks.add(
        ((wd < 0) | ~torch.isfinite(wd)).any(-1) & keep,
        lambda f: f"weights must be finite and >= 0 at counted positions; {first_bad(f)}",
    )
    checks.add(
        ((wd.sum(-1, dtype=torch.float64) - 1).abs() > tol) & keep,
        lambda f: (
            f"weights must sum to 1 over the K = {k} teachers at each counted position; "
            f"{first_bad(f.reshape(lead) if lead else f)}"
        ),
    )
    return _Plan(torch.where(keep[:, None], w, 0.0), keep, layout, bool_mask)


def _check_teachers(name: str, teachers: object) -> list[Tensor]:
    if isinstance(teachers, Tensor) or not isinstance(teachers, Sequence) or not teachers:
        raise TypeError(
            f"{name} must be a non-empty sequence (list or tuple) of K tensors, one per "
            f"teacher, got {type(teachers).__name__}"
        )
    for i, t in enumerate(teachers):
        check_float_tensor(f"{name}[{i}]", t, what="a teacher's tensor")
    return list(teachers)


def _finish(
    per_position: Tensor,
    teacher_kls: Tensor | None,
    plan: _Plan,
    lead: torch.Size,
    reduction: str,
    counts: GlobalCounts | None,
    return_details: bool,
) -> Tensor | WithDetails[MultiTeacherDetails]:
    """Reduce the weighted per-position values ``[N]`` by klest's rule; the details."""
    layout = plan.layout
    values = layout.rows(per_position.reshape(lead))
    valid = None
    if plan.mask is not None or not isinstance(layout, PaddedLayout):
        valid = layout.rows(plan.keep.reshape(lead))
    result = reduce_rows(values, valid, reduction, layout, counts)
    if not return_details:
        return result
    assert teacher_kls is not None
    computed = plan.weights > 0
    details = MultiTeacherDetails(
        teacher_kls=teacher_kls.reshape(*lead, -1),
        teacher_positions=computed.sum(0),
    )
    return WithDetails(result, details)


def multi_teacher_kl_from_logits(
    logits: Tensor,
    teacher_logits: Sequence[Tensor],
    *,
    weights: Tensor | Sequence[float] | None = None,
    route: Tensor | None = None,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    temperature: float = 1.0,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[MultiTeacherDetails]:
    r"""Weighted exact KL to K teachers from logits: :math:`\sum_k w_{n,k} KL(\pi_n\|ref_{k,n})`.

    .. math::
        D_n = \sum_{k=1}^K w_{n,k}\, KL(\pi_n\|ref_{k,n}), \quad
        \pi_n = \mathrm{softmax}(z_n/T), \; ref_{k,n} = \mathrm{softmax}(y_{k,n}/T)

    (or :math:`KL(ref_{k,n}\|\pi_n)` for ``direction="ref||pi"``), exact over the vocabulary (no
    samples; the Rao-Blackwellized per-position term where the positions lie along sequences
    sampled from pi), reduced by klest's rule. The gradient is the weighted sum of each
    :func:`klest.kl_from_logits` gradient, to ``logits`` and to every teacher's logits that
    require grad. A teacher's KL is computed only where its weight is positive (module
    :mod:`klest.logits.multi_teacher`): with ``route``, each position costs one KL.

    One host read finds the slots (how many teachers a position has at most) and one per slot
    which teacher each position uses; with a route and one tensor whose rows already come from
    their teachers, this is :func:`klest.kl_from_logits` itself.

    See MOPD, "Multi-Teacher On-Policy Distillation" (https://arxiv.org/abs/2606.30406), and
    A. Amini, T. Vieira, R. Cotterell, "Better Estimation of the Kullback-Leibler Divergence
    Between Language Models" (NeurIPS 2025, https://arxiv.org/abs/2504.10637).

    Args:
      logits: the student's logits ``[..., V]`` (any float dtype), with the graph.
      teacher_logits: K tensors ``[..., V]``, each teacher's logits at the same positions
        (rows where a teacher's weight is 0 are not read: they may hold anything).
      weights: ``[K]`` (every position alike), or ``[..., K]`` per position; finite, ``>= 0``,
        summing to 1 at each counted position (masked positions are not read). Default: ``1/K``
        each, the averaged multi-teacher KL.
      route: integer, one teacher index in ``[0, K)`` per sequence (``[...]`` of the positions'
        leading dimensions, ``[B]`` for ``[B, T, V]``; ``[S]`` with ``cu_seqlens``; one per
        position for 1-D positions ``[N, V]``): each sequence distilled from its teacher only.
        Instead of ``weights``; rows with no counted position are not read.
      direction: ``"pi||ref"`` (on-policy distillation) or ``"ref||pi"``.
      mask: bool ``[...]``, True at positions that count.
      reduction: klest's rule (:mod:`klest.aggregation`; default ``"seq-mean-token-sum"``,
        ``"none"`` gives ``[...]``).
      temperature: :math:`T > 0`, dividing every model's logits.
      memory_budget, chunk_size, backend: as in :func:`klest.kl_from_logits`.
      cu_seqlens, max_seqlen, counts: packed sequences and global counts, as in
        :func:`klest.kl_from_logits`.
      validate: check the weights, the route, the mask and every row's logits (None: the
        global default).
      return_details: also return a :class:`MultiTeacherDetails`.

    Returns:
      The reduced value in float32 (float64 for float64 logits); with ``return_details``,
      ``(value, details)``.

    Raises:
      ValueError: a teacher's shape or device differing from the logits', weights of the wrong
        shape (not ``[K]`` or ``[..., K]``), negative or not summing to 1, both ``weights`` and
        ``route``, a route outside ``[0, K)`` or of the wrong shape, bad logits.
      TypeError: ``teacher_logits`` not a sequence of float tensors, an integer route expected.

    Example:
      >>> z = torch.randn(4, 5, 11, requires_grad=True)
      >>> teachers = [torch.randn(4, 5, 11) for _ in range(3)]
      >>> domain = torch.tensor([0, 2, 2, 1])  # each prompt's teacher
      >>> kl = multi_teacher_kl_from_logits(z, teachers, route=domain)
      >>> kl.backward()
      >>> avg = multi_teacher_kl_from_logits(z, teachers, weights=[0.5, 0.25, 0.25])
    """
    check_float_tensor("logits", logits, what="logits")
    if logits.dim() < 1:
        raise ValueError(f"logits must be [..., V], got shape {tuple(logits.shape)}")
    teachers = _check_teachers("teacher_logits", teacher_logits)
    for i, t in enumerate(teachers):
        if t.shape != logits.shape or t.device != logits.device:
            raise ValueError(
                f"teacher_logits[{i}] has shape {tuple(t.shape)} on {t.device} but logits has "
                f"shape {tuple(logits.shape)} on {logits.device}; they must match"
            )
    lead, v, k = logits.shape[:-1], logits.shape[-1], len(teachers)
    layout = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "mask": mask}
    plan = _plan(
        lead, logits.device, k, weights, route, reduction, counts, validate, layout, "logits"
    )
    options = {
        "direction": direction,
        "temperature": temperature,
        "memory_budget": memory_budget,
        "chunk_size": chunk_size,
        "backend": backend,
        "validate": validate,
        "reduction": "none",
    }
    n = lead.numel()
    positive = plan.weights > 0
    n_teachers = positive.sum(-1)
    # Slot j: each position's j-th teacher of positive weight (those first, in index order).
    order = torch.sort((~positive).to(torch.int8), dim=-1, stable=True).indices
    n_slots = int(n_teachers.max()) if n else 0
    total = None
    teacher_kls = torch.zeros(n, k, device=logits.device) if return_details else None
    for j in range(n_slots):
        teacher = order[:, j]
        in_slot = n_teachers > j
        kl = _slot_kl(logits, teachers, teacher, in_slot, lead, v, options)
        w = plan.weights.gather(-1, teacher[:, None])[:, 0].to(kl.dtype)
        term = torch.where(in_slot, w * kl.reshape(-1), 0.0)
        total = term if total is None else total + term
        if teacher_kls is not None:
            teacher_kls = teacher_kls.to(kl.dtype)
            teacher_kls.scatter_add_(
                1, teacher[:, None], torch.where(in_slot, kl.detach().reshape(-1), 0.0)[:, None]
            )
    if total is None:  # nothing counted: zeros, with the logits' graph
        kl = kl_from_logits(
            logits, teachers[0], mask=torch.zeros_like(plan.keep).reshape(lead), **options
        )
        total = kl.reshape(-1)
    return _finish(total, teacher_kls, plan, lead, reduction, counts, return_details)


def _slot_kl(
    logits: Tensor,
    teachers: list[Tensor],
    teacher: Tensor,
    in_slot: Tensor,
    lead: torch.Size,
    v: int,
    options: dict,
) -> Tensor:
    """The KL ``[...]`` of each position in the slot to its ``teacher`` ``[N]`` (0 elsewhere):
    one :func:`kl_from_logits` call against the teachers' rows gathered into one tensor (the
    teacher's own tensor when the whole slot uses one)."""
    n, k = lead.numel(), len(teachers)
    rows = in_slot.nonzero().view(-1)
    used = teacher[rows]
    per_teacher = torch.bincount(used, minlength=k).tolist()  # one host read
    mask = None if rows.numel() == n else in_slot.reshape(lead)
    single = [i for i, c in enumerate(per_teacher) if c]
    if len(single) == 1:
        return kl_from_logits(logits, teachers[single[0]], mask=mask, **options)
    dtype = teachers[0].dtype
    for t in teachers[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    ref = torch.zeros(n, v, dtype=dtype, device=logits.device)
    sorted_rows = rows[torch.sort(used, stable=True).indices]
    for i, part in zip(range(k), sorted_rows.split(per_teacher), strict=True):
        if part.numel():
            ref.index_copy_(0, part, teachers[i].reshape(n, v).index_select(0, part).to(dtype))
    return kl_from_logits(logits, ref.reshape(*lead, v), mask=mask, **options)


def multi_teacher_kl_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor | Sequence[Tensor],
    teacher_weights: Sequence[Tensor],
    *,
    route: Tensor | None = None,
    weights: Tensor | Sequence[float] | None = None,
    bias: Tensor | None = None,
    teacher_biases: Sequence[Tensor | None] | None = None,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    temperature: float = 1.0,
    memory_budget: int | None = None,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    stash: bool | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[MultiTeacherDetails]:
    r"""Weighted exact KL to K teachers from hidden states, fused with each model's LM head.

    .. math::
        D_n = \sum_{k=1}^K w_{n,k}\, KL(\pi_n\|ref_{k,n}), \quad
        \pi_n = \mathrm{softmax}((W h_n + b)/T), \;
        ref_{k,n} = \mathrm{softmax}((W_k h^{(k)}_n + b_k)/T)

    (or :math:`KL(ref_{k,n}\|\pi_n)`), as :func:`multi_teacher_kl_from_logits` on the
    materialized logits, with no ``[N, V]`` tensor: a teacher's logits are made only at the rows
    where its weight is positive (one host read groups the rows by their teachers). Gradients
    reach ``hidden``, ``weight``, ``bias`` and every teacher tensor that requires grad (a teacher
    with no row gets none).

    Work, in matrix products of a chunk of rows (each ``2 * rows * H * V`` FLOPs, ``H`` of its
    model): with a scalar ``reduction`` (the training loss) the gradients are written in the
    forward pass as in :func:`klest.kl_from_hidden`: the student's logits once, each of the
    chunk's teachers' logits, and ``dh`` and ``dW`` once for the gradient summed over them, so
    ``3 + (its teachers)``: 4 for a routed row, as one :func:`klest.kl_from_hidden` call, and
    ``3 + K`` averaged over K teachers; plus ``dh_k`` / ``dW_k`` for a teacher's tensors that
    require grad. The backward only scales them by the upstream gradient (nothing at all when
    it is 1). A per-position result (``reduction="none"`` / ``"per-sequence"``), ``stash=False``
    or float16 heads recompute instead: one :func:`klest.kl_from_hidden` call a teacher, on its
    rows, 6 products a chunk a teacher. Without a gradient (``torch.no_grad``): ``1 + (its
    teachers)``.

    See MOPD, "Multi-Teacher On-Policy Distillation" (https://arxiv.org/abs/2606.30406).

    Args:
      hidden: the student's final hidden states ``[..., H]``.
      weight: the student's LM head ``[V, H]``.
      teacher_hidden: K tensors ``[..., H_k]`` (each teacher's hidden states at the positions;
        rows where its weight is 0 are not read), or one tensor ``[..., H_ref]`` that every
        teacher reads: with ``route``, each row holding its own teacher's hidden states.
      teacher_weights: K LM heads ``[V, H_k]``, one per teacher (the same V as ``weight``).
      route: integer, one teacher index in ``[0, K)`` per sequence (as in
        :func:`multi_teacher_kl_from_logits`), instead of ``weights``.
      weights: ``[K]`` or ``[..., K]``, finite, ``>= 0``, summing to 1 at counted positions
        (default ``1/K`` each).
      bias: the student's LM-head bias ``[V]``, if any.
      teacher_biases: K biases ``[V]`` or None each, if any.
      direction, mask, reduction, temperature: as in :func:`multi_teacher_kl_from_logits`.
      memory_budget, chunk_size, backend: as in :func:`klest.kl_from_hidden`.
      stash: None (default) writes the gradients in the forward pass for a scalar
        ``reduction`` and recomputes for a per-position one; False always recomputes (needed to
        backpropagate twice); True insists on the forward pass (a scalar ``reduction`` only).
      cu_seqlens, max_seqlen, counts, validate, return_details: as in
        :func:`multi_teacher_kl_from_logits`.

    Returns:
      As :func:`multi_teacher_kl_from_logits`.

    Raises:
      ValueError: K differing between ``teacher_hidden``, ``teacher_weights`` and
        ``teacher_biases``, shapes that do not match, and the errors of
        :func:`multi_teacher_kl_from_logits` and :func:`klest.kl_from_hidden`.
      TypeError: teachers not given as sequences of float tensors.

    Example:
      >>> student = torch.nn.Linear(8, 50)
      >>> heads = [torch.nn.Linear(8, 50).weight.detach() for _ in range(2)]
      >>> h = torch.randn(3, 6, 8, requires_grad=True)
      >>> h_teacher = torch.randn(3, 6, 8)  # row b from its teacher route[b]
      >>> kl = multi_teacher_kl_from_hidden(h, student.weight, h_teacher, heads,
      ...                                   route=torch.tensor([1, 0, 1]))
      >>> kl.backward()
    """
    check_float_tensor("hidden", hidden, what="hidden states")
    if hidden.dim() < 1:
        raise ValueError(f"hidden must be [..., H], got shape {tuple(hidden.shape)}")
    heads = _check_teachers("teacher_weights", teacher_weights)
    k, lead = len(heads), hidden.shape[:-1]
    if isinstance(teacher_hidden, Tensor):
        check_float_tensor("teacher_hidden", teacher_hidden, what="hidden states")
        states = [teacher_hidden] * k
    else:
        states = _check_teachers("teacher_hidden", teacher_hidden)
        if len(states) != k:
            raise ValueError(
                f"teacher_hidden holds {len(states)} tensors but teacher_weights {k} heads; "
                "give one per teacher (or one tensor for all)"
            )
    for i, s in enumerate(states):
        if s.shape[:-1] != lead:
            what = (
                "teacher_hidden" if isinstance(teacher_hidden, Tensor) else f"teacher_hidden[{i}]"
            )
            raise ValueError(
                f"{what} has shape {tuple(s.shape)} but hidden's positions are {tuple(lead)}"
            )
    biases = [None] * k if teacher_biases is None else list(teacher_biases)
    if len(biases) != k:
        raise ValueError(f"teacher_biases holds {len(biases)} entries but there are K = {k} heads")
    layout = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "mask": mask}
    plan = _plan(
        lead, hidden.device, k, weights, route, reduction, counts, validate, layout, "hidden"
    )
    check_direction(direction)
    groups = _teacher_groups(plan.weights > 0)  # one host read
    used = sorted({i for teachers, _ in groups for i in teachers})
    inputs = (hidden, weight, bias, *states, *heads, *biases)
    wanted = grad_wanted(inputs)
    pos = Positions(lead, None, None, direction, reduction, False)
    w_used = plan.weights[:, used]
    options = {
        "direction": direction,
        "temperature": temperature,
        "memory_budget": memory_budget,
        "chunk_size": chunk_size,
        "backend": backend,
        "validate": validate,
    }
    if wanted and not stash_in_forward(pos, wanted, stash, dtype=weight.dtype):
        sides = [(states[i], heads[i], biases[i]) for i in used]
        values = _recompute_teachers(
            hidden, weight, sides, w_used > 0, bias=bias, stash=stash, **options
        )
    else:
        coef = None
        if wanted:
            dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
            coef = _coefficients(w_used, plan, lead, reduction, counts, dtype)
        teachers = [(states[i], heads[i], biases[i], i) for i in used]
        values = _fused_teachers(hidden, weight, bias, teachers, groups, coef, **options)
    total = _combined(values, w_used)
    teacher_kls = None
    if return_details:
        teacher_kls = torch.zeros(lead.numel(), k, dtype=values.dtype, device=hidden.device)
        teacher_kls[:, used] = values.detach()
    return _finish(total, teacher_kls, plan, lead, reduction, counts, return_details)


def _fused_teachers(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    teachers: list[tuple[Tensor, Tensor, Tensor | None, int]],
    groups: list[tuple[tuple[int, ...], Tensor]],
    coef: Tensor | None,
    *,
    direction: str,
    temperature: float,
    memory_budget: int | None,
    chunk_size: int | None,
    backend: str,
    validate: bool | None,
) -> Tensor:
    """Each used teacher's per-position KL ``[N, U]`` through :class:`_TeacherRows`
    (``teachers``: hidden states, head, bias and index of each; ``coef``: the upstream gradients
    to write in the forward pass, or None for no gradient), the arguments checked as
    :func:`klest.kl_from_hidden` checks them."""
    check_plan_options(backend, memory_budget, chunk_size)
    tau = check_temperature(temperature)
    check_linear("", hidden, weight, bias)
    refuse_sharded_weight(weight, hidden, "weight")
    lead, v = hidden.shape[:-1], weight.shape[0]
    flat = []
    for states, head, head_bias, i in teachers:
        refuse_sharded_weight(head, states, f"teacher_weights[{i}]")
        flat += [*_ref_side(lead, v, states, head, head_bias, None)[:2], head_bias]
    h = hidden.reshape(-1, hidden.shape[-1])
    widest = max((len(used) for used, _ in groups), default=1)
    # A chunk of several teachers also holds a copy of pi's logits and the gradients' sum.
    resolved, chunk = plan_chunks(
        h,
        weight,
        v,
        backend=backend,
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        workspace=workspace_bytes_per_row,
        buffers=3 if widest == 1 else 5,
    )
    slot = {i: j for j, (*_, i) in enumerate(teachers)}
    chunks = [
        (idx, tuple(slot[i] for i in used)) for used, rows in groups for idx in rows.split(chunk)
    ]
    row_plan = _KLPlan(1.0 / tau, False, resolved, chunk, direction)
    checks = ValueChecks(resolve_validate(validate))
    values = _TeacherRows.apply(coef, chunks, row_plan, checks, h, weight, bias, *flat)
    checks.run()
    return values


def _teacher_groups(positive: Tensor) -> list[tuple[tuple[int, ...], Tensor]]:
    """The counted rows grouped by their set of teachers (those of positive weight, from
    ``positive`` ``[N, K]``): ``(teachers, rows)`` per set, the rows in order (one host read).
    A route gives one group per teacher routed to; global weights, one group."""
    sets, inverse, sizes = torch.unique(positive, dim=0, return_inverse=True, return_counts=True)
    order = torch.sort(inverse, stable=True).indices
    k = positive.shape[1]
    host = torch.cat([sets.reshape(-1).to(sizes.dtype), sizes]).tolist()
    flags, sizes_list = host[: sets.numel()], host[sets.numel() :]
    groups = []
    for g, rows in enumerate(order.split(sizes_list)):
        teachers = tuple(i for i in range(k) if flags[g * k + i])
        if teachers:
            groups.append((teachers, rows))
    return groups


def _combined(values: Tensor, w: Tensor) -> Tensor:
    """Each position's weighted sum over the teachers ``sum_k w[n, k] values[n, k]`` (``[N]``
    from ``[N, U]``; ``values`` is 0 where ``w`` is)."""
    return (w.to(values.dtype) * values).sum(-1)


def _coefficients(
    w: Tensor,
    plan: _Plan,
    lead: torch.Size,
    reduction: str,
    counts: GlobalCounts | None,
    dtype: torch.dtype,
) -> Tensor:
    """The upstream gradient ``[N, U]`` each teacher's per-position KL gets when the result
    reaches the backward with 1: the weights times the reduction's, found by differentiating
    the very combination and reduction the call applies (so that the backward finds them bit
    for bit, and does nothing)."""
    leaf = torch.zeros(w.shape, dtype=dtype, device=w.device, requires_grad=True)
    with torch.enable_grad():
        result = _finish(_combined(leaf, w), None, plan, lead, reduction, counts, False)
        (coef,) = torch.autograd.grad(result, leaf, allow_unused=True)
    return torch.zeros_like(leaf) if coef is None else coef.detach()


def _recompute_teachers(
    hidden: Tensor,
    weight: Tensor,
    sides: list[tuple[Tensor, Tensor, Tensor | None]],
    positive: Tensor,
    **options,
) -> Tensor:
    """Each teacher's per-position KL ``[N, U]`` (0 where its weight is 0), one
    :func:`klest.kl_from_hidden` call a teacher, masked to its rows, recomputing in the
    backward. No teacher: one empty call, for the graph."""
    lead = hidden.shape[:-1]
    columns = []
    for j, (h_ref, w_ref, b_ref) in enumerate(sides or [(hidden, weight, None)]):
        mask = positive[:, j] if sides else torch.zeros(lead.numel(), dtype=torch.bool)
        kl = kl_from_hidden(
            hidden,
            weight,
            h_ref,
            w_ref,
            bias_ref=b_ref,
            mask=mask.reshape(lead).to(hidden.device),
            reduction="none",
            **options,
        )
        columns.append(kl.reshape(-1))
    return torch.stack(columns, -1)[:, : len(sides)]


class _TeacherRows(torch.autograd.Function):
    """``(h, W, b, then h_k, W_k, b_k for each of U teachers) -> [N, U]``: each row's KL to
    each of its teachers (0 where not computed), chunk by chunk (``chunks``: the rows and the
    teachers of each chunk), pi's logits made once a chunk for all its teachers.

    ``coef`` ``[N, U]`` (the upstream gradients, or None for no gradient): the gradients are
    written in the forward pass, each chunk's ``dL/dz`` summed over its teachers before
    ``dh`` and ``dW``, and only scaled in the backward (:func:`klest.logits.from_hidden.
    scaled_grads`)."""

    @staticmethod
    def forward(ctx, coef, chunks, plan, checks: ValueChecks, h, w, b, *teachers):
        ctx.set_materialize_grads(False)
        need = ctx.needs_input_grad
        pi = _Head(h, w, b)
        refs = [_Head(*teachers[j : j + 3]) for j in range(0, len(teachers), 3)]
        n = h.shape[0]
        dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
        out = torch.zeros(len(refs), plan.n_stats, n, dtype=dtype, device=h.device)
        sides = None
        if coef is not None:
            sides = [
                _HeadGrads(head, (*need[4 + 3 * j : 7 + 3 * j], False), wide=True)
                for j, head in enumerate([pi, *refs])
            ]
        for idx, used in chunks:
            z_c = pi.chunk_logits(idx)
            dz_c = None
            for j in used:
                y_c = refs[j].chunk_logits(idx)
                if sides is None:
                    stats = plan.stats(z_c, y_c, None)
                else:
                    need_z = sides[0].needed
                    # The last teacher writes its gradient over pi's logits, the others a copy.
                    z_in = z_c.clone() if need_z and j != used[-1] else z_c
                    stats, dz, dy = plan.stats_grads(
                        z_in,
                        y_c,
                        None,
                        coef[:, j].index_select(0, idx),
                        need_z,
                        sides[1 + j].needed,
                    )
                    sides[1 + j].add(idx, dy)
                    dz_c = dz if dz_c is None else dz.add_(dz_c)
                out[j].index_copy_(1, idx, stats.to(dtype))
            if sides is not None:
                sides[0].add(idx, dz_c)
        for stats in out:
            check_rows_have_distributions(*plan.lse(stats), None, checks)
        ctx.grads = None if sides is None else tuple(sides)
        ctx.plan = plan
        ctx.save_for_backward(coef)
        values = [plan.outputs(stats)[0] for stats in out]
        return torch.stack(values, -1) if values else out.new_zeros(n, 0)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (coef,) = ctx.saved_tensors
        stashed = take_stashed(ctx)
        if g is None:
            return (None,) * (4 + 3 * len(stashed))
        grads = scaled_grads(stashed, g, coef, ctx.plan)
        return (None, None, None, None, *(d for side in grads for d in side[:3]))
