r"""Exact generalized Jensen-Shannon divergence, skew KL and total variation from logits.

For pi's logits ``z`` (the student, the trainable model) and ref's logits ``y`` (the teacher) at
temperature :math:`\tau`, :math:`\pi = \mathrm{softmax}(z/\tau)`,
:math:`ref = \mathrm{softmax}(y/\tau)`, each position gets one of

.. math::
    JSD_\beta(\pi, ref) = \beta\, KL(ref\|m_\beta) + (1-\beta)\, KL(\pi\|m_\beta), \quad
    m_\beta = \beta\, ref + (1-\beta)\, \pi \\
    KL(\pi\|\alpha\pi + (1-\alpha) ref), \quad KL(ref\|\alpha\, ref + (1-\alpha)\pi), \quad
    TV(\pi, ref) = \tfrac12 \textstyle\sum_v |\pi_v - ref_v|,

exactly, over the whole vocabulary, memory-bounded (row chunks, as :func:`klest.kl_from_logits`),
with gradients to both logits; each also has a form fused with the LM heads
(``*_from_hidden``, as :func:`klest.kl_from_hidden`: from hidden states and head weights, no
``[N, V]`` logits held, gradients to both models' hidden states, weights and biases). The row
engine is :mod:`klest.logits._divergence_rows` (chunked PyTorch) or, on CUDA, the Triton
kernels of :mod:`klest.logits.kernels.divergence` (forward: the log-normalizers by the KL
kernel, then one more read for the divergence; backward: one read, one write of each gradient);
positions, masks, labels and reductions are those of :mod:`klest.logits._call`.

The JSD's ``beta`` is TRL's (``generalized_jsd_loss`` of its GKD / distillation trainers) and
Liger-Kernel's (``LigerJSD``, ``LigerFusedLinearJSD``): both define
:math:`\beta\,KL(P\|M) + (1-\beta)KL(Q\|M)`, :math:`M = \beta P + (1-\beta) Q`, with ``Q`` the
student's and ``P`` the teacher's distribution, and return :math:`KL(teacher\|student)` at
:math:`\beta = 0` and :math:`KL(student\|teacher)` at :math:`\beta = 1`
(https://github.com/linkedin/Liger-Kernel, https://huggingface.co/docs/trl).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from klest._checks import (
    ValueChecks,
    check_direction,
    check_rows_have_distributions,
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
    value_coefficients,
    with_result,
)
from klest.logits._chunking import work_dtype
from klest.logits._divergence_rows import (
    BUFFERS_PER_ROW,
    ROW_OUTPUTS,
    Divergence,
    divergence_grads,
    divergence_rows,
    divergence_rows_grads,
)
from klest.logits._rows import chunk_rows, rescale_rows_, resolve_backend
from klest.logits.from_hidden import kl_from_hidden, run_hidden
from klest.logits.from_logits import kl_from_logits, logits_positions

__all__ = [
    "jsd_from_hidden",
    "jsd_from_logits",
    "skew_kl_from_hidden",
    "skew_kl_from_logits",
    "tv_from_hidden",
    "tv_from_logits",
]

_OPTIONS = (
    "mask",
    "cu_seqlens",
    "max_seqlen",
    "counts",
    "reduction",
    "temperature",
    "labels",
    "ignore_index",
    "memory_budget",
    "chunk_size",
    "backend",
    "stash",
    "scale",
    "valid_vocab_size",
    "validate",
    "return_details",
)
"""The options every function here passes on unchanged."""
_LOGITS_OPTIONS = (*_OPTIONS, "overwrite_logits")
_HIDDEN_OPTIONS = ("logits_ref", "bias", "bias_ref", *_OPTIONS)


def _options(values: dict, names: tuple[str, ...]) -> dict:
    """The named options out of a function's ``locals()``."""
    return {name: values[name] for name in names}


def check_unit_interval(name: str, value: object, *, open_low: bool, open_high: bool) -> float:
    """A real number in the unit interval (open at the ends asked for), as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    low_ok = value > 0.0 if open_low else value >= 0.0
    high_ok = value < 1.0 if open_high else value <= 1.0
    if not (math.isfinite(value) and low_ok and high_ok):
        interval = f"{'(' if open_low else '['}0, 1{')' if open_high else ']'}"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def jsd_divergence(beta: float) -> Divergence:
    """The generalized JSD for ``0 < beta < 1``: ref's weight in the mixture is ``beta``."""
    return Divergence("mixture", w=beta, c_q=1.0 - beta, c_p=beta)


def skew_divergence(alpha: float, direction: str) -> Divergence:
    """``KL(pi || alpha pi + (1-alpha) ref)`` or ``KL(ref || alpha ref + (1-alpha) pi)``."""
    if direction == "pi||ref":
        return Divergence("mixture", w=1.0 - alpha, c_q=1.0)
    return Divergence("mixture", w=alpha, c_p=1.0)


