r"""Divergences between the training policy and the rollout policy, from the rollout's tokens.

The trust region of 2026's agentic RL recipes sits at the sampler, not at a reference model:
they bound the divergence between the policy being trained, :math:`\pi`, and the policy that
sampled the tokens, the inference engine's :math:`\mu` (*rollout*). The tokens are
:math:`y_t \sim \mu(\cdot|s_t)`; a trainer has, per token, :math:`\log\pi(y_t)` (with the
model's graph), :math:`\log\mu(y_t)` from the engine and, from some engines, the engine's top-k
log-probs. Write :math:`p = \pi(y_t|s_t)`, :math:`q = \mu(y_t|s_t)`, :math:`r = p/q`.

==========================  =============================================================  ======
function                    per token                                                       source
==========================  =============================================================  ======
:func:`binary_tv`           :math:`|p - q|`: TV between Bernoulli(p) and Bernoulli(q)        DPPO
:func:`binary_kl`           :math:`q\log\frac{q}{p} + (1-q)\log\frac{1-q}{1-p}`              DPPO
                            (``"rollout||pi"``; ``"pi||rollout"`` swaps p and q)
:func:`topk_tv`             TV over {the rollout's top-k, the sampled token, the rest}      DPPO
:func:`topk_kl`             KL over the same partition                                      DPPO
:func:`squared_log_ratio`   :math:`\tau(\log p - \log q)^2`                                  Kimi
:func:`squared_prob_shift`  :math:`(p - q)^2/q = q(r - 1)^2`                                  DRPO
==========================  =============================================================  ======

and the token masks built from them (True: the token counts): :func:`dppo_mask`,
:func:`icepop_mask`, :func:`log_ratio_mask` and :func:`kpop_mask`.

What the values estimate. Each is a function of the sampled token; its mean over
:math:`y\sim\mu` is :math:`E_\mu[D(y)]`. The binary and top-k divergences are divergences
between coarse-grained versions of the two next-token distributions (merging outcomes into
buckets), so for *every* sampled token they are at most the full-vocabulary divergence
:math:`D(\mu(\cdot|s)\,\|\,\pi(\cdot|s))` (the data-processing inequality; DPPO calls them lower
bounds): their mean is biased low, by how much the audit measures
(:func:`klest.audit.trust_region_audit_section`). The top-k partition refines the binary one, so
top-k >= binary, token by token. Unbiased estimates from the same two log-probs are older:
:math:`\tfrac12|r - 1|` for the TV (:math:`TV = \tfrac12 E_\mu|r - 1|`, the identity DPPO
starts from) and klest's k3 with the rollout as the sampler, ``klest.k3(logp_rollout, logp)``
(:math:`r - 1 - \log r`), for :math:`KL(\mu\|\pi)`. :math:`\tau(\log r)^2` is not a divergence
estimate but matches :math:`2\tau KL` to second order in :math:`\log r`; :math:`E_\mu[q(r-1)^2] =
\sum_v(\pi_v - \mu_v)^2`, the squared Euclidean distance, exactly.

What the gradients descend. Every value here is differentiated by autodiff through
:math:`\log\pi` only. The tokens come from :math:`\mu`, which does not depend on
:math:`\pi`'s parameters, so no score term is missing: the mean gradient is *exactly* the
gradient of the value's own mean :math:`\nabla_\theta E_\mu[D(y)]`. That is the gradient of the
full divergence only for the unbiased estimates; for the binary and top-k divergences it is the
gradient of their mean (e.g. :math:`\sum_y\mu_y\,\mathrm{sign}(\pi_y - \mu_y)\nabla\pi_y` for the
binary TV, against :math:`\tfrac12\sum_y\mathrm{sign}(\pi_y - \mu_y)\nabla\pi_y` for the TV),
another function with the same minimiser :math:`\pi = \mu`.

Sequences. Token values summed over a sequence (``reduction="seq-mean-token-sum"``, the
default) sum the per-position divergences along prefixes drawn from the rollout. For
:math:`KL(\mu\|\pi)` the sum of the full per-position KLs is the sequence-level
:math:`KL(\mu\|\pi)` (the chain rule), which the binary and top-k sums bound from below; for
:math:`KL(\pi\|\mu)` and the TV the sum is :math:`\sum_t E_{y_{<t}\sim\mu}D_t`, not a
sequence-level divergence.

References:
  "Rethinking the Trust Region in LLM Reinforcement Learning" by P. Qi, X. Zhou, Z. Liu, T. Pang,
  C. Du, M. Lin, W. S. Lee (arXiv:2602.04879, DPPO): binary and top-k TV / KL, Eqs. binary_tv,
  binary_kl, topk_tv, topk_kl, and the mask of Eq. dppo_obj; its code is sail-sg/Stable-RL.
  "Rethinking the Divergence Regularization in LLM RL" by J. Yao, X. Zhou, P. Qi et al.
  (arXiv:2606.09821, DRPO). "Kimi K2.5: Visual Agentic Intelligence" (Kimi Team,
  arXiv:2602.02276): the squared log-ratio, as prime-rl implements it. "Every Step Evolves:
  Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (Ling Team,
  arXiv:2510.18855): IcePop. KPop: J. Guo, Y. Sun et al., "Taming Training-Inference Mismatch in
  Reinforcement Learning with Adaptive Masking Regions" (Ant Group, 2026,
  https://ringtech.notion.site/kpop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_choice,
    check_float_tensor,
    check_int_ids,
    check_log_probs,
    check_mask,
    check_same_shape,
    compute_dtype,
    first_bad,
    resolve_validate,
)
from klest._numerics import exp_tail
from klest._types import DEFAULT_REDUCTION, Reduction, SamplerDirection, SamplerDivergence
from klest.aggregation import (
    GlobalCounts,
    KLDiagnostics,
    WithDetails,
    check_counts,
    diagnostics,
    reduce_rows,
)
from klest.layout import Layout, PackedLayout, layout_of
from klest.sampled.log_ratios import check_not_gathered

__all__ = [
    "TrustRegionDetails",
    "binary_kl",
    "binary_tv",
    "dppo_mask",
    "icepop_mask",
    "kpop_mask",
    "log_ratio_mask",
    "squared_log_ratio",
    "squared_prob_shift",
    "topk_kl",
    "topk_tv",
]

_E_MINUS_1 = math.e - 1.0
_INV_E_MINUS_1 = math.exp(-1.0) - 1.0
# How far above 1 a top-k mass may be from rounding alone (as in klest.kl_from_topk).
_MASS_TOL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-7}
_MASS_TOL_DEFAULT = 1e-4


class TrustRegionDetails(NamedTuple):
    """What the divergences of :mod:`klest.sampled.trust_region` report besides the value
    (``return_details=True``).

    Attributes:
      diagnostics: mean, standard error and counts of the per-token values
        (:class:`~klest.KLDiagnostics`).
      rollout_mass: top-k only: the rollout's probability of the tokens kept apart (the top-k
        and the sampled token), per position, 0 where masked; None for the others.
      pi_mass: top-k only: pi's probability of the same tokens.
    """

    diagnostics: KLDiagnostics
    rollout_mass: Tensor | None = None
    pi_mass: Tensor | None = None


# -- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pair:
    """Validated log-probs in the caller's shape and the compute dtype, 0 where masked:
    ``lp`` (pi, with graph) and ``lq`` (the rollout); ``keep`` None when every token counts."""

    lp: Tensor
    lq: Tensor
    keep: Tensor | None
    layout: Layout

    def zero_masked(self, values: Tensor) -> Tensor:
        return values if self.keep is None else torch.where(self.keep, values, 0.0)

    def finish(
        self,
        values: Tensor,
        reduction: str,
        counts: GlobalCounts | None,
        checks: ValueChecks,
        return_details: bool,
        masses: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | WithDetails[TrustRegionDetails]:
        """Run the queued checks, then reduce per-token ``values`` by klest's rule."""
        checks.run()
        values = self.zero_masked(values)
        valid = None
        if self.keep is not None or isinstance(self.layout, PackedLayout):
            keep = torch.ones_like(values, dtype=torch.bool) if self.keep is None else self.keep
            valid = self.layout.rows(keep)
        rows = self.layout.rows(values)
        out = reduce_rows(rows, valid, reduction, self.layout, counts)
        if not return_details:
            return out
        detail = TrustRegionDetails(diagnostics(rows, valid, reduction=reduction))
        if masses is not None:
            detail = detail._replace(
                rollout_mass=self.zero_masked(masses[0].detach()),
                pi_mass=self.zero_masked(masses[1].detach()),
            )
        return WithDetails(out, detail)


