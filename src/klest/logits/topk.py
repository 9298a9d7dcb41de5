r"""KL between the student and a teacher known only by its top-k log-probs, with an unbiased tail.

Distillation pipelines store, per position, the teacher's k most likely tokens :math:`S` and
their log-probs :math:`\log ref_v` (:math:`v\in S`, over the whole vocabulary: not
renormalized), often the teacher's log-prob of the token the student sampled, and nothing else.
The student's logits give :math:`\pi` over the whole vocabulary. Write
:math:`P = \sum_{v\in S}\pi_v`, :math:`R = \sum_{v\in S} ref_v` and :math:`\bar P = 1 - P`,
:math:`\bar R = 1 - R` for the masses outside :math:`S` (the *tail*). The full KL splits as

.. math::
    KL(\pi\|ref) = \underbrace{\sum_{v\in S}\pi_v\log\frac{\pi_v}{ref_v}
        + \bar P\log\frac{\bar P}{\bar R}}_{\text{tail-bucket}}
        + \bar P\, KL(\pi_{tail}\|ref_{tail}),

with :math:`\pi_{tail} = \pi/\bar P` and :math:`ref_{tail} = ref/\bar R` on the tail (and
symmetrically for :math:`KL(ref\|\pi)`). Everything but the last term is known exactly; the
last needs the teacher's tail, which is not stored. A token :math:`y\sim\pi` falls in the tail
with probability :math:`\bar P`, and given that, it is a sample of :math:`\pi_{tail}`: so the
last term is estimated without bias from :math:`y` and :math:`\log ref_y`.

Estimators (``estimator=``):

- ``"truncated"``: the KL between the two distributions renormalized over :math:`S`,
  :math:`KL(\pi_S/P\,\|\,ref_S/R)`: NeMo-RL's ``DistillationLossFn`` with its default
  ``zero_outside_topk: false`` (https://github.com/NVIDIA-NeMo/RL). Biased, either sign.
- ``"truncated-raw"``: the sum over :math:`S` of the full-vocabulary terms,
  :math:`\sum_{v\in S}\pi_v\log(\pi_v/ref_v)` (or :math:`\sum_{v\in S} ref_v\log(ref_v/\pi_v)`):
  NeMo-RL's ``zero_outside_topk: true`` for ``kl_type: forward`` (its KL(ref||pi)); for its
  ``reverse`` it adds the student's tail terms against a constant teacher log-prob of -100,
  which klest does not reproduce. Biased.
- ``"generalized"``: the generalized (unnormalized) KL between the two measures restricted to
  :math:`S`, :math:`\sum_{v\in S}[\pi_v\log(\pi_v/ref_v) - \pi_v + ref_v]` (or with
  :math:`\pi` and :math:`ref` swapped for :math:`KL(ref\|\pi)`): non-negative, 0 iff the two
  agree on :math:`S`. The same sum over the tail is non-negative too and the two sums add up to
  the full KL (the masses cancel), so it is a *lower bound*, below ``"tail-bucket"``'s by
  :math:`\bar R - \bar P + \bar P\log(\bar P/\bar R) \ge 0` (:math:`\bar P` and
  :math:`\bar R` swapped for :math:`KL(ref\|\pi)`). Biased.
- ``"tail-bucket"``: :math:`S` plus one "rest" bucket, the first two terms above. A *lower
  bound* on the KL (the data-processing inequality: merging the tail into one outcome can only
  lose divergence); exact when the teacher's tail is proportional to the student's.
- ``"unbiased"`` (the default): exact over :math:`S` plus the tail from the sampled token,
  :math:`\sum_{v\in S}\pi_v\log\frac{\pi_v}{ref_v} + 1[y\notin S]\log\frac{\pi_y}{ref_y}`, and
  for :math:`KL(ref\|\pi)` the importance-weighted
  :math:`\sum_{v\in S} ref_v\log\frac{ref_v}{\pi_v} + 1[y\notin S]\,w_y\log w_y`,
  :math:`w_y = ref_y/\pi_y`.
- ``"unbiased-cv"``: tail-bucket plus Schulman's k3 of the *conditional* tail ratio
  :math:`u = (ref_y/\bar R)/(\pi_y/\bar P)`:
  :math:`1[y\notin S]\,(u - 1 - \log u)` for :math:`KL(\pi\|ref)`,
  :math:`1[y\notin S]\,(\bar R/\bar P)(u\log u - u + 1)` for :math:`KL(ref\|\pi)`. The student
  part of the tail is Rao-Blackwellized (its mass is known from the logits) and
  :math:`1[y\notin S](u - 1)` is a control variate with known mean 0
  (:math:`E_\pi[1[y\notin S]\,u] = \bar P`), so the estimate is unbiased, never below the
  tail-bucket bound, and has the variance of k3 on the tail only.

Gradients to the student's logits. ``truncated``, ``truncated-raw`` and ``tail-bucket`` are
deterministic functions of the logits: their gradient is theirs (of a biased objective).
For the sampled estimators, value :math:`V(\theta, y) = D(\theta) + g(\theta, y)` with
:math:`E_{y\sim\pi_\theta}V = KL` for every :math:`\theta`, the surrogate
:math:`V + \mathrm{sg}(g)\log\pi_y` (joined to the value by :func:`klest.decouple`'s rule) has
mean gradient :math:`E[\nabla D + \nabla g + g\nabla\log\pi_y] = \nabla KL`: an unbiased
estimate of the gradient of the full-vocabulary KL, either direction (the score term of
:math:`D` has mean 0 and is left out).

References: J. Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html) for k3; A. Amini, T. Vieira, R. Cotterell, "Better
Estimation of the Kullback-Leibler Divergence Between Language Models" (NeurIPS 2025,
https://arxiv.org/abs/2504.10637) for Rao-Blackwellizing what the logits give exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from klest._checks import (
    ValueChecks,
    check_choice,
    check_float_tensor,
    check_int_ids,
    check_log_probs,
    check_temperature,
    first_bad,
    resolve_validate,
)
from klest._numerics import exp_tail, xexp_tail
from klest._types import DEFAULT_REDUCTION, Direction, Reduction
from klest.aggregation import (
    GlobalCounts,
    KLDiagnostics,
    WithDetails,
    check_counts,
    diagnostics,
    reduce_rows,
)
from klest.layout import layout_of
from klest.logits._call import Positions, positions
from klest.logits._rows import chunk_rows
from klest.surrogates import join

__all__ = ["SAMPLED", "TopKDetails", "TopKEstimator", "kl_from_topk"]

TopKEstimator = Literal[
    "unbiased", "unbiased-cv", "tail-bucket", "truncated", "truncated-raw", "generalized"
]
"""The estimators of :func:`kl_from_topk`."""

SAMPLED = ("unbiased", "unbiased-cv")
"""The estimators that read the sampled token (``labels``, ``logp_ref_label``)."""

# How far above 1 the teacher's top-k mass may be from rounding alone (16-bit log-probs carry
# ~2^-8 relative error each; float32 ~1e-7).
_MASS_TOL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-7}
_MASS_TOL_DEFAULT = 1e-4
# Float32 buffers of V entries a row of a chunk holds at once (scaled logits, their masked copy).
_BUFFERS_PER_ROW = 3


class TopKDetails(NamedTuple):
    """What :func:`kl_from_topk` reports besides the KL (``return_details=True``).

    Attributes:
      teacher_mass: :math:`R = \\sum_{v\\in S} ref_v` per position ``[...]`` (0 where masked).
      student_mass: :math:`P = \\sum_{v\\in S}\\pi_v` per position.
      overlap: :math:`\\sum_{v\\in S}\\min(\\pi_v, ref_v)` per position (1 - total variation
        restricted to S).
      in_set: bool per position, the sampled token is in S (None without ``labels``).
      diagnostics: mean, standard error and counts of the per-position values.
    """

    teacher_mass: Tensor
    student_mass: Tensor
    overlap: Tensor
    in_set: Tensor | None
    diagnostics: KLDiagnostics


class _StudentLogProbs(torch.autograd.Function):
    """``(z [N, V], rows [n], ids [n, m], k) -> (log pi at ids [n, m], log tail mass [n],
    log-normalizer [n])`` for ``pi = softmax(z[rows] / tau)``, the tail being the entries not
    among the first ``k`` ids of each row; the normalizer is returned for validation only.
    The logits are read in chunks of rows; the backward recomputes the softmax chunk by chunk
    and writes the whole gradient in the work dtype, rounded once."""

    @staticmethod
    def forward(ctx, z, rows, ids, k: int, inv_tau: float, chunk: int):
        dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
        n = rows.numel()
        lse = torch.empty(n, dtype=dtype, device=z.device)
        lse_tail = torch.empty(n, dtype=dtype, device=z.device)
        picked = torch.empty(ids.shape, dtype=dtype, device=z.device)
        for s in range(0, n, chunk):
            sl = slice(s, s + chunk)
            a = z[rows[sl]].to(dtype) * inv_tau  # a new buffer (indexing copies)
            lse[sl] = torch.logsumexp(a, -1)
            picked[sl] = a.gather(-1, ids[sl]) - lse[sl, None]
            lse_tail[sl] = torch.logsumexp(a.scatter_(-1, ids[sl, :k], -math.inf), -1)
        ctx.save_for_backward(z, rows, ids, lse, lse_tail)
        ctx.k, ctx.inv_tau, ctx.chunk = k, inv_tau, chunk
        ctx.mark_non_differentiable(lse)
        return picked, lse_tail - lse, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, g_picked, g_tail, _g_lse):
        z, rows, ids, lse, lse_tail = ctx.saved_tensors
        dz = torch.zeros_like(z)
        # An empty tail (every entry in S or -inf) has no gradient: its softmax is all 0.
        lse_tail = torch.where(torch.isfinite(lse_tail), lse_tail, 0.0)
        g_picked = torch.zeros_like(ids, dtype=lse.dtype) if g_picked is None else g_picked
        g_tail = torch.zeros_like(lse) if g_tail is None else g_tail
        # d log pi_j / dz = (e_j - pi) / tau; d log(tail mass) / dz = (pi_tail / tail - pi) / tau
        g_lse = -(g_picked.sum(-1) + g_tail) * ctx.inv_tau
        for s in range(0, rows.numel(), ctx.chunk):
            sl = slice(s, s + ctx.chunk)
            a = z[rows[sl]].to(lse.dtype) * ctx.inv_tau
            d = (a - lse[sl, None]).exp().mul_(g_lse[sl, None])
            tail = a.scatter_(-1, ids[sl, : ctx.k], -math.inf).sub_(lse_tail[sl, None]).exp_()
            d.add_(tail.mul_(g_tail[sl, None] * ctx.inv_tau))
            d.scatter_add_(-1, ids[sl], g_picked[sl] * ctx.inv_tau)
            dz[rows[sl]] = d.to(z.dtype)
        return dz, None, None, None, None, None


@dataclass(frozen=True)
class _Terms:
    """Per kept position: the student's log-probs on S (``a``) and of the sampled token
    (``a_y``), the teacher's (``b``, ``b_y``), the log tail masses ``lp`` (student), ``lr``
    (teacher), and ``out`` (the sampled token is outside S). ``b``, ``b_y``, ``lr`` are finite
    or ``lr`` is -inf (no teacher tail); ``a`` and ``lp`` may be -inf."""

    a: Tensor
    b: Tensor
    a_y: Tensor
    b_y: Tensor
    lp: Tensor
    lr: Tensor
    out: Tensor

    def finite(self) -> _Terms:
        """The same terms with -inf replaced by 0: the gradient path (where a term's value is
        -inf its true gradient is 0, and a 0 in its place keeps ``0 * inf`` out of the chain)."""

        def f(x: Tensor) -> Tensor:
            return torch.where(torch.isfinite(x), x, 0.0)

        return _Terms(f(self.a), self.b, f(self.a_y), self.b_y, f(self.lp), f(self.lr), self.out)


def _plogq(lp: Tensor, lq: Tensor, support: Tensor) -> Tensor:
    """``p log(p / q)`` from log-probs, 0 outside ``support`` (where ``p = 0``)."""
    return torch.where(support, lp.exp() * (lp - lq), 0.0)


def _generalized(t: _Terms, a_sup: Tensor, pi_dir: bool) -> Tensor:
    """``sum_S [p log(p / q) - p + q]`` per position, each term ``q (x e^x - e^x + 1)`` at
    ``x = log(p / q)`` (no cancellation near ``p = q``); ``a_sup``: where pi's entry is > 0."""
    if pi_dir:  # p = pi, q = ref; pi_v = 0 leaves q
        term = t.b.exp() * xexp_tail(torch.where(a_sup, t.a - t.b, 0.0))
        return torch.where(a_sup, term, t.b.exp()).sum(-1)
    # p = ref, q = pi; pi_v = 0 < ref_v: infinite
    term = t.a.exp() * xexp_tail(torch.where(a_sup, t.b - t.a, 0.0))
    return torch.where(a_sup, term, torch.inf).sum(-1)