TV = Divergence("tv")


@dataclass(frozen=True)
class DivergencePlan:
    """The row plan of a divergence (also a :class:`klest.logits.from_hidden.HiddenRowPlan`):
    per row ``ROW_OUTPUTS`` of :mod:`klest.logits._divergence_rows`; only the value has a
    gradient."""

    div: Divergence
    inv_tau: float
    want_entropy: bool
    chunk: int
    backend: str = "torch"
    n_stats: int = len(ROW_OUTPUTS)
    constant: tuple[int, ...] = (1, 2, 3, 4, 5)

    def stats_grads(
        self,
        z_c: Tensor,
        y_c: Tensor,
        labels: Tensor | None,
        coef: Tensor,
        need_z: bool,
        need_y: bool,
        rows: Tensor | None = None,
        keep: Tensor | None = None,
        overwrite: bool = True,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """:meth:`stats` and the gradients for the row coefficients ``coef`` from the same
        pass, written over ``z_c`` / ``y_c`` with ``overwrite``."""
        return divergence_rows_grads(
            z_c,
            y_c,
            self.div,
            coef,
            inv_tau=self.inv_tau,
            labels=labels,
            rows=rows,
            want_entropy=self.want_entropy,
            chunk=self.chunk,
            need_z=need_z,
            need_y=need_y,
            backend=self.backend,
            keep=keep,
            dz=z_c if overwrite and need_z else None,
            dy=y_c if overwrite and need_y else None,
        )

    def stats(
        self,
        z_c: Tensor,
        y_c: Tensor,
        labels: Tensor | None,
        rows: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> Tensor:
        return divergence_rows(
            z_c,
            y_c,
            self.div,
            inv_tau=self.inv_tau,
            labels=labels,
            rows=rows,
            want_entropy=self.want_entropy,
            chunk=self.chunk,
            backend=self.backend,
            keep=keep,
        )

    @property
    def reads_saved_stats(self) -> bool:
        """Whether :meth:`grads` reads the forward's statistics (else it recomputes them)."""
        return self.backend == "triton"

    def outputs(self, out: Tensor) -> tuple[Tensor, ...]:
        """``(D, 0, 0, entropy, logp, logp_ref)``: the order of
        ``klest.logits._call.OUTPUTS``, the divergence as the value (no KLs)."""
        value, entropy, logp, logp_ref = (t.clone() for t in out[:4])
        zeros = torch.zeros_like(value)
        return value, zeros, zeros.clone(), entropy, logp, logp_ref

    def lse(self, out: Tensor) -> tuple[Tensor, Tensor]:
        return out[4], out[5]

    def grads(
        self,
        z_c: Tensor,
        y_c: Tensor,
        saved: Tensor | None,
        grads: tuple[Tensor | None, ...],
        labels: Tensor | None,
        need_z: bool,
        need_y: bool,
        rows: Tensor | None = None,
        keep: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        if grads[0] is None:
            return None, None
        return divergence_grads(
            z_c,
            y_c,
            self.div,
            grads[0],
            inv_tau=self.inv_tau,
            rows=rows,
            need_z=need_z,
            need_y=need_y,
            chunk=self.chunk,
            backend=self.backend,
            saved=saved,
            keep=keep,
        )


def bytes_per_row(v: int) -> int:
    """Float32 workspace per row of V entries (the backward's, the larger)."""
    return BUFFERS_PER_ROW * 4 * v


class _RowsDivergence(torch.autograd.Function):
    """``(z [N, V], y [N, V]) -> (D, 0, 0, entropy, logp, logp_ref)``, six float ``[N]``; only
    ``D`` is differentiable. With ``coef`` (the value's row coefficients) the forward writes
    the gradient and the backward rescales only the rows whose upstream gradient differs;
    else the backward recomputes it."""

    @staticmethod
    def forward(ctx, z, y, labels, rows, keep, coef, plan: DivergencePlan, overwrite, checks):
        ctx.set_materialize_grads(False)
        need_z, need_y = ctx.needs_input_grad[:2]
        ctx.stash = None
        if coef is not None:
            out, dz, dy = plan.stats_grads(
                z, y, labels, coef, need_z, need_y, rows, keep, overwrite=overwrite
            )
            ctx.stash = (dz, dy)
            ctx.save_for_backward(coef)
        else:
            out = plan.stats(z, y, labels, rows, keep)
            # the row statistics are saved for a backward that reads them (the Triton one)
            ctx.save_for_backward(z, y, rows, keep, out if plan.reads_saved_stats else None)
        check_rows_have_distributions(*plan.lse(out), None, checks)
        ctx.plan = plan
        ctx.in_forward = coef is not None
        outputs = plan.outputs(out)
        ctx.mark_non_differentiable(*(outputs[i] for i in plan.constant))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        nones = (None,) * 7
        if ctx.in_forward:
            if ctx.stash is None:
                raise RuntimeError(
                    "this graph was already backpropagated (its gradient, written in the "
                    "forward pass, is used up); for a second backward pass stash=False"
                )
            (coef,) = ctx.saved_tensors
            dz, dy = ctx.stash
            ctx.stash = None
            if grads[0] is None:
                return None, None, *nones
            for d in (dz, dy):
                if d is not None:
                    rescale_rows_(d, grads[0], coef, backend=ctx.plan.backend)
            return dz, dy, *nones
        z, y, rows, keep, out = ctx.saved_tensors
        need_z, need_y = ctx.needs_input_grad[:2]
        dz, dy = ctx.plan.grads(z, y, out, grads, None, need_z, need_y, rows, keep)
        return dz, dy, *nones


def _from_logits(
    div: Divergence,
    logits: Tensor,
    logits_ref: Tensor,
    *,
    mask: Tensor | None,
    reduction: str,
    temperature: float,
    labels: Tensor | None,
    ignore_index: int,
    memory_budget: int | None,
    chunk_size: int | None,
    backend: str,
    stash: bool | None,
    scale: float | Tensor | None,
    overwrite_logits: bool,
    valid_vocab_size: int | None,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    counts: GlobalCounts | None,
    validate: bool | None,
    return_details: bool,
) -> Tensor | WithDetails[LogitsDetails]:
    check_plan_options(backend, memory_budget, chunk_size)
    checks = ValueChecks(resolve_validate(validate))
    z, y, pos, tau = logits_positions(
        logits,
        logits_ref,
        direction="pi||ref",  # the divergence is output 0, where finish() reads KL(pi||ref)
        temperature=temperature,
        mask=mask,
        labels=labels,
        ignore_index=ignore_index,
        reduction=reduction,
        details=return_details,
        checks=checks,
        valid_vocab_size=valid_vocab_size,
    )
    plan = DivergencePlan(
        div=div,
        inv_tau=1.0 / tau,
        want_entropy=return_details,
        chunk=chunk_rows(bytes_per_row(z.shape[1]), z.device, memory_budget, chunk_size),
        backend=resolve_backend(backend, z),
    )
    return run_rows(
        z, y, pos.labels, pos, plan, checks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        counts=counts, scale=scale, stash=stash, overwrite_logits=overwrite_logits,
    )  # fmt: skip


def run_rows(
    z: Tensor,
    y: Tensor,
    labels: Tensor | None,
    pos: Positions,
    plan: DivergencePlan,
    checks: ValueChecks,
    *,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    counts: GlobalCounts | None,
    scale: float | Tensor | None,
    stash: bool | None,
    overwrite_logits: bool,
) -> Tensor | WithDetails[LogitsDetails]:
    """The divergence of ``plan`` on the rows ``[N, V]`` of checked logits at the positions
    ``pos`` (``labels``: in the plan's convention), gradient in the forward pass where
    :func:`~klest.logits._call.gradient_in_forward` says so, reduced and shaped."""
    pos = in_sequences(pos, cu_seqlens, max_seqlen, counts, z.device, checks)
    pos = with_result(pos, scale=scale)
    grad_wanted = torch.is_grad_enabled() and (z.requires_grad or y.requires_grad)
    coef = None
    if gradient_in_forward(pos, grad_wanted, stash, overwrite_logits, z.dtype):
        coef = value_coefficients(pos, z.shape[0], work_dtype(z), z.device)
    rows, flags = pos.selection(plan.backend)
    overwrite = bool(overwrite_logits)
    outputs = _RowsDivergence.apply(z, y, labels, rows, flags, coef, plan, overwrite, checks)
    checks.run()
    return finish(outputs, pos)


def _from_hidden(
    div: Divergence,
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None,
    weight_ref: Tensor | None,
    **options,
) -> Tensor | WithDetails[LogitsDetails]:
    """``div`` fused with the LM heads: :func:`klest.logits.from_hidden.run_hidden` with a
    :class:`DivergencePlan` (the options are ``_HIDDEN_OPTIONS``)."""
    want_entropy = options["return_details"]

    def make_plan(inv_tau: float, backend: str, chunk: int) -> DivergencePlan:
        return DivergencePlan(div, inv_tau, want_entropy, chunk, backend)

    return run_hidden(
        hidden,
        weight,
        hidden_ref,
        weight_ref,
        direction="pi||ref",  # the divergence is output 0, where finish() reads KL(pi||ref)
        make_plan=make_plan,
        workspace=bytes_per_row,
        **options,
    )


def jsd_from_logits(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    beta: float,
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
    valid_vocab_size: int | None = None,
    overwrite_logits: bool = False,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position generalized Jensen-Shannon divergence between pi and ref, from logits.

    .. math::
        JSD_\beta(\pi_n, ref_n) = \beta\, KL(ref_n\|m_n) + (1-\beta)\, KL(\pi_n\|m_n), \quad
        m_n = \beta\, ref_n + (1-\beta)\, \pi_n,

    with :math:`\pi_n = \mathrm{softmax}(z_n/T)` (``logits``, the student) and
    :math:`ref_n = \mathrm{softmax}(y_n/T)` (``logits_ref``, the teacher), for
    :math:`0 < \beta < 1`; :math:`KL(ref\|\pi)` at :math:`\beta = 0` and :math:`KL(\pi\|ref)` at
    :math:`\beta = 1`. No samples: sums over the whole vocabulary. The value equals TRL's
    ``generalized_jsd_loss(student_logits=logits, teacher_logits=logits_ref, beta=beta)`` per
    position (its GKD / distillation trainers' ``beta``: 0 gives KL(teacher||student), 1 gives
    KL(student||teacher)), and Liger-Kernel's ``LigerJSD`` / ``LigerFusedLinearJSD`` with the
    same ``beta`` (student log-probs as its input, teacher's as its target).

    Continuity: the mixture formula tends to 0 as :math:`\beta \to 0` or :math:`1`
    (:math:`JSD_\beta = \beta\,KL(ref\|\pi) + O(\beta^2)`); TRL and Liger return the KL at the
    two ends, and so does this function, so the value jumps there. What is continuous is
    :math:`JSD_\beta / (\beta(1-\beta))`, which tends to :math:`KL(ref\|\pi)` and
    :math:`KL(\pi\|ref)` at the ends: divide by :math:`\beta(1-\beta)` to sweep ``beta``
    smoothly.

    Gradients to both logits (``logits_ref`` when it requires grad), with
    :math:`m` as above:
    :math:`\partial/\partial z = \tfrac{1-\beta}{T}\,\pi\odot(\log\pi - \log m - KL(\pi\|m))`,
    :math:`\partial/\partial y = \tfrac{\beta}{T}\,ref\odot(\log ref - \log m - KL(ref\|m))`.
    Always finite (``0 log 0 = 0``; ``-inf`` logits are outside the support); bounded by
    :math:`h(\beta) \le \log 2` (the binary entropy of :math:`\beta`). Math in float32 for
    float32 / bf16 / fp16 inputs, float64 for float64; gradients in the inputs' dtypes.

    See "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
    (Agarwal et al., ICLR 2024, https://arxiv.org/abs/2306.13649, Eq. 1) for the generalized
    JSD, and TRL (https://huggingface.co/docs/trl) and Liger-Kernel
    (https://github.com/linkedin/Liger-Kernel) for the ``beta`` convention.

    Args:
      logits: pi's (the student's) logits ``[..., V]``, any float dtype.
      logits_ref: ref's (the teacher's) logits, same shape and device.
      beta: ref's weight in the mixture, in ``[0, 1]`` (TRL's and Liger's ``beta``).
      mask: bool ``[...]``, True at positions that count; others give 0 and no gradient.
      reduction: over the per-position values ``[...]`` by the rule of
        :mod:`klest.aggregation` (default ``"seq-mean-token-sum"``; ``"none"`` keeps ``[...]``).
      temperature: :math:`T > 0`, dividing both logits.
      labels: int ``[...]`` token ids (already shifted); ``ignore_index`` positions are masked.
      ignore_index: the label of positions to leave out (default -100).
      memory_budget: bytes of chunk workspace (default 32 MiB on the CPU, 1 GiB on a GPU).
      chunk_size: rows per chunk, overriding ``memory_budget``.
      backend: ``"auto"`` (Triton on CUDA when available, else PyTorch), ``"torch"``,
        ``"triton"`` (also on CPU tensors under ``TRITON_INTERPRET=1``, for tests).
      stash: None (default): the gradient is written in the forward pass when the result is a
        scalar (or ``scale`` is given, or ``overwrite_logits``) and the backward only rescales
        the rows whose upstream gradient differs; False: the backward recomputes it (needed to
        backpropagate twice); True: always in the forward (as :func:`klest.kl_from_logits`).
      scale: multiplies the result and its gradient (a loss coefficient, ``1 / count``), so
        that ``loss = other + f(..., scale=beta)`` reaches the backward with 1 and it does
        nothing; a per-position result with a ``scale`` is taken to be summed.
      overwrite_logits: write the gradient over ``logits`` (and ``logits_ref``, when it
        requires grad) instead of new tensors: no second ``[N, V]`` buffer, but the logits are
        gone after the call (off by default: trainers reuse them).
      valid_vocab_size: the real vocabulary :math:`V'`: later columns (head rows) are padding
        and left out, as in :func:`klest.kl_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: check for rows with NaN / ``+inf`` logits or no finite logit, labels out of
        range, non-0/1 masks (None: the global default).
      return_details: also return a :class:`~klest.LogitsDetails` (label log-probs, pi's
        entropy, diagnostics); for ``0 < beta < 1`` these carry no gradient.

    Returns:
      The reduced JSD in float32 (float64 for float64 inputs); with ``return_details``,
      ``(jsd, details)``.

    Raises:
      ValueError: ``beta`` outside ``[0, 1]``, mismatched shapes, NaN / ``+inf`` logits or a
        row of only ``-inf`` at a kept position, bad mask / labels / temperature / names.

    Example:
      >>> z = torch.randn(2, 5, 11, requires_grad=True); y = torch.randn(2, 5, 11)
      >>> jsd = jsd_from_logits(z, y, beta=0.5, reduction="none")
      >>> bool((jsd >= 0).all() and (jsd <= math.log(2)).all())
      True
      >>> jsd.sum().backward()
      >>> ends = jsd_from_logits(z, y, beta=0.0), kl_from_logits(z, y, direction="ref||pi")
      >>> torch.allclose(*ends)
      True
    """
    beta = check_unit_interval("beta", beta, open_low=False, open_high=False)
    options = _options(locals(), _LOGITS_OPTIONS)
    if beta in (0.0, 1.0):
        direction = "ref||pi" if beta == 0.0 else "pi||ref"
        return kl_from_logits(logits, logits_ref, direction=direction, **options)
    return _from_logits(jsd_divergence(beta), logits, logits_ref, **options)


def skew_kl_from_logits(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    alpha: float,
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
    valid_vocab_size: int | None = None,
    overwrite_logits: bool = False,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position skew KL: the KL to a mixture that keeps some of the first argument.

    .. math::
        KL(\pi_n \,\|\, \alpha\pi_n + (1-\alpha)\, ref_n) \quad\text{or}\quad
        KL(ref_n \,\|\, \alpha\, ref_n + (1-\alpha)\pi_n)\ (\texttt{direction="ref||pi"}),

    with :math:`\pi_n = \mathrm{softmax}(z_n/T)` and :math:`ref_n = \mathrm{softmax}(y_n/T)`.
    At :math:`\alpha = 0` it is the KL (:func:`klest.kl_from_logits`), continuously in
    :math:`\alpha`; for :math:`\alpha > 0` it is always finite, at most :math:`-\log\alpha`.
    Gradients to both logits; the options are those of :func:`jsd_from_logits`. It is the
    :math:`\beta \to 0` / :math:`1` building block of the generalized JSD:
    :math:`JSD_\beta = \beta\,KL(ref\|m) + (1-\beta)\,KL(\pi\|m)` where
    :math:`KL(\pi\|m)` is the ``"pi||ref"`` skew KL at :math:`\alpha = 1-\beta`.

    See L. Lee, "Measures of Distributional Similarity" (ACL 1999,
    https://aclanthology.org/P99-1004/) for the skew divergence.

    Args:
      logits: pi's logits ``[..., V]``, any float dtype.
      logits_ref: ref's logits, same shape and device.
      alpha: the first argument's weight in the mixture, in ``[0, 1)``.
      direction: ``"pi||ref"`` (pi first) or ``"ref||pi"`` (ref first).
      mask: as in :func:`jsd_from_logits`.
      reduction: as in :func:`jsd_from_logits`.
      temperature: as in :func:`jsd_from_logits`.
      labels: as in :func:`jsd_from_logits`.
      ignore_index: as in :func:`jsd_from_logits`.
      memory_budget: as in :func:`jsd_from_logits`.
      chunk_size: as in :func:`jsd_from_logits`.
      backend: as in :func:`jsd_from_logits`.
      stash: as in :func:`jsd_from_logits`.
      scale: as in :func:`jsd_from_logits`.
      overwrite_logits: as in :func:`jsd_from_logits`.
      valid_vocab_size: the real vocabulary :math:`V'`: later columns (head rows) are padding
        and left out, as in :func:`klest.kl_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`jsd_from_logits`.
      return_details: as in :func:`jsd_from_logits`.

    Returns:
      The reduced skew KL (float32, float64 for float64 inputs); with ``return_details``,
      ``(value, details)``.

    Example:
      >>> z = torch.randn(3, 7, requires_grad=True); y = torch.randn(3, 7)
      >>> s = skew_kl_from_logits(z, y, alpha=0.1, reduction="none")
      >>> bool((s <= -math.log(0.1)).all())
      True
      >>> s.sum().backward()
    """
    check_direction(direction)
    alpha = check_unit_interval("alpha", alpha, open_low=False, open_high=True)
    options = _options(locals(), _LOGITS_OPTIONS)
    if alpha == 0.0:
        return kl_from_logits(logits, logits_ref, direction=direction, **options)
    return _from_logits(skew_divergence(alpha, direction), logits, logits_ref, **options)


def tv_from_logits(
    logits: Tensor,
    logits_ref: Tensor,
    *,
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
    valid_vocab_size: int | None = None,
    overwrite_logits: bool = False,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position total variation distance between pi and ref, from logits.

    .. math::
        TV(\pi_n, ref_n) = \tfrac12 \textstyle\sum_v |\pi_{n,v} - ref_{n,v}| \in [0, 1],

    with :math:`\pi_n = \mathrm{softmax}(z_n/T)` and :math:`ref_n = \mathrm{softmax}(y_n/T)`;
    symmetric. Gradient: :math:`\partial/\partial z = \tfrac1{2T}\,\pi\odot(s - \langle\pi,
    s\rangle)` with :math:`s = \mathrm{sign}(\pi - ref)`, and the same with :math:`-s` and
    :math:`ref` for ``y``. TV is not differentiable where :math:`\pi_v = ref_v`; there
    ``sign(0) = 0`` gives a subgradient, and at :math:`\pi = ref` the returned gradient is 0
    (the minimum). Pinsker: :math:`TV \le \sqrt{KL/2}` for either KL. Options as in
    :func:`jsd_from_logits`.

    See A. B. Tsybakov, "Introduction to Nonparametric Estimation" (Springer, 2009, Chapter 2)
    for the total variation distance and Pinsker's inequality.

    Args:
      logits: pi's logits ``[..., V]``, any float dtype.
      logits_ref: ref's logits, same shape and device.
      mask: as in :func:`jsd_from_logits`.
      reduction: as in :func:`jsd_from_logits`.
      temperature: as in :func:`jsd_from_logits`.
      labels: as in :func:`jsd_from_logits`.
      ignore_index: as in :func:`jsd_from_logits`.
      memory_budget: as in :func:`jsd_from_logits`.
      chunk_size: as in :func:`jsd_from_logits`.
      backend: as in :func:`jsd_from_logits`.
      stash: as in :func:`jsd_from_logits`.
      scale: as in :func:`jsd_from_logits`.
      overwrite_logits: as in :func:`jsd_from_logits`.
      valid_vocab_size: the real vocabulary :math:`V'`: later columns (head rows) are padding
        and left out, as in :func:`klest.kl_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`jsd_from_logits`.
      return_details: as in :func:`jsd_from_logits`.

    Returns:
      The reduced TV (float32, float64 for float64 inputs); with ``return_details``,
      ``(tv, details)``.

    Example:
      >>> z = torch.tensor([[0.0, 0.0]]); y = torch.tensor([[0.0, -float("inf")]])
      >>> tv_from_logits(z, y, reduction="none")  # (1/2 |1/2 - 1| + 1/2 |1/2 - 0|)
      tensor([0.5000])
    """
    return _from_logits(
        TV,
        logits,
        logits_ref,
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
        overwrite_logits=overwrite_logits,
        valid_vocab_size=valid_vocab_size,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        validate=validate,
        return_details=return_details,
    )


def jsd_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    *,
    beta: float,
    logits_ref: Tensor | None = None,
    bias: Tensor | None = None,
    bias_ref: Tensor | None = None,
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
    valid_vocab_size: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position generalized JSD between pi = softmax(h W^T / T) and ref, fused with
    the LM heads (no ``[N, V]`` logits are ever held).

    .. math::
        JSD_\beta(\pi_n, ref_n) = \beta\, KL(ref_n\|m_n) + (1-\beta)\, KL(\pi_n\|m_n), \quad
        m_n = \beta\, ref_n + (1-\beta)\,\pi_n, \\
        \pi_n = \mathrm{softmax}((W h_n + b)/T), \;
        ref_n = \mathrm{softmax}((W_{ref} h^{ref}_n + b_{ref})/T),

    equal to :func:`jsd_from_logits` on the materialized logits (``beta`` as there: TRL's and
    Liger-Kernel's, :math:`KL(ref\|\pi)` at 0 and :math:`KL(\pi\|ref)` at 1, where this is
    :func:`klest.kl_from_hidden`), with gradients to ``hidden``, ``weight``, ``bias`` and, when
    they require grad, to ref's tensors. Chunks of rows make their logits, reduce them, and drop
    them; the backward recomputes them. The fused linear + divergence idea is Liger-Kernel's
    (``LigerFusedLinearJSD``, https://github.com/linkedin/Liger-Kernel, same ``beta``).

    See "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
    (Agarwal et al., ICLR 2024, https://arxiv.org/abs/2306.13649) for the generalized JSD.

    Args:
      hidden: pi's (the student's) final hidden states ``[..., H]`` (already shifted).
      weight: pi's LM head ``[V, H]``.
      hidden_ref: ref's (the teacher's) hidden states ``[..., H_ref]`` with ``weight_ref``
        ``[V, H_ref]``; or give ``logits_ref`` ``[..., V]`` instead.
      weight_ref: ref's LM head.
      beta: ref's weight in the mixture, in ``[0, 1]``.
      logits_ref: ref's logits, instead of ``hidden_ref`` / ``weight_ref``.
      bias: pi's LM-head bias ``[V]``, if any.
      bias_ref: ref's LM-head bias ``[V]``, if any.
      mask: bool ``[...]``, True at positions that count.
      reduction: as in :func:`jsd_from_logits`.
      temperature: :math:`T > 0`, dividing both models' logits.
      labels: int ``[...]`` token ids; ``ignore_index`` positions are masked.
      ignore_index: the label of positions to leave out.
      memory_budget: bytes for one chunk's logits and workspace (default 32 MiB on the CPU,
        1 GiB on a GPU).
      chunk_size: rows per chunk, overriding ``memory_budget``.
      backend: as in :func:`jsd_from_logits`.
      stash: as in :func:`klest.kl_from_hidden` (the gradients in the forward pass for a scalar
        ``reduction``).
      scale: as in :func:`jsd_from_logits`.
      valid_vocab_size: the real vocabulary :math:`V'`: later columns (head rows) are padding
        and left out, as in :func:`klest.kl_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`jsd_from_logits`.
      return_details: as in :func:`jsd_from_logits`.

    Returns:
      As :func:`jsd_from_logits`.

    Example:
      >>> head, ref_head = torch.nn.Linear(8, 50), torch.nn.Linear(8, 50)
      >>> h, h_ref = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
      >>> jsd = jsd_from_hidden(h, head.weight, h_ref, ref_head.weight, beta=0.5,
      ...                       bias=head.bias, bias_ref=ref_head.bias)
      >>> jsd.backward()  # gradients reach head.weight and head.bias
      >>> head.weight.grad.shape
      torch.Size([50, 8])
    """
    beta = check_unit_interval("beta", beta, open_low=False, open_high=False)
    options = _options(locals(), _HIDDEN_OPTIONS)
    if beta in (0.0, 1.0):
        direction = "ref||pi" if beta == 0.0 else "pi||ref"
        return kl_from_hidden(
            hidden, weight, hidden_ref, weight_ref, direction=direction, **options
        )
    return _from_hidden(jsd_divergence(beta), hidden, weight, hidden_ref, weight_ref, **options)


def skew_kl_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    *,
    alpha: float,
    direction: Direction = "pi||ref",
    logits_ref: Tensor | None = None,
    bias: Tensor | None = None,
    bias_ref: Tensor | None = None,
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
    valid_vocab_size: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position skew KL between pi = softmax(h W^T / T) and ref, fused with the LM
    heads (no ``[N, V]`` logits are ever held).

    .. math::
        KL(\pi_n \,\|\, \alpha\pi_n + (1-\alpha)\, ref_n) \quad\text{or}\quad
        KL(ref_n \,\|\, \alpha\, ref_n + (1-\alpha)\pi_n)\ (\texttt{direction="ref||pi"}), \\
        \pi_n = \mathrm{softmax}((W h_n + b)/T), \;
        ref_n = \mathrm{softmax}((W_{ref} h^{ref}_n + b_{ref})/T),

    equal to :func:`skew_kl_from_logits` on the materialized logits (at :math:`\alpha = 0` it
    is :func:`klest.kl_from_hidden`), with gradients to ``hidden``, ``weight``, ``bias`` and,
    when they require grad, to ref's tensors. Chunks of rows make their logits, reduce them and
    drop them; the backward recomputes them (as :func:`jsd_from_hidden`). No samples: sums over
    the whole vocabulary.

    See L. Lee, "Measures of Distributional Similarity" (ACL 1999,
    https://aclanthology.org/P99-1004/) for the skew divergence.

    Args:
      hidden: pi's final hidden states ``[..., H]`` (already shifted).
      weight: pi's LM head ``[V, H]``.
      hidden_ref: ref's hidden states ``[..., H_ref]`` with ``weight_ref`` ``[V, H_ref]``; or
        give ``logits_ref`` ``[..., V]`` instead.
      weight_ref: ref's LM head.
      alpha: the first argument's weight in the mixture, in ``[0, 1)``.
      direction: ``"pi||ref"`` (pi first) or ``"ref||pi"`` (ref first).
      logits_ref: ref's logits, instead of ``hidden_ref`` / ``weight_ref``.
      bias: pi's LM-head bias ``[V]``, if any.
      bias_ref: ref's LM-head bias ``[V]``, if any.
      mask: as in :func:`jsd_from_hidden`.
      reduction: as in :func:`jsd_from_hidden`.
      temperature: as in :func:`jsd_from_hidden`.
      labels: as in :func:`jsd_from_hidden`.
      ignore_index: as in :func:`jsd_from_hidden`.
      memory_budget: as in :func:`jsd_from_hidden`.
      chunk_size: as in :func:`jsd_from_hidden`.
      backend: as in :func:`jsd_from_hidden`.
      stash: as in :func:`jsd_from_hidden`.
      scale: as in :func:`jsd_from_hidden`.
      valid_vocab_size: the real vocabulary :math:`V'`: later columns (head rows) are padding
        and left out, as in :func:`klest.kl_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`jsd_from_hidden`.
      return_details: as in :func:`jsd_from_hidden`.

    Returns:
      As :func:`skew_kl_from_logits`.

    Example:
      >>> head, ref_head = torch.nn.Linear(8, 50), torch.nn.Linear(8, 50)
      >>> h, h_ref = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
      >>> s = skew_kl_from_hidden(h, head.weight, h_ref, ref_head.weight, alpha=0.1,
      ...                         reduction="none")
      >>> bool((s <= -math.log(0.1)).all())
      True
      >>> s.sum().backward()  # gradients reach h's head (and h, when it requires grad)
    """
    check_direction(direction)
    alpha = check_unit_interval("alpha", alpha, open_low=False, open_high=True)
    options = _options(locals(), _HIDDEN_OPTIONS)
    if alpha == 0.0:
        return kl_from_hidden(
            hidden, weight, hidden_ref, weight_ref, direction=direction, **options
        )
    div = skew_divergence(alpha, direction)
    return _from_hidden(div, hidden, weight, hidden_ref, weight_ref, **options)


def tv_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    *,
    logits_ref: Tensor | None = None,
    bias: Tensor | None = None,
    bias_ref: Tensor | None = None,
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
    valid_vocab_size: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[LogitsDetails]:
    r"""Exact per-position total variation between pi = softmax(h W^T / T) and ref, fused with
    the LM heads (no ``[N, V]`` logits are ever held).

    .. math::
        TV(\pi_n, ref_n) = \tfrac12 \textstyle\sum_v |\pi_{n,v} - ref_{n,v}|, \quad
        \pi_n = \mathrm{softmax}((W h_n + b)/T), \;
        ref_n = \mathrm{softmax}((W_{ref} h^{ref}_n + b_{ref})/T),

    equal to :func:`tv_from_logits` on the materialized logits (its subgradient convention at
    :math:`\pi_v = ref_v` included), with gradients to ``hidden``, ``weight``, ``bias`` and,
    when they require grad, to ref's tensors; chunked as :func:`jsd_from_hidden`.

    See A. B. Tsybakov, "Introduction to Nonparametric Estimation" (Springer, 2009, Chapter 2)
    for the total variation distance.

    Args:
      hidden: pi's final hidden states ``[..., H]`` (already shifted).
      weight: pi's LM head ``[V, H]``.
      hidden_ref: ref's hidden states ``[..., H_ref]`` with ``weight_ref`` ``[V, H_ref]``; or
        give ``logits_ref`` ``[..., V]`` instead.
      weight_ref: ref's LM head.
      logits_ref: ref's logits, instead of ``hidden_ref`` / ``weight_ref``.
      bias: pi's LM-head bias ``[V]``, if any.
      bias_ref: ref's LM-head bias ``[V]``, if any.
      mask: as in :func:`jsd_from_hidden`.
      reduction: as in :func:`jsd_from_hidden`.
      temperature: as in :func:`jsd_from_hidden`.
      labels: as in :func:`jsd_from_hidden`.
      ignore_index: as in :func:`jsd_from_hidden`.
      memory_budget: as in :func:`jsd_from_hidden`.
      chunk_size: as in :func:`jsd_from_hidden`.
      backend: as in :func:`jsd_from_hidden`.
      stash: as in :func:`jsd_from_hidden`.
      scale: as in :func:`jsd_from_hidden`.
      valid_vocab_size: the real vocabulary :math:`V'`: later columns (head rows) are padding
        and left out, as in :func:`klest.kl_from_logits`.
      cu_seqlens, max_seqlen, counts: as in :func:`klest.kl_from_logits`.
      validate: as in :func:`jsd_from_hidden`.
      return_details: as in :func:`jsd_from_hidden`.

    Returns:
      As :func:`tv_from_logits`.

    Example:
      >>> head = torch.nn.Linear(8, 50)
      >>> h = torch.randn(2, 6, 8, requires_grad=True); y = torch.randn(2, 6, 50)
      >>> tv = tv_from_hidden(h, head.weight, logits_ref=y, bias=head.bias, reduction="none")
      >>> bool(((tv >= 0) & (tv <= 1)).all())
      True
      >>> tv.sum().backward()
      >>> h.grad.shape
      torch.Size([2, 6, 8])
    """
    options = _options(locals(), _HIDDEN_OPTIONS)
    return _from_hidden(TV, hidden, weight, hidden_ref, weight_ref, **options)