def _prepare(
    logp: Tensor,
    logp_rollout: Tensor,
    *,
    mask: Tensor | None,
    checks: ValueChecks,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> _Pair:
    """Check the two per-token log-probs and the mask (value checks queued on ``checks``)."""
    check_float_tensor("logp", logp)
    check_float_tensor("logp_rollout", logp_rollout)
    check_same_shape(logp=logp, logp_rollout=logp_rollout)
    check_not_gathered("logp", logp)
    layout = layout_of(logp.shape, logp.device, cu_seqlens, max_seqlen, checks, name="logp")
    keep = None
    if mask is not None:
        keep = check_mask(mask, logp.shape, logp.device, checks, of="the log-probs")
    dtype = compute_dtype(logp, logp_rollout)

    def clean(x: Tensor) -> Tensor:
        x = x.to(dtype)
        return x if keep is None else torch.where(keep, x, 0.0)

    lp, lq = clean(logp), clean(logp_rollout)
    check_log_probs(
        "logp", lp, checks, allow_neg_inf=True, density_hint=False, rounding_of=logp.dtype
    )
    check_log_probs(
        "logp_rollout",
        lq,
        checks,
        allow_neg_inf=False,
        role="the rollout policy sampled that token, so it cannot give it probability 0",
        density_hint=False,
        rounding_of=logp_rollout.dtype,
    )
    return _Pair(lp, lq, keep, layout)


def _start(
    logp: Tensor,
    logp_rollout: Tensor,
    mask: Tensor | None,
    validate: bool | None,
    reduction: str | None = None,
    counts: GlobalCounts | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[_Pair, ValueChecks]:
    """What every public function starts with: the reduction's name, the inputs, the counts
    (with a ``reduction``), the value checks queued."""
    if reduction is not None:
        check_choice("reduction", reduction, Reduction)
    checks = ValueChecks(resolve_validate(validate))
    pair = _prepare(
        logp, logp_rollout, mask=mask, checks=checks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
    )
    if reduction is not None:
        check_counts(counts, reduction)
    return pair, checks


@dataclass(frozen=True)
class _Members:
    """The tokens a top-k divergence keeps apart, per position, as ``[..., m]`` log-probs of the
    rollout (``lq``) and of pi (``lp``); entries that are not members (the sampled token's
    column where it is among the top-k already, masked positions) are -inf in both."""

    lq: Tensor
    lp: Tensor


def _topk_members(
    pair: _Pair,
    topk_logp_rollout: Tensor,
    *,
    topk_logp: Tensor | None,
    logits: Tensor | None,
    topk_ids: Tensor | None,
    labels: Tensor | None,
    checks: ValueChecks,
) -> _Members:
    """The rollout's top-k (and, given ``labels``, the sampled token), checked."""
    shape = pair.lp.shape
    check_float_tensor("topk_logp_rollout", topk_logp_rollout)
    if topk_logp_rollout.ndim != len(shape) + 1 or topk_logp_rollout.shape[:-1] != shape:
        raise ValueError(
            f"topk_logp_rollout has shape {tuple(topk_logp_rollout.shape)}; expected logp's shape "
            f"{tuple(shape)} plus a last dimension of k (the rollout's top-k log-probs)"
        )
    k = topk_logp_rollout.shape[-1]
    if (topk_logp is None) == (logits is None):
        raise ValueError(
            "pass pi's log-probs at the top-k tokens as topk_logp, or pi's logits (with "
            "topk_ids) to gather them from; exactly one of the two"
        )
    ids = None
    if topk_ids is not None:
        ids = check_int_ids(
            "topk_ids", topk_ids, topk_logp_rollout.shape, pair.lp.device, of="topk_logp_rollout"
        )
    elif logits is not None or labels is not None:
        raise ValueError(
            "topk_ids (the rollout's top-k token ids, shape of topk_logp_rollout) is needed "
            "with logits (to gather pi's log-probs) and with labels (to tell whether the sampled "
            "token is among the top-k)"
        )
    keep = pair.keep
    dtype = pair.lp.dtype
    if logits is not None:
        assert ids is not None
        check_float_tensor("logits", logits, what="logits")
        if logits.shape[:-1] != shape:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)}; expected logp's shape {tuple(shape)} "
                "plus a vocabulary dimension"
            )
        vocab = logits.shape[-1]
        out_of_range = (ids < 0) | (ids >= vocab)
        checks.add(
            out_of_range if keep is None else out_of_range & keep.unsqueeze(-1),
            lambda flags: f"topk_ids must be token ids in [0, {vocab}); {first_bad(flags)}",
        )
        lsm = torch.log_softmax(logits.to(torch.promote_types(dtype, logits.dtype)), -1)
        pi_top = lsm.gather(-1, ids.clamp(0, max(vocab - 1, 0))).to(dtype)
    else:
        assert topk_logp is not None
        check_float_tensor("topk_logp", topk_logp)
        check_same_shape(topk_logp_rollout=topk_logp_rollout, topk_logp=topk_logp)
        pi_top = topk_logp.to(dtype)
    if ids is not None and k > 1:
        srt = ids.sort(-1).values
        dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
        checks.add(
            dup if keep is None else dup & keep,
            lambda flags: f"topk_ids holds a token twice at {first_bad(flags)}",
        )
    roll_top = topk_logp_rollout.to(dtype)
    if keep is not None:
        roll_top = torch.where(keep.unsqueeze(-1), roll_top, -math.inf)
        pi_top = torch.where(keep.unsqueeze(-1), pi_top, -math.inf)
    for name, x, src in (
        ("topk_logp_rollout", roll_top, topk_logp_rollout),
        ("topk_logp", pi_top, topk_logp),
    ):
        if src is not None:
            check_log_probs(
                name,
                x,
                checks,
                allow_neg_inf=True,
                density_hint=False,
                rounding_of=src.dtype,
            )
    lq_cols, lp_cols = [roll_top], [pi_top]
    if labels is not None:
        assert ids is not None
        labels = check_int_ids("labels", labels, shape, pair.lp.device, of="logp")
        extra = ~(ids == labels.unsqueeze(-1)).any(-1)
        if keep is not None:
            extra = extra & keep
        lq_cols.append(torch.where(extra, pair.lq, -math.inf).unsqueeze(-1))
        lp_cols.append(torch.where(extra, pair.lp, -math.inf).unsqueeze(-1))
    members = _Members(torch.cat(lq_cols, -1), torch.cat(lp_cols, -1))
    for name, lx, src in (
        ("topk_logp_rollout", members.lq, topk_logp_rollout),
        ("topk_logp", members.lp, topk_logp),
    ):
        if src is None:
            continue
        tol = _MASS_TOL.get(src.dtype, _MASS_TOL_DEFAULT)
        over = _log_mass(lx) > math.log1p(tol)
        checks.add(
            over,
            lambda flags, name=name: (
                f"{name} (with the sampled token) sums to more than 1 at {first_bad(flags)}: "
                "pass log-probs over the whole vocabulary, of distinct tokens"
            ),
        )
    return members