def _values(
    t: _Terms, support: _Terms, estimator: str, direction: str
) -> tuple[Tensor, Tensor | None]:
    """Per-position ``(value, sampled part g)`` (g None for the deterministic estimators).

    ``support`` holds the raw terms: which probabilities are 0 is read from them (``t`` may be
    the finite copy)."""
    pi_dir = direction == "pi||ref"
    if estimator == "truncated":
        a_sup = support.a > -torch.inf
        # The normalizer over S sums the supported entries only: in the finite terms a -inf
        # entry is 0 and must not count (it did, and gave a gradient to a constant value). A row
        # with no mass on S keeps its own terms (a finite normalizer; its value is 0 or inf).
        in_sum = torch.where(a_sup.any(-1, keepdim=True) & ~a_sup, -torch.inf, t.a)
        la = torch.logsumexp(in_sum, -1, keepdim=True)
        # -inf stays -inf (raw terms) or 0 (finite terms); no mass on S at all: la = -inf.
        a = torch.where(a_sup, t.a - torch.where(torch.isfinite(la), la, 0.0), t.a)
        b = t.b - torch.logsumexp(t.b, -1, keepdim=True)
        if not pi_dir:
            return _plogq(b, a, torch.ones_like(a_sup)).sum(-1), None
        return _plogq(a, b, a_sup).sum(-1), None
    in_set = (
        _plogq(t.a, t.b, support.a > -torch.inf) if pi_dir else _plogq(t.b, t.a, t.b > -torch.inf)
    ).sum(-1)
    if estimator == "truncated-raw":
        return in_set, None
    if estimator == "generalized":
        return _generalized(t, support.a > -torch.inf, pi_dir), None
    if estimator == "unbiased":
        log_w = t.b_y - t.a_y
        g = -log_w if pi_dir else log_w.exp() * log_w
        return in_set + torch.where(t.out, g, 0.0), torch.where(t.out, g, 0.0)
    bucket = (
        _plogq(t.lp, t.lr, support.lp > -torch.inf)
        if pi_dir
        else _plogq(t.lr, t.lp, support.lr > -torch.inf)
    )
    if estimator == "tail-bucket":
        return in_set + bucket, None
    # unbiased-cv: k3 of the conditional tail ratio u; lp >= a_y and lr >= b_y where out.
    log_u = torch.where(t.out, t.b_y - t.a_y + t.lp - t.lr, 0.0)
    g = exp_tail(log_u) if pi_dir else torch.where(t.out, t.lr - t.lp, 0.0).exp() * xexp_tail(log_u)
    g = torch.where(t.out, g, 0.0)
    return in_set + bucket + g, g