# -- partition divergences ----------------------------------------------------------------------


def _log_mass(lx: Tensor) -> Tensor:
    """``log sum exp`` over the last dimension, -inf for rows that are all -inf (and then no
    NaN in the gradient)."""
    some = (lx > -math.inf).any(-1, keepdim=True)
    lse = torch.logsumexp(torch.where(some, lx, 0.0), -1)
    return torch.where(some.squeeze(-1), lse, -math.inf)


def _rest(lx: Tensor) -> tuple[Tensor, Tensor]:
    """The mass outside the members ``lx [..., m]`` and its log: ``-expm1(log mass)`` (exact near
    both ends for one member). With several members the mass is a sum that rounds by up to
    ``m`` ulps, so a rest below ``2 m`` ulps is rounding noise and counts as 0 (else a rest of
    1e-17 against one of 0 would read as an infinite KL)."""
    lm = _log_mass(lx)
    m = lx.shape[-1]
    floor = 0.0 if m == 1 else 2 * m * torch.finfo(lx.dtype).eps
    inside = lm < math.log1p(-floor)
    lm_safe = torch.where(inside, lm, -1.0)
    rest = torch.where(inside, -torch.expm1(lm_safe), 0.0)
    log_rest = torch.where(
        inside,
        torch.where(
            lm_safe > -math.log(2.0),
            torch.log(-torch.expm1(lm_safe)),
            torch.log1p(-torch.exp(lm_safe)),
        ),
        -math.inf,
    )
    return rest, log_rest


def _diff(la: Tensor, lb: Tensor) -> Tensor:
    """``b - a`` from log-probs: ``a expm1(lb - la)`` where the two are within a factor e (no
    cancellation), the plain difference elsewhere."""
    a_pos = la > -math.inf
    u = torch.where(a_pos, lb - la, math.inf)
    near = u.abs() < 1
    d_near = torch.where(near, la, 0.0).exp() * torch.expm1(torch.where(near, u, 0.0))
    return torch.where(near, d_near, lb.exp() - la.exp())


def _kl_term(la: Tensor, lb: Tensor, u: Tensor) -> Tensor:
    r"""Per outcome :math:`a\log(a/b) - a + b \ge 0`, which sums over a partition to
    :math:`KL(a\|b)`; ``u`` is an accurate :math:`\log(b/a)` where :math:`|u| < 1` (elsewhere the
    direct formula is used, which has no cancellation there); :math:`b` where :math:`a = 0`."""
    a_pos = la > -math.inf
    u = torch.where(a_pos, u, math.inf)
    near = u.abs() < 1
    far = a_pos & ~near
    t_near = torch.where(near, la, 0.0).exp() * exp_tail(torch.where(near, u, 0.0))
    laf, lbf = torch.where(far, la, 0.0), torch.where(far, lb, 0.0)
    af = laf.exp()
    t_far = lbf.exp() - af - af * (lbf - laf)
    t_zero = torch.where(a_pos, -math.inf, lb).exp()
    return torch.where(near, t_near, torch.where(far, t_far, t_zero))


def _partition_tv(d: Tensor) -> Tensor:
    r""":math:`\tfrac12(\sum_{v\in S}|b_v - a_v| + |\bar b - \bar a|)` from the members'
    differences ``d [..., m]``: the rest's difference is :math:`-\sum_S d_v`."""
    return 0.5 * (d.abs().sum(-1) + d.sum(-1).abs())


def _partition_kl(la: Tensor, lb: Tensor, d: Tensor) -> Tensor:
    r""":math:`KL(a\|b)` over the members ``[..., m]`` and one bucket for the rest, each term
    non-negative and computed without cancellation."""
    terms = _kl_term(la, lb, lb - la).sum(-1)
    a_rest, la_rest = _rest(la)
    _, lb_rest = _rest(lb)
    # log(b_rest / a_rest) = log1p(s), s = (b_rest - a_rest) / a_rest = -sum(d) / a_rest: exact
    # where the two rest masses are close (the rest masses themselves cancel there).
    minus_d = -d.sum(-1)
    near = (a_rest > 0) & (minus_d > _INV_E_MINUS_1 * a_rest) & (minus_d < _E_MINUS_1 * a_rest)
    s = torch.where(near, minus_d, 0.0) / torch.where(near, a_rest, 1.0)
    u = torch.where(near, torch.log1p(s), math.inf)
    return terms + _kl_term(la_rest, lb_rest, u)


def _ordered(lq: Tensor, lp: Tensor, direction: str) -> tuple[Tensor, Tensor]:
    """``(la, lb)`` of KL(a||b) for ``direction``."""
    return (lq, lp) if direction == "rollout||pi" else (lp, lq)