def kl_from_topk(
    logits: Tensor,
    topk_indices: Tensor,
    topk_logp: Tensor,
    *,
    labels: Tensor | None = None,
    logp_ref_label: Tensor | None = None,
    estimator: TopKEstimator = "unbiased",
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    temperature: float = 1.0,
    ignore_index: int = -100,
    memory_budget: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[TopKDetails]:
    r"""KL between the student's ``softmax(logits / T)`` and a teacher known by its top-k.

    .. math::
        KL(\pi\|ref) = \sum_{v\in S}\pi_v\log\frac{\pi_v}{ref_v}
            + E_{y\sim\pi}\Big[1[y\notin S]\log\frac{\pi_y}{ref_y}\Big]

    per position, with :math:`S` the teacher's top-k tokens; the ``"unbiased"`` estimate
    replaces the expectation by the sampled token :math:`y` (or, for :math:`KL(ref\|\pi)`,
    :math:`\sum_{v\in S} ref_v\log\frac{ref_v}{\pi_v} + 1[y\notin S]\frac{ref_y}{\pi_y}
    \log\frac{ref_y}{\pi_y}`). The other estimators (``"unbiased-cv"``, lower variance, also
    unbiased; ``"tail-bucket"``, a lower bound; ``"truncated"`` and ``"truncated-raw"``, what
    peers compute; ``"generalized"``, the unnormalized KL of the measures restricted to
    :math:`S`, :math:`\sum_{v\in S}[\pi_v\log(\pi_v/ref_v) - \pi_v + ref_v]`, a lower
    bound) are defined in :mod:`klest.logits.topk`.

    Samples: ``labels`` must be drawn from the student :math:`\pi = softmax(logits / T)` itself
    (on-policy), one per position, for both directions: :math:`KL(ref\|\pi)`'s tail is
    importance-weighted by :math:`ref_y/\pi_y`. The sampled estimators are unbiased over that
    draw; given the positions (the prefixes) the teacher's top-k set is fixed.

    Gradient (to ``logits``): for ``"unbiased"`` and ``"unbiased-cv"``, an unbiased estimate of
    the gradient of the full-vocabulary per-position KL in the chosen direction (the sampled
    tail gets its score-function term :math:`g\,\nabla\log\pi_y`); for the others, the gradient
    of their own (biased) value. Like :func:`klest.kl_from_logits`, positions are held fixed:
    each token's effect on later positions is not included. Positions with an infinite value
    pass no gradient.

    Temperature divides the student's logits only: the teacher's log-probs are used as stored.

    Memory: the student's log-normalizer (over V, and over V minus S) is computed in chunks of
    rows (``memory_budget`` bytes of float32 workspace) and recomputed in the backward; nothing
    ``[N, V]`` is saved but the logits themselves.

    See A. Amini, T. Vieira, R. Cotterell, "Better Estimation of the Kullback-Leibler Divergence
    Between Language Models" (NeurIPS 2025, https://arxiv.org/abs/2504.10637), and J. Schulman,
    "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html) for the k3 term.

    Args:
      logits: the student's logits ``[..., V]`` (any float dtype), with the graph.
      topk_indices: integer ``[..., k]``, the teacher's top-k token ids per position, distinct,
        in ``[0, V)``; ``1 <= k <= V``.
      topk_logp: ``[..., k]`` the teacher's log-probs of those tokens over the whole vocabulary
        (not renormalized over the k); finite, ``<= 0``, summing (as probabilities) to at most 1.
      labels: integer ``[...]``, the token sampled from pi at each position (required by the
        sampled estimators; ``ignore_index`` leaves a position out).
      logp_ref_label: ``[...]`` the teacher's log-prob of that token (required by the sampled
        estimators); not read where the label is ``ignore_index`` or ``mask`` is False (any
        value there, e.g. ``teacher_logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]``).
      estimator: ``"unbiased"`` (default), ``"unbiased-cv"``, ``"tail-bucket"``,
        ``"truncated"``, ``"truncated-raw"`` or ``"generalized"``.
      direction: ``"pi||ref"`` (on-policy distillation) or ``"ref||pi"``.
      mask: bool ``[...]``, True where a position counts; others are not read for validity.
      reduction: klest's rule over the per-position values (:mod:`klest.aggregation`).
      temperature: :math:`T > 0` dividing the student's logits.
      ignore_index: the label of positions to leave out.
      memory_budget: bytes of float32 workspace per chunk of rows.
      cu_seqlens, max_seqlen, counts: packed sequences and global counts, as in
        :func:`klest.kl_from_logits`.
      validate: run the value checks (None: the global default): index range and uniqueness,
        log-probs finite and ``<= 0``, teacher top-k mass ``<= 1`` (up to rounding), the
        sampled token possible under pi, student rows with a distribution.
      return_details: also return a :class:`TopKDetails`.

    Returns:
      The reduced value in float32 (float64 for float64 logits); with ``return_details``,
      ``(value, details)``. ``+inf`` where the divergence is infinite (``ref||pi``: teacher
      mass where the student has none).

    Raises:
      ValueError: shapes that do not match, ``k > V``, bad values (see ``validate``), a
        sampled estimator without ``labels`` / ``logp_ref_label``, unknown names.
      TypeError: non-float logits or log-probs, non-integer indices or labels.

    Example:
      >>> g = torch.Generator().manual_seed(0)
      >>> z = torch.randn(2, 3, 50, generator=g, requires_grad=True)
      >>> teacher = torch.randn(2, 3, 50, generator=g).log_softmax(-1)
      >>> logp_top, idx = teacher.topk(5, dim=-1)
      >>> y = torch.distributions.Categorical(logits=z.detach()).sample()
      >>> kl = kl_from_topk(z, idx, logp_top, labels=y,
      ...                   logp_ref_label=teacher.gather(-1, y[..., None])[..., 0])
      >>> kl.backward()
      >>> bound = kl_from_topk(z, idx, logp_top, estimator="tail-bucket")
      >>> bool(bound <= klest.kl_from_logits(z, teacher))  # a lower bound, always
      True
    """
    inp = _check_topk_inputs(
        logits,
        topk_indices,
        topk_logp,
        labels=labels,
        logp_ref_label=logp_ref_label,
        estimator=estimator,
        direction=direction,
        mask=mask,
        reduction=reduction,
        temperature=temperature,
        ignore_index=ignore_index,
        validate=validate,
        details=return_details,
    )
    raw, lr_set = _student_terms(logits, inp, memory_budget)
    check_counts(counts, reduction)
    layout = layout_of(inp.lead, logits.device, cu_seqlens, max_seqlen, inp.checks, name="logits")
    inp.checks.run()
    with torch.no_grad():
        value, _ = _values(raw, raw, estimator, direction)
    safe = raw.finite()
    surrogate, g = _values(safe, raw, estimator, direction)
    if g is not None:
        surrogate = surrogate + g.detach() * safe.a_y
    surrogate = torch.where(torch.isfinite(value), surrogate, 0.0)
    per_row = join(value, surrogate)

    lead, rows, n_all = inp.lead, inp.rows, inp.lead.numel()
    flat = torch.zeros(n_all, dtype=inp.dtype, device=logits.device).index_copy(0, rows, per_row)
    values = layout.rows(flat.reshape(lead))
    valid = None
    if inp.pos.keep is not None or cu_seqlens is not None:
        keep = torch.ones(lead, dtype=torch.bool, device=logits.device)
        valid = layout.rows(keep if inp.pos.keep is None else inp.pos.keep)
    result = reduce_rows(values, valid, reduction, layout, counts)
    if not return_details:
        return result
    with torch.no_grad():

        def spread(x: Tensor) -> Tensor:
            return torch.zeros(n_all, dtype=x.dtype, device=logits.device).index_copy(0, rows, x)

        details = TopKDetails(
            teacher_mass=spread(lr_set.exp()).reshape(lead),
            student_mass=spread(torch.logsumexp(raw.a.detach(), -1).exp()).reshape(lead),
            overlap=spread(torch.minimum(raw.a.detach().exp(), raw.b.exp()).sum(-1)).reshape(lead),
            in_set=spread(~raw.out).reshape(lead) if inp.sampled else None,
            diagnostics=diagnostics(values, valid, reduction=reduction),
        )
    return WithDetails(result, details)


@dataclass(frozen=True)
class _TopKInputs:
    """The arguments of :func:`kl_from_topk`, checked, on ``N = prod(lead)`` flat rows.

    ``checks`` holds the value checks not yet run (with the student's, they run at once: one
    host synchronisation). ``rows`` are the indices of the kept rows ``[n]`` and ``keep`` their
    flags ``[N]``; ``idx`` the teacher's top-k ids ``[N, k]`` (int64, ids out of range replaced by
    0), ``logp_top`` its log-probs ``[N, k]`` and ``log_mass`` their logsumexp ``[N]`` (in the
    work dtype, 0 on rows not kept); ``logp_ref_label`` the teacher's log-prob of the sampled
    token on the kept rows ``[n]`` (None for the estimators that do not read it).
    """

    lead: torch.Size
    v: int
    k: int
    dtype: torch.dtype
    inv_tau: float
    sampled: bool
    pos: Positions
    rows: Tensor
    keep: Tensor
    idx: Tensor
    logp_top: Tensor
    log_mass: Tensor
    logp_ref_label: Tensor | None
    checks: ValueChecks


def _check_topk_inputs(
    logits: Tensor,
    topk_indices: Tensor,
    topk_logp: Tensor,
    *,
    labels: Tensor | None,
    logp_ref_label: Tensor | None,
    estimator: str,
    direction: str,
    mask: Tensor | None,
    reduction: str,
    temperature: float,
    ignore_index: int,
    validate: bool | None,
    details: bool,
) -> _TopKInputs:
    """:func:`kl_from_topk`'s argument checks: types, shapes and names raise here; the value
    checks are queued in the returned ``checks``."""
    check_float_tensor("logits", logits, what="logits")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    check_choice("estimator", estimator, TopKEstimator)
    inv_tau = 1.0 / check_temperature(temperature)
    checks = ValueChecks(resolve_validate(validate))
    lead, v, device = logits.shape[:-1], logits.shape[-1], logits.device
    k = topk_indices.shape[-1] if isinstance(topk_indices, Tensor) and topk_indices.dim() else 0
    idx = check_int_ids(
        "topk_indices", topk_indices, (*lead, k), device, of=f"the logits' positions {tuple(lead)}"
    )
    if not 1 <= k <= v:
        raise ValueError(f"topk_indices must hold 1 <= k <= V = {v} ids per position, got k={k}")
    check_float_tensor("topk_logp", topk_logp)
    if topk_logp.shape != idx.shape or topk_logp.device != device:
        raise ValueError(
            f"topk_logp has shape {tuple(topk_logp.shape)} on {topk_logp.device} but "
            f"topk_indices has shape {tuple(idx.shape)} on {device}; they must match"
        )
    sampled = estimator in SAMPLED
    if sampled and (labels is None or logp_ref_label is None):
        raise ValueError(
            f'estimator="{estimator}" needs labels (the tokens sampled from pi) and '
            "logp_ref_label (the teacher's log-prob of each)"
        )
    pos = positions(
        lead,
        device,
        direction=direction,
        reduction=reduction,
        mask=mask,
        labels=labels,
        vocab_size=v,
        ignore_index=ignore_index,
        details=details,
        checks=checks,
    )
    n_all = lead.numel()
    rows = torch.arange(n_all, device=device) if pos.rows is None else pos.rows
    keep = torch.ones(n_all, dtype=torch.bool, device=device) if pos.keep is None else pos.keep
    keep = keep.reshape(-1)

    idx2 = idx.reshape(-1, k).to(torch.int64)
    bad_ids = ((idx2 < 0) | (idx2 >= v)) & keep[:, None]
    checks.add(
        bad_ids,
        lambda f: f"topk_indices has ids outside [0, {v}) at {first_bad(f.reshape(idx.shape))}",
    )
    idx2 = torch.where((idx2 >= 0) & (idx2 < v), idx2, 0)
    srt = idx2.sort(-1).values
    dup = (srt[:, 1:] == srt[:, :-1]).any(-1) & keep
    checks.add(
        dup,
        lambda f: (
            "topk_indices repeats a token id within a position at "
            f"{first_bad(f.reshape(lead) if lead else f)}; the top-k ids must be distinct"
        ),
    )
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    b_all = torch.where(keep[:, None], topk_logp.reshape(-1, k).to(dtype), 0.0)
    check_log_probs(
        "topk_logp",
        b_all.reshape(idx.shape),
        checks,
        allow_neg_inf=False,
        role="the teacher gives a top-k token probability 0",
        density_hint=False,
        rounding_of=topk_logp.dtype,
    )
    log_mass = torch.logsumexp(b_all, -1)
    tol = _MASS_TOL.get(topk_logp.dtype, _MASS_TOL_DEFAULT)
    checks.add(
        (log_mass > math.log1p(tol)) & keep,
        lambda f: (
            f"topk_logp: the teacher's top-k probabilities sum to more than 1 at "
            f"{first_bad(f.reshape(lead) if lead else f)} (largest sum "
            f"{float(log_mass[f].exp().max()):.6g}); pass log-probs over the whole "
            "vocabulary, not renormalized over the top k"
        ),
    )
    b_y = None
    if sampled:
        check_float_tensor("logp_ref_label", logp_ref_label)
        if logp_ref_label.shape != lead or logp_ref_label.device != device:
            raise ValueError(
                f"logp_ref_label has shape {tuple(logp_ref_label.shape)} on "
                f"{logp_ref_label.device} but the logits' positions are {tuple(lead)} on {device}"
            )
        b_y_all = torch.where(keep, logp_ref_label.reshape(-1).to(dtype), 0.0)
        check_log_probs(
            "logp_ref_label",
            b_y_all.reshape(lead),
            checks,
            allow_neg_inf=False,
            role="the teacher gives the sampled token probability 0 (KL(pi||ref) is infinite)",
            density_hint=False,
            rounding_of=logp_ref_label.dtype,
        )
        b_y = b_y_all[rows]
    return _TopKInputs(
        lead=lead,
        v=v,
        k=k,
        dtype=dtype,
        inv_tau=inv_tau,
        sampled=sampled,
        pos=pos,
        rows=rows,
        keep=keep,
        idx=idx2,
        logp_top=b_all,
        log_mass=log_mass,
        logp_ref_label=b_y,
        checks=checks,
    )


def _student_terms(
    logits: Tensor, inp: _TopKInputs, memory_budget: int | None
) -> tuple[_Terms, Tensor]:
    """The terms of :func:`_values` on the kept rows (raw: ``-inf`` kept), from the student's
    log-probs (read in chunks of rows, ``memory_budget`` bytes) and the checked teacher's, and
    the teacher's top-k log mass clamped at 0 ``[n]``. The checks of the student's values are
    queued in ``inp.checks``."""
    v, k, device, rows, keep = inp.v, inp.k, logits.device, inp.rows, inp.keep
    checks, sampled, b_y = inp.checks, inp.sampled, inp.logp_ref_label
    z2 = logits.reshape(-1, v)
    s_idx = inp.idx[rows]
    chunk = chunk_rows(_BUFFERS_PER_ROW * 4 * v, device, memory_budget, None)
    ids = s_idx
    if sampled:
        y = torch.where(keep, inp.pos.labels, 0).clamp(0, v - 1)[rows]
        ids = torch.cat([s_idx, y[:, None]], -1)
    picked, log_tail, lse = _StudentLogProbs.apply(z2, rows, ids, k, inp.inv_tau, chunk)
    a = picked[:, :k]
    checks.add(
        ~torch.isfinite(lse),
        lambda f: (
            f"logits has {int(f.sum())} counted position(s) with NaN or +inf entries, or with "
            "every entry -inf (no distribution); mask them out"
        ),
    )
    b = inp.logp_top[rows]
    lr_set = inp.log_mass[rows].clamp(max=0.0)
    if sampled:
        a_y = picked[:, k]
        checks.add(
            ~(a_y > -torch.inf),
            lambda f: (
                f"labels: {int(f.sum())} sampled token(s) have probability 0 under "
                "softmax(logits / temperature): they were not sampled from pi"
            ),
        )
        out = (s_idx != y[:, None]).all(-1)
        # The teacher's tail holds at least the sampled tail token (rounding of R can say less).
        tail_r = torch.maximum(-torch.expm1(lr_set), torch.where(out, b_y.exp(), 0.0))
    else:
        a_y = b_y = torch.zeros_like(log_tail)
        out = torch.zeros_like(log_tail, dtype=torch.bool)
        tail_r = -torch.expm1(lr_set)
    if v == k:
        tail_r = torch.zeros_like(tail_r)  # no tail at all: R's rounding is not mass
    return _Terms(a, b, a_y, b_y, log_tail, tail_r.log(), out), lr_set