def _binary_kl_values(pair: _Pair, direction: str) -> Tensor:
    la, lb = _ordered(pair.lq.unsqueeze(-1), pair.lp.unsqueeze(-1), direction)
    return _partition_kl(la, lb, _diff(la, lb))


def _binary_tv_values(pair: _Pair) -> Tensor:
    return _diff(pair.lq, pair.lp).abs()


def _topk_values(members: _Members, divergence: str, direction: str) -> Tensor:
    la, lb = _ordered(members.lq, members.lp, direction)
    d = _diff(la, lb)
    return _partition_tv(d) if divergence == "tv" else _partition_kl(la, lb, d)


# -- public: values -----------------------------------------------------------------------------


def binary_tv(
    logp: Tensor,
    logp_rollout: Tensor,
    *,
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[TrustRegionDetails]:
    r"""DPPO's binary total variation between pi and the rollout policy at each sampled token.

    .. math::
        D^{Bin}_{TV}(t) = |\pi(y_t|s_t) - \mu(y_t|s_t)|
            = TV\big(\mathrm{Bern}(\pi(y_t)),\ \mathrm{Bern}(\mu(y_t))\big)

    the TV between the two distributions collapsed to {the sampled token, everything else}
    (DPPO, Eq. binary_tv; symmetric, so it has no direction). Computed as
    :math:`\mu(y_t)\,|e^{\log\pi - \log\mu} - 1|`, exact near :math:`\pi = \mu`.

    Samples: :math:`y_t \sim \mu` (the rollout). For every token the value is at most the
    full-vocabulary :math:`TV(\mu(\cdot|s_t), \pi(\cdot|s_t))`, so its mean is biased low; the
    unbiased single-token estimate is :math:`\tfrac12|\pi(y_t)/\mu(y_t) - 1|`. Gradient (autodiff
    through ``logp``): unbiased for :math:`\nabla E_{y\sim\mu}|\pi(y) - \mu(y)|`, the gradient of
    its own mean, not of the TV (:mod:`klest.sampled.trust_region`).

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``), with graph; any float
        dtype (computed in float32 or wider).
      logp_rollout: the rollout policy's (inference engine's) log-probs of the same tokens, same
        shape, detached.
      mask: bool or 0/1, same shape; False positions are ignored.
      reduction: klest's rule (:mod:`klest.aggregation`): ``"seq-mean-token-sum"`` (default),
        ``"token-mean"``, ``"seq-mean-token-mean"``, ``"sum"``, ``"per-sequence"``, ``"none"``.
      cu_seqlens: packed sequences (:mod:`klest.layout`); ``max_seqlen`` with it.
      counts: global counts of a batch computed in pieces (:class:`~klest.GlobalCounts`).
      validate: run the value checks (None: the global default).
      return_details: also return a :class:`TrustRegionDetails`.

    Returns:
      The reduced value (a scalar, ``[...]`` per sequence, ``[..., T]`` for ``"none"``); with
      ``return_details``, ``(value, details)``.

    Raises:
      ValueError: mismatched shapes, NaN or ``+inf`` log-probs, log-probs above 0, a rollout
        log-prob of ``-inf`` (the rollout sampled the token).
      TypeError: non-tensor or non-float inputs.

    See "Rethinking the Trust Region in LLM Reinforcement Learning" (Qi et al.,
    arXiv:2602.04879).

    Example:
      >>> logp, logp_rollout = torch.tensor([[-0.1, -2.0]]), torch.tensor([[-0.3, -2.5]])
      >>> binary_tv(logp, logp_rollout, reduction="none")  # |e^-0.1 - e^-0.3|, |e^-2 - e^-2.5|
      tensor([[0.1640, 0.0533]])
    """
    pair, checks = _start(
        logp, logp_rollout, mask, validate, reduction, counts, cu_seqlens, max_seqlen
    )
    return pair.finish(_binary_tv_values(pair), reduction, counts, checks, return_details)


def binary_kl(
    logp: Tensor,
    logp_rollout: Tensor,
    *,
    direction: SamplerDirection = "rollout||pi",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[TrustRegionDetails]:
    r"""DPPO's binary KL between the rollout policy and pi at each sampled token.

    .. math::
        D^{Bin}_{KL}(t) = q\log\frac{q}{p} + (1 - q)\log\frac{1 - q}{1 - p},
        \qquad q = \mu(y_t|s_t),\ p = \pi(y_t|s_t)

    :math:`KL(\mathrm{Bern}(q)\,\|\,\mathrm{Bern}(p))`, the KL between the two distributions
    collapsed to {the sampled token, everything else}, rollout first: DPPO's Eq. binary_kl and its
    code (sail-sg/Stable-RL ``dppo_binary_kl``) are ``direction="rollout||pi"``, the default;
    ``"pi||rollout"`` swaps p and q. Computed as :math:`q\,\phi(\log\frac pq) + (1-q)\,
    \phi(\log\frac{1-p}{1-q})` with :math:`\phi(u) = e^u - 1 - u`: both terms non-negative,
    exact near :math:`p = q` (no ``+1e-8`` as in that code).

    Samples: :math:`y_t\sim\mu`. For every token the value is at most the full-vocabulary
    :math:`KL(\mu(\cdot|s_t)\|\pi(\cdot|s_t))` (of that direction), so its mean is biased low;
    the unbiased estimate of :math:`KL(\mu\|\pi)` from the same log-probs is
    ``klest.k3(logp_rollout, logp)``. Gradient (autodiff through ``logp``): unbiased for the
    gradient of its own mean :math:`E_{y\sim\mu}[D^{Bin}_{KL}]`, not of the KL
    (:mod:`klest.sampled.trust_region`).

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``), with graph.
      logp_rollout: the rollout policy's log-probs of the same tokens, same shape, detached.
      direction: ``"rollout||pi"`` (DPPO's, default) or ``"pi||rollout"``.
      mask, reduction, cu_seqlens, max_seqlen, counts, validate, return_details: as in
        :func:`binary_tv`.

    Returns:
      The reduced value; with ``return_details``, ``(value, details)``.

    Raises:
      ValueError: as :func:`binary_tv`, and an unknown ``direction``.
      TypeError: non-tensor or non-float inputs.

    See "Rethinking the Trust Region in LLM Reinforcement Learning" (Qi et al.,
    arXiv:2602.04879).

    Example:
      >>> p, q = torch.tensor([0.5]), torch.tensor([0.4])
      >>> by_hand = q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p)).log()
      >>> torch.allclose(binary_kl(p.log(), q.log(), reduction="none"), by_hand)
      True
    """
    check_choice("direction", direction, SamplerDirection)
    pair, checks = _start(
        logp, logp_rollout, mask, validate, reduction, counts, cu_seqlens, max_seqlen
    )
    values = _binary_kl_values(pair, direction)
    return pair.finish(values, reduction, counts, checks, return_details)


def topk_tv(
    logp: Tensor,
    logp_rollout: Tensor,
    topk_logp_rollout: Tensor,
    *,
    topk_logp: Tensor | None = None,
    logits: Tensor | None = None,
    topk_ids: Tensor | None = None,
    labels: Tensor | None = None,
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[TrustRegionDetails]:
    r"""DPPO's top-k total variation: TV over the rollout's top-k, the sampled token, the rest.

    .. math::
        D^{TopK}_{TV}(t) = \tfrac12\Big(\sum_{v\in S}|\pi(v|s_t) - \mu(v|s_t)|
            + \big|\pi(\bar S|s_t) - \mu(\bar S|s_t)\big|\Big)

    with :math:`S` the rollout's top-k tokens, plus the sampled token :math:`y_t` when
    ``labels`` are given and it is not among them (DPPO, Eq. topk_tv:
    :math:`\mathcal A'_t = \mathrm{TopK}(\mu, K)\cup\{y_t\}`), and :math:`\bar S` every other
    token, one bucket. Without ``labels`` :math:`S` is the ids as given: what DPPO's code
    (sail-sg/Stable-RL ``compute_topk_kl``) computes, whose rollout puts the sampled token in
    the last of the k slots when it is not among the top k. The masses of :math:`\bar S` are
    :math:`1 - \sum_S`.

    Samples: :math:`y_t\sim\mu`. The partition is coarser than the vocabulary and finer than the
    binary one, so token by token binary TV <= this <= the full TV (biased low). Gradient
    (autodiff through pi's log-probs: ``topk_logp`` or ``logits``, and ``logp`` for an added
    sampled token): unbiased for the gradient of its own mean, not of the TV.

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``), with graph.
      logp_rollout: the rollout's log-probs of the same tokens, same shape.
      topk_logp_rollout: the rollout's top-k log-probs at each position, ``logp.shape + (k,)``,
        over the whole vocabulary (not renormalized), of distinct tokens.
      topk_logp: pi's log-probs of the same k tokens, same shape, with graph; or
      logits: pi's logits, ``logp.shape + (V,)``, from which they are gathered at ``topk_ids``
        (a float32 ``log_softmax`` of them is made: for large vocabularies gather
        ``topk_logp`` in pieces, e.g. with :func:`klest.token_log_probs`).
      topk_ids: the k token ids, integer, ``topk_logp_rollout``'s shape; needed with ``logits``
        and with ``labels``.
      labels: the sampled token ids, integer, ``logp``'s shape: adds the sampled token to
        :math:`S` where it is not among ``topk_ids``.
      mask, reduction, cu_seqlens, max_seqlen, counts, validate, return_details: as in
        :func:`binary_tv`; the details carry both policies' mass on :math:`S`.

    Returns:
      The reduced value; with ``return_details``, ``(value, details)``.

    Raises:
      ValueError: mismatched shapes, neither or both of ``topk_logp`` and ``logits``, token ids
        repeated or out of range, a top-k mass above 1 beyond rounding, and the checks of
        :func:`binary_tv`.
      TypeError: non-tensor, non-float or non-integer inputs.

    See "Rethinking the Trust Region in LLM Reinforcement Learning" (Qi et al.,
    arXiv:2602.04879).

    Example:
      >>> mu = torch.tensor([[0.6, 0.3, 0.1]]).log()   # rollout, one position, V = 3
      >>> pi = torch.tensor([[0.5, 0.3, 0.2]]).log()
      >>> ids = torch.tensor([[[0]]])                  # its top-1
      >>> tv = topk_tv(pi[:, 2:], mu[:, 2:], mu[:, None, :1], logits=pi[:, None], topk_ids=ids,
      ...              labels=torch.tensor([[2]]), reduction="none")
      >>> tv  # the partition {0}, {2}, {1}: the full TV here
      tensor([[0.1000]])
    """
    return _topk_call(
        "tv",
        logp,
        logp_rollout,
        topk_logp_rollout,
        "rollout||pi",
        topk_logp=topk_logp,
        logits=logits,
        topk_ids=topk_ids,
        labels=labels,
        mask=mask,
        reduction=reduction,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        validate=validate,
        return_details=return_details,
    )


def topk_kl(
    logp: Tensor,
    logp_rollout: Tensor,
    topk_logp_rollout: Tensor,
    *,
    direction: SamplerDirection = "rollout||pi",
    topk_logp: Tensor | None = None,
    logits: Tensor | None = None,
    topk_ids: Tensor | None = None,
    labels: Tensor | None = None,
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[TrustRegionDetails]:
    r"""DPPO's top-k KL: the KL over the rollout's top-k, the sampled token and the rest.

    .. math::
        D^{TopK}_{KL}(t) = \sum_{v\in S}\mu(v|s_t)\log\frac{\mu(v|s_t)}{\pi(v|s_t)}
            + \mu(\bar S|s_t)\log\frac{\mu(\bar S|s_t)}{\pi(\bar S|s_t)}

    for ``direction="rollout||pi"`` (DPPO, Eq. topk_kl, and its code; the default), the roles
    swapped for ``"pi||rollout"``; :math:`S` and :math:`\bar S` as in :func:`topk_tv`. Each
    term is computed as :math:`a\,\phi(\log\frac ba)`, :math:`\phi(u) = e^u - 1 - u`,
    non-negative and exact near :math:`a = b`.

    Samples: :math:`y_t\sim\mu`. Token by token binary KL <= this <= the full-vocabulary KL of
    that direction (biased low). Gradient: unbiased for the gradient of its own mean, not of the
    KL. Arguments, shapes, returns and errors as in :func:`topk_tv`, plus ``direction``.

    See "Rethinking the Trust Region in LLM Reinforcement Learning" (Qi et al.,
    arXiv:2602.04879).

    Example:
      >>> mu = torch.tensor([[0.6, 0.3, 0.1]]).log()
      >>> pi = torch.tensor([[0.5, 0.3, 0.2]]).log()
      >>> kl = topk_kl(pi[:, :1], mu[:, :1], mu[:, None, :1], topk_logp=pi[:, None, :1],
      ...              reduction="none")   # S = {0}: 0.6 log(0.6/0.5) + 0.4 log(0.4/0.5)
      >>> torch.allclose(kl, torch.tensor([[0.6 * math.log(1.2) + 0.4 * math.log(0.8)]]))
      True
    """
    check_choice("direction", direction, SamplerDirection)
    return _topk_call(
        "kl",
        logp,
        logp_rollout,
        topk_logp_rollout,
        direction,
        topk_logp=topk_logp,
        logits=logits,
        topk_ids=topk_ids,
        labels=labels,
        mask=mask,
        reduction=reduction,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        validate=validate,
        return_details=return_details,
    )


def _topk_call(
    divergence: str,
    logp: Tensor,
    logp_rollout: Tensor,
    topk_logp_rollout: Tensor,
    direction: str,
    *,
    topk_logp: Tensor | None,
    logits: Tensor | None,
    topk_ids: Tensor | None,
    labels: Tensor | None,
    mask: Tensor | None,
    reduction: str,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    counts: GlobalCounts | None,
    validate: bool | None,
    return_details: bool,
) -> Tensor | WithDetails[TrustRegionDetails]:
    pair, checks = _start(
        logp, logp_rollout, mask, validate, reduction, counts, cu_seqlens, max_seqlen
    )
    members = _topk_members(
        pair,
        topk_logp_rollout,
        topk_logp=topk_logp,
        logits=logits,
        topk_ids=topk_ids,
        labels=labels,
        checks=checks,
    )
    values = _topk_values(members, divergence, direction)
    masses = None
    if return_details:
        masses = (_log_mass(members.lq).exp(), _log_mass(members.lp).exp())
    return pair.finish(values, reduction, counts, checks, return_details, masses)


def squared_log_ratio(
    logp: Tensor,
    logp_rollout: Tensor,
    *,
    tau: float = 1.0,
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[TrustRegionDetails]:
    r"""Kimi's squared log-ratio to the rollout policy, per sampled token.

    .. math:: \tau\,\big(\log\pi(y_t|s_t) - \log\mu(y_t|s_t)\big)^2

    the regulariser of Kimi K2.5's policy objective (its Eq. 1, ``- tau (log pi/pi_old)^2`` with
    :math:`\pi_{old}` the policy that sampled), as prime-rl implements it (``kl_tau *
    log_importance_ratio**2``, no factor 1/2, :math:`\tau = 10^{-3}` by default there; prime-rl
    applies it to every trainable token; restricting it to the tokens the trust-region mask keeps
    has been proposed there). Symmetric: no direction.

    Samples: :math:`y_t\sim\mu`. Not an unbiased estimate of a divergence: its mean
    :math:`\tau E_\mu[(\log r)^2]` matches :math:`2\tau\,KL(\mu\|\pi)` (and
    :math:`2\tau\,KL(\pi\|\mu)`) to second order in :math:`\log r`, so with :math:`\tau = 1/2` it
    is Schulman's k2 with the rollout as the sampler. Gradient (autodiff):
    :math:`2\tau\log r\,\nabla\log\pi(y_t)`, unbiased for :math:`\nabla\tau E_\mu[(\log r)^2]`,
    zero at :math:`\pi = \mu`, not the gradient of a KL.

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``), with graph.
      logp_rollout: the rollout's log-probs of the same tokens, same shape, detached.
      tau: the coefficient :math:`\tau \ge 0`.
      mask, reduction, cu_seqlens, max_seqlen, counts, validate, return_details: as in
        :func:`binary_tv`.

    Returns:
      The reduced value; with ``return_details``, ``(value, details)``.

    Raises:
      ValueError: a negative ``tau`` and the checks of :func:`binary_tv`.
      TypeError: non-tensor or non-float inputs.

    See "Kimi K2.5: Visual Agentic Intelligence" (Kimi Team, arXiv:2602.02276); "Approximating KL
    Divergence" by John Schulman (2020, http://joschu.net/blog/kl-approx.html) for k2.

    Example:
      >>> squared_log_ratio(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]),
      ...                   tau=0.5, reduction="none")
      tensor([0.1250, 0.5000])
    """
    tau = _non_negative("tau", tau)
    pair, checks = _start(
        logp, logp_rollout, mask, validate, reduction, counts, cu_seqlens, max_seqlen
    )
    values = tau * (pair.lp - pair.lq) ** 2
    return pair.finish(values, reduction, counts, checks, return_details)


def squared_prob_shift(
    logp: Tensor,
    logp_rollout: Tensor,
    *,
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[TrustRegionDetails]:
    r"""The quadratic regulariser of DRPO without its advantage weight: :math:`\mu(y_t)(r_t - 1)^2`.

    .. math::
        \frac{(\pi(y_t|s_t) - \mu(y_t|s_t))^2}{\mu(y_t|s_t)} = \mu(y_t)\,(r_t - 1)^2, \qquad
        E_{y\sim\mu}\Big[\frac{(\pi(y) - \mu(y))^2}{\mu(y)}\Big] = \sum_v (\pi_v - \mu_v)^2

    an unbiased estimate of the squared Euclidean distance between the two next-token
    distributions. DRPO's objective (arXiv:2606.09821) is, per token,
    :math:`r_t\hat A_t - \frac{|\hat A_t|}{2\delta}\mu(y_t)(r_t - 1)^2`, whose gradient weight on
    :math:`\nabla\log\pi` is :math:`r_t\hat A_t\,(1 - \mathrm{sign}(\hat A_t)(\pi - \mu)/\delta)`:
    the binary-TV geometry of DPPO made smooth; multiply this value by
    :math:`|\hat A_t|/(2\delta)` for that term. (The form is the one secondary summaries of the
    paper and the UniRL repository give; the two agree.)

    Samples: :math:`y_t\sim\mu`. Unbiased for :math:`\sum_v(\pi_v - \mu_v)^2` when the rollout
    gives every token pi can produce a positive probability. Gradient (autodiff):
    :math:`2\frac{\pi - \mu}{\mu}\nabla\pi(y_t)`, unbiased for the gradient of that distance.

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``), with graph.
      logp_rollout: the rollout's log-probs of the same tokens, same shape, detached.
      mask, reduction, cu_seqlens, max_seqlen, counts, validate, return_details: as in
        :func:`binary_tv`.

    Returns:
      The reduced value; with ``return_details``, ``(value, details)``.

    Raises:
      ValueError, TypeError: as :func:`binary_tv`.

    See "Rethinking the Divergence Regularization in LLM RL" (Yao, Zhou, Qi et al.,
    arXiv:2606.09821).

    Example:
      >>> squared_prob_shift(torch.tensor([0.5]).log(), torch.tensor([0.25]).log(),
      ...                    reduction="none")  # (0.5 - 0.25)^2 / 0.25
      tensor([0.2500])
    """
    pair, checks = _start(
        logp, logp_rollout, mask, validate, reduction, counts, cu_seqlens, max_seqlen
    )
    d = _diff(pair.lq, pair.lp)
    values = d * d / pair.lq.exp()
    return pair.finish(values, reduction, counts, checks, return_details)


# -- public: masks ------------------------------------------------------------------------------


def _non_negative(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
    return float(x)


def _positive(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not x > 0 or math.isnan(x):
        raise ValueError(f"{name} must be a number > 0, got {x!r}")
    return float(x)


def _keep(pair: _Pair, inside: Tensor, checks: ValueChecks) -> Tensor:
    checks.run()
    inside = inside.detach()
    return inside if pair.keep is None else inside & pair.keep


def _interval_mask(
    logp: Tensor,
    logp_rollout: Tensor,
    low: float,
    high: float,
    mask: Tensor | None,
    validate: bool | None,
    *,
    ratio: bool,
) -> Tensor:
    """True where the ratio pi / rollout (or its log) lies in ``[low, high]``."""
    if low > high:
        raise ValueError(f"low must be at most high, got low={low} > high={high}")
    pair, checks = _start(logp, logp_rollout, mask, validate)
    with torch.no_grad():
        x = pair.lp - pair.lq
        x = torch.exp(x) if ratio else x
        inside = (x >= low) & (x <= high)
    return _keep(pair, inside, checks)


def dppo_mask(
    logp: Tensor,
    logp_rollout: Tensor,
    advantages: Tensor,
    *,
    delta: float,
    delta_low: float | None = None,
    divergence: SamplerDivergence = "binary-tv",
    direction: SamplerDirection = "rollout||pi",
    topk_logp_rollout: Tensor | None = None,
    topk_logp: Tensor | None = None,
    logits: Tensor | None = None,
    topk_ids: Tensor | None = None,
    labels: Tensor | None = None,
    mask: Tensor | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""DPPO's trust-region mask: drop a token whose divergence exceeds the threshold in the
    direction its advantage pushes.

    .. math::
        M_t = 0 \iff \big(\hat A_t > 0,\ \pi(y_t) > \mu(y_t),\ D_t > \delta\big)
            \text{ or } \big(\hat A_t < 0,\ \pi(y_t) < \mu(y_t),\ D_t > \delta_{low}\big)

    (DPPO, Eq. dppo_obj, with :math:`r_t > 1 \iff \pi(y_t) > \mu(y_t)`), :math:`D_t` the
    ``divergence`` of the token's position: ``"binary-tv"`` (:func:`binary_tv`; then the rule is
    :math:`\pi - \mu > \delta` or :math:`\pi - \mu < -\delta_{low}`, as DPPO's code writes it),
    ``"binary-kl"``, ``"topk-tv"`` or ``"topk-kl"`` (:func:`binary_kl`, :func:`topk_tv`,
    :func:`topk_kl`; KL in ``direction``, DPPO's ``"rollout||pi"`` by default). A token is
    never dropped for moving pi back towards the rollout. Separate thresholds for the two
    directions are DPPO's code's (``clip_ratio_high`` / ``clip_ratio_low``). Tokens with
    :math:`\hat A_t = 0` are kept (the paper's "otherwise"; DPPO's code applies the
    negative-advantage rule to them, which changes nothing in its loss, where they weigh 0).

    The mask multiplies DPPO's per-token surrogate :math:`M_t\, r_t \hat A_t`; it is detached.

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``).
      logp_rollout: the rollout's log-probs of the same tokens, same shape.
      advantages: ``logp``'s shape, or one per sequence (``logp.shape[:-1]``).
      delta: the threshold :math:`\delta \ge 0` for positive advantages.
      delta_low: for negative advantages (default ``delta``).
      divergence: ``"binary-tv"`` (default), ``"binary-kl"``, ``"topk-tv"``, ``"topk-kl"``.
      direction: for the KLs: ``"rollout||pi"`` (default) or ``"pi||rollout"``.
      topk_logp_rollout, topk_logp, logits, topk_ids, labels: for the top-k divergences, as in
        :func:`topk_tv`.
      mask: bool or 0/1, same shape: False positions come out False.
      validate: run the value checks (None: the global default).

    Returns:
      bool ``[..., T]``: True where the token counts.

    Raises:
      ValueError: thresholds below 0, NaN advantages, and the checks of the divergence's
        function.
      TypeError: non-tensor or non-float inputs.

    See "Rethinking the Trust Region in LLM Reinforcement Learning" (Qi et al.,
    arXiv:2602.04879).

    Example:
      >>> logp = torch.tensor([0.9, 0.9, 0.5, 0.01]).log()
      >>> logp_rollout = torch.tensor([0.5, 0.5, 0.9, 1e-4]).log()
      >>> advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
      >>> dppo_mask(logp, logp_rollout, advantages, delta=0.2)  # the ratio of the last is 100
      tensor([False,  True, False,  True])
    """
    delta = _non_negative("delta", delta)
    delta_low = delta if delta_low is None else _non_negative("delta_low", delta_low)
    check_choice("divergence", divergence, SamplerDivergence)
    check_choice("direction", direction, SamplerDirection)
    pair, checks = _start(logp, logp_rollout, mask, validate)
    adv = _check_advantages(advantages, pair, checks)
    topk_args = (topk_logp_rollout, topk_logp, logits, topk_ids, labels)
    with torch.no_grad():
        if divergence.startswith("topk"):
            if topk_logp_rollout is None:
                raise ValueError(f"divergence={divergence!r} needs topk_logp_rollout")
            members = _topk_members(
                pair,
                topk_logp_rollout,
                topk_logp=topk_logp,
                logits=logits,
                topk_ids=topk_ids,
                labels=labels,
                checks=checks,
            )
            d = _topk_values(members, divergence.removeprefix("topk-"), direction)
        elif any(x is not None for x in topk_args):
            raise ValueError(
                f"topk_logp_rollout, topk_logp, logits, topk_ids and labels apply to the top-k "
                f"divergences, not {divergence!r}"
            )
        elif divergence == "binary-tv":
            d = _binary_tv_values(pair)
        else:
            d = _binary_kl_values(pair, direction)
        up, down = pair.lp > pair.lq, pair.lp < pair.lq
        dropped = ((adv > 0) & up & (d > delta)) | ((adv < 0) & down & (d > delta_low))
    return _keep(pair, ~dropped, checks)


def _check_advantages(advantages: object, pair: _Pair, checks: ValueChecks) -> Tensor:
    """Advantages per token (a per-sequence tensor broadcast over the tokens)."""
    shape = pair.lp.shape
    adv = check_float_tensor("advantages", advantages, what="advantages")
    if adv.shape == shape[:-1] and len(shape) >= 2:
        adv = adv.unsqueeze(-1).expand(shape)
    elif adv.shape != shape:
        raise ValueError(
            f"advantages has shape {tuple(adv.shape)}; expected logp's shape {tuple(shape)} or "
            f"one per sequence, {tuple(shape[:-1])}"
        )
    if adv.device != pair.lp.device:
        raise ValueError(f"advantages is on {adv.device} but logp is on {pair.lp.device}")
    adv = adv.detach()
    nan = torch.isnan(adv) if pair.keep is None else torch.isnan(adv) & pair.keep
    checks.add(nan, lambda flags: f"advantages contains NaN at {first_bad(flags)}")
    return adv


def icepop_mask(
    logp: Tensor,
    logp_rollout: Tensor,
    *,
    high: float,
    low: float | None = None,
    mask: Tensor | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""IcePop's mask: keep a token whose ratio pi / rollout lies in :math:`[\alpha, \beta]`.

    .. math::
        M_t = 1 \iff \alpha \le \frac{\pi(y_t|s_t)}{\mu(y_t|s_t)} \le \beta

    IcePop (Ring-1T, arXiv:2510.18855; INTELLECT-3's Eq. 1, arXiv:2512.16144) multiplies the
    policy-gradient term by :math:`\mathcal M(k) = k\,1[k\in[\alpha,\beta]]`, :math:`k` the
    training engine's over the inference engine's probability of the token (both at the old
    parameters in the papers: pass the trainer's recomputed log-probs as ``logp`` for that). This
    function returns the indicator. ``low`` defaults to :math:`1/\beta` (``[1/c, c]``, as
    open-instruct); AReaL's defaults are :math:`\alpha = 0.5`, :math:`\beta = 5`. No advantage
    enters: the mask is two-sided and symmetric in sign.

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``).
      logp_rollout: the rollout's log-probs of the same tokens, same shape.
      high: :math:`\beta > 0`.
      low: :math:`\alpha > 0`, at most ``high`` (default ``1 / high``).
      mask: bool or 0/1, same shape: False positions come out False.
      validate: run the value checks (None: the global default).

    Returns:
      bool ``[..., T]``: True where the token counts.

    Raises:
      ValueError: bounds not > 0 or ``low > high``, and the checks of :func:`binary_tv`.
      TypeError: non-tensor or non-float inputs.

    See "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model"
    (Ling Team, arXiv:2510.18855).

    Example:
      >>> icepop_mask(torch.tensor([0.9, 0.02, 0.5]).log(), torch.tensor([0.5, 0.2, 0.45]).log(),
      ...             high=5.0)  # ratios 1.8, 0.1, 1.11 in [0.2, 5]
      tensor([ True, False,  True])
    """
    high = _positive("high", high)
    low = 1.0 / high if low is None else _positive("low", low)
    return _interval_mask(logp, logp_rollout, low, high, mask, validate, ratio=True)


def log_ratio_mask(
    logp: Tensor,
    logp_rollout: Tensor,
    *,
    low: float,
    high: float,
    mask: Tensor | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""Kimi's token mask: keep a token whose log-ratio to the rollout lies in an interval.

    .. math:: M_t = 1 \iff \alpha \le \log\pi(y_t|s_t) - \log\mu(y_t|s_t) \le \beta

    Kimi K2.5's objective (arXiv:2602.02276, Eq. 1) writes a token-level
    :math:`\mathrm{Clip}(\pi_\theta/\pi_{old}, \alpha, \beta)` and describes it as gradient
    masking: tokens whose *log*-ratio falls outside :math:`[\alpha, \beta]` get no gradient. The
    equation's argument (the ratio) and the text (the log-ratio) disagree; this function follows
    the text, so ``log_ratio_mask(low=log(a), high=log(b))`` is ``icepop_mask(low=a, high=b)``
    (up to rounding at the bounds). The report gives no values for the bounds.

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``).
      logp_rollout: the rollout's log-probs of the same tokens, same shape.
      low: :math:`\alpha`.
      high: :math:`\beta \ge \alpha`.
      mask: bool or 0/1, same shape: False positions come out False.
      validate: run the value checks (None: the global default).

    Returns:
      bool ``[..., T]``: True where the token counts.

    Raises:
      ValueError: NaN bounds or ``low > high``, and the checks of :func:`binary_tv`.
      TypeError: non-tensor or non-float inputs.

    See "Kimi K2.5: Visual Agentic Intelligence" (Kimi Team, arXiv:2602.02276).

    Example:
      >>> log_ratio_mask(torch.tensor([-0.1, -3.0]), torch.tensor([-0.2, -1.0]),
      ...                low=-1.0, high=1.0)
      tensor([ True, False])
    """
    for name, x in (("low", low), ("high", high)):
        if isinstance(x, bool) or not isinstance(x, int | float) or math.isnan(x):
            raise ValueError(f"{name} must be a number, got {x!r}")
    return _interval_mask(logp, logp_rollout, low, high, mask, validate, ratio=False)


def kpop_mask(
    logp: Tensor,
    logp_rollout: Tensor,
    *,
    phi: float,
    mask: Tensor | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""KPop's mask: keep a token whose binary KL to the rollout is at most :math:`\phi` both ways.

    .. math::
        M_t = 1 \iff KL(\mathrm{Bern}(p)\|\mathrm{Bern}(q)) \le \phi
            \text{ and } KL(\mathrm{Bern}(q)\|\mathrm{Bern}(p)) \le \phi

    with :math:`p = \pi(y_t)`, :math:`q = \mu(y_t)` (:func:`binary_kl` in both directions): a
    band that is wide in ratio for rare tokens and tight for likely ones, with no advantage
    condition. As prime-rl's KPop implementation writes it (:math:`\le`; AReaL's has
    :math:`<`); it quotes :math:`\phi = 0.1` as the blog's default.

    Args:
      logp: log pi of the sampled tokens, ``[..., T]`` (or ``[N]``).
      logp_rollout: the rollout's log-probs of the same tokens, same shape.
      phi: the threshold :math:`\phi \ge 0`.
      mask: bool or 0/1, same shape: False positions come out False.
      validate: run the value checks (None: the global default).

    Returns:
      bool ``[..., T]``: True where the token counts.

    Raises:
      ValueError: ``phi < 0`` and the checks of :func:`binary_tv`.
      TypeError: non-tensor or non-float inputs.

    See J. Guo, Y. Sun et al., "Taming Training-Inference Mismatch in Reinforcement Learning with
    Adaptive Masking Regions" (Ant Group, 2026, https://ringtech.notion.site/kpop).

    Example:
      >>> kpop_mask(torch.tensor([0.5, 0.9]).log(), torch.tensor([0.45, 0.3]).log(), phi=0.1)
      tensor([ True, False])
    """
    phi = _non_negative("phi", phi)
    pair, checks = _start(logp, logp_rollout, mask, validate)
    with torch.no_grad():
        inside = (_binary_kl_values(pair, "rollout||pi") <= phi) & (
            _binary_kl_values(pair, "pi||rollout") <= phi
        )
    return _keep(pair, inside, checks)
