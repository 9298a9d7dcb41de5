r"""The KL term to add to a training loss: a value estimator and a gradient estimator, chosen apart.

``kl_penalty`` returns ``decouple(value, surrogate)``: its forward value is the chosen value
estimator, its gradient the chosen gradient estimator's. Notation (DESIGN.md): samples
:math:`y \sim \pi` (or ``behavior``), tokens :math:`t`, :math:`\rho_t = \log\pi(y_t|y_{<t}) -
\log ref(y_t|y_{<t})`, :math:`s_t = \nabla\log\pi(y_t|y_{<t})`, sequence ratio
:math:`R = \prod_t ref/\pi = e^{-\sum_t\rho_t}`, prefix ratio :math:`R_{\le t}`, and importance
weights :math:`W_{\le t} = \prod_{u\le t}\pi/behavior` (1 on-policy).

Gradient estimators (``grad=``) and what their mean is:

============== ============================================================ =====================
``grad``       surrogate gradient per sequence                              mean
============== ============================================================ =====================
``pathwise``   autodiff of the direction's k1 through reparameterized x     grad of the KL
``stl``        same with log pi's parameters stopped ("sticking the         grad KL(pi||ref)
               landing"; drops a zero-mean term)
``score``      KL(pi||ref): :math:`W (\sum_t s_t)(\sum_u \rho_u - b)`;      grad of the KL
               KL(ref||pi): :math:`-W (\sum_t s_t)(R - b)`
``cumulative`` KL(pi||ref): :math:`\sum_t s_t (\sum_{u\ge t} W_{\le u}\rho_u  grad of the KL
               - W_{\le t} b_t)`; KL(ref||pi): :math:`-\sum_t s_t
               W_{\le t}(R_{\le t} - b_t)`
``rb``         KL(pi||ref): :math:`\sum_n W_{<n}\nabla KL_n + \sum_m s_m     grad of the KL
               (\sum_{n>m} W_{<n} KL_n - W_{\le m} b_m)` with the exact
               per-position :math:`KL_n` from logits; KL(ref||pi):
               :math:`\sum_n W_{<n} R_{<n} \nabla KL_n`
``token``      :math:`\sum_t s_t w_t\rho_t` (what k2-per-token losses give)  biased for T > 1
``autodiff``   autodiff of the value estimator itself (TRL/verl's k3 loss)  see below
============== ============================================================ =====================

``autodiff`` on sampled (not reparameterized) tokens: k1 has mean gradient 0; k3 and cv descend
:math:`\sum_t E_{y_{<t}\sim\pi} KL(ref_t\|\pi_t)` (the *other* direction, token by token); k2
gives ``token``; rb gives only the first (pathwise) sum of ``rb``. On reparameterized samples it
is the unbiased pathwise gradient of an unbiased value (k3's has exploding variance in high
dimensions: seed 000).

Baselines (``baseline=``) apply to ``score``, ``cumulative`` and ``rb`` (KL(pi||ref)): see
:mod:`klest.surrogates`.

Sources: seed 000 (Chimera), seed 002 (arXiv:2506.09477, pitfalls; cumulative and
leave-one-out), seed 003 (arXiv:2504.10637, Rao-Blackwellized gradient), DESIGN.md section 3.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from klest._checks import (
    check_choice,
    check_direction,
    check_float_tensor,
    check_group,
    check_same_shape,
)
from klest.aggregation import KLDiagnostics, as_rows, diagnostics
from klest.categorical import categorical_kl
from klest.estimators import (
    ESTIMATORS,
    Alpha,
    LogRatios,
    kl_estimate,
    prepare_log_ratios,
    ratio_terms,
)
from klest.sequence import prefix_weights, sum_after, sum_from_here
from klest.surrogates import BASELINES, BaselineEMA, decouple, group_baseline

GRADS = ("pathwise", "stl", "score", "cumulative", "rb", "token", "autodiff")
VALUES = (*ESTIMATORS, "rb")
_WITH_BASELINE = ("score", "cumulative", "rb")


class KLGradientWarning(UserWarning):
    """A gradient estimator was chosen whose mean is not the gradient of the stated KL."""


@dataclass(frozen=True)
class PenaltyDetails:
    """What :func:`kl_penalty` reports besides the loss, for logging.

    Attributes:
      per_sequence: the value estimate of each sequence (row), detached, ``logp.shape[:-1]``.
      diagnostics: mean, standard error and fraction of negative values of the estimate.
    """

    per_sequence: Tensor
    diagnostics: KLDiagnostics


def _reduce_rows(x: Tensor, counts: Tensor, reduction: str, shape: torch.Size) -> Tensor:
    if reduction == "none":
        return x.reshape(shape)
    if reduction == "sum":
        return x.sum()
    if reduction == "token-mean":
        return x.sum() / counts.sum()
    if reduction == "seq-mean-token-mean":
        return (x / counts).mean()
    return x.mean()


def _check_baseline(baseline: object, grad: str, direction: str) -> None:
    if baseline is None:
        return
    if not isinstance(baseline, BaselineEMA):
        check_choice("baseline", baseline, BASELINES)
    if grad not in _WITH_BASELINE or (grad == "rb" and direction == "ref||pi"):
        raise ValueError(
            f"baseline applies to grad in {_WITH_BASELINE} (rb: KL(pi||ref) only), not "
            f"grad={grad!r} with direction={direction!r}"
        )


def _baseline(targets: Tensor, valid: Tensor, baseline, group: Tensor | None) -> Tensor | float:
    if baseline is None:
        return 0.0
    if isinstance(baseline, BaselineEMA):
        return baseline(targets, valid)
    return group_baseline(targets, valid, baseline, group)


def _position_kls(
    logits: Tensor | None,
    logits_ref: Tensor | None,
    logp: Tensor,
    mask: Tensor | None,
    direction: str,
    why: str,
) -> Tensor:
    if logits is None or logits_ref is None:
        raise ValueError(
            f"{why} needs the full next-token distributions: pass logits and logits_ref "
            "(shape logp.shape + (V,))"
        )
    check_float_tensor("logits", logits)
    check_float_tensor("logits_ref", logits_ref)
    if logits.shape[:-1] != logp.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)}; expected logp's shape {tuple(logp.shape)} "
            "plus a vocabulary dimension"
        )
    return as_rows(categorical_kl(logits, logits_ref, direction=direction, mask=mask))


def _rb_weights(lr: LogRatios, direction: str) -> Tensor | float:
    """Detached weight of each position's exact KL: W_{<n} (times R_{<n} for KL(ref||pi))."""
    w = prefix_weights(lr.log_w, inclusive=False)
    if direction == "pi||ref":
        return w
    ratio = torch.exp(-(lr.delta.detach().cumsum(-1) - lr.delta.detach()))
    return w * ratio


def _warn(message: str) -> None:
    warnings.warn(message, KLGradientWarning, stacklevel=3)


def kl_penalty(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    mask: Tensor | None = None,
    value: str = "k3",
    grad: str = "cumulative",
    baseline: str | BaselineEMA | None = None,
    group: Tensor | None = None,
    direction: str = "pi||ref",
    reduction: str = "seq-mean-token-sum",
    logp_behavior: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    logp_stl: Tensor | None = None,
    alpha: Alpha | None = None,
    level: str = "token",
    return_details: bool = False,
) -> Tensor | tuple[Tensor, PenaltyDetails]:
    r"""A KL term for a loss: ``value`` in the forward pass, ``grad``'s estimator in the backward.

    .. math::
        \text{loss} = \mathrm{sg}(\widehat{KL}_{value}) + S_{grad} - \mathrm{sg}(S_{grad}),
        \qquad E[\nabla S_{grad}] = \nabla KL(\pi\|ref) \text{ (or } KL(ref\|\pi))

    for the unbiased gradient estimators (see the module docstring for each surrogate).

    Samples: sequences y ~ pi (or ~ behavior with ``logp_behavior``); for ``grad="pathwise"`` /
    ``"stl"``, continuous samples x = g(theta, eps) reparameterized through pi's parameters.

    Args:
      logp: log pi of the sampled tokens ``[..., T]`` (or samples ``[N]``), carrying the graph
        of the trainable model.
      logp_ref: log ref of the same tokens. Reparameterized samples give it a graph (through x).
      mask: bool ``[..., T]``: valid tokens.
      value: value estimator: ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``, ``"cv"`` (with
        ``alpha``) or ``"rb"`` (exact per-position KLs summed; needs logits).
      grad: gradient estimator: ``"pathwise"``, ``"stl"``, ``"score"``, ``"cumulative"``,
        ``"rb"``, ``"token"``, ``"autodiff"``.
      baseline: ``"loo"``, ``"mean"`` or a :class:`~klest.BaselineEMA`, for ``score``,
        ``cumulative`` and ``rb``.
      group: integer ids ``logp.shape[:-1]``: samples of the same prompt (baselines and fitted
        alphas are computed within a group).
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      reduction: over sequences: ``"seq-mean-token-sum"`` (the sequence KL; default),
        ``"token-mean"`` (the same divided by tokens per sequence on average), ``"sum"``,
        ``"seq-mean-token-mean"`` (each sequence divided by its length: not the gradient of a
        KL), ``"none"`` (one loss per sequence).
      logp_behavior: log behavior of the tokens when they were not sampled from pi.
      logits: pi's next-token logits along the samples, ``logp.shape + (V,)``, with graph
        (for ``value="rb"`` / ``grad="rb"``).
      logits_ref: ref's, same shape.
      logp_stl: for ``grad="stl"``: log pi of the samples with pi's distribution parameters
        stopped (x itself still differentiable).
      alpha: coefficient for ``value="cv"`` (see :func:`klest.kl_estimate`).
      level: ``"token"`` or ``"sequence"`` for token-level values (see :func:`klest.kl_estimate`).
      return_details: also return a :class:`PenaltyDetails`.

    Returns:
      The loss (a scalar, or one per sequence for ``reduction="none"``); with
      ``return_details``, ``(loss, details)``.
    """
    check_direction(direction)
    check_choice("value", value, VALUES)
    check_choice("grad", grad, GRADS)
    _check_baseline(baseline, grad, direction)
    lr = prepare_log_ratios(
        logp, logp_ref, logp_behavior=logp_behavior, mask=mask, level="token", reduction=reduction
    )
    if level == "sequence" and reduction in ("token-mean", "seq-mean-token-mean"):
        raise ValueError(f"reduction {reduction!r} needs token-level values, not level='sequence'")
    groups = None if group is None else check_group(group, logp.shape, logp.device)
    valid = lr.valid
    seq_shape = logp.shape[:-1] if logp.ndim >= 2 else logp.shape
    counts = valid.sum(-1).to(lr.delta.dtype)
    logp_rows = torch.where(valid, as_rows(logp).to(lr.delta.dtype), 0.0)
    on_policy = lr.log_w is None

    kls = None
    if "rb" in (value, grad):
        kls = _position_kls(logits, logits_ref, logp, mask, direction, f"{value=}/{grad=} 'rb'")

    # -- the value -------------------------------------------------------------------------
    if value == "rb":
        value_rows = (_rb_weights(lr, direction) * kls).sum(-1)
    else:
        per = kl_estimate(
            logp,
            logp_ref,
            estimator=value,
            direction=direction,
            alpha=alpha,
            logp_behavior=logp_behavior,
            mask=mask,
            level=level,
            reduction="none",
            group=groups.reshape(seq_shape)
            if (groups is not None and isinstance(alpha, str))
            else None,
        )
        value_rows = as_rows(per).sum(-1) if level == "token" else per.reshape(-1)

    # -- the surrogate ---------------------------------------------------------------------
    if grad in ("pathwise", "stl"):
        if not on_policy:
            raise ValueError(f"grad={grad!r} needs samples from pi itself, not logp_behavior")
        if not logp_ref.requires_grad:
            raise ValueError(
                f"grad={grad!r} claims reparameterized samples x = g(theta, eps), but logp_ref "
                "carries no graph to pi's parameters (was x detached, or are the samples "
                "discrete?); use grad='score' or 'cumulative' for sampled tokens"
            )
        delta = lr.delta
        if grad == "stl":
            if direction != "pi||ref":
                raise ValueError(
                    "grad='stl' drops a term that has mean zero only for KL(pi||ref); use "
                    "grad='pathwise' for KL(ref||pi)"
                )
            if logp_stl is None:
                raise ValueError(
                    "grad='stl' needs logp_stl: log pi(x) with pi's parameters stopped"
                )
            check_float_tensor("logp_stl", logp_stl)
            check_same_shape(logp=logp, logp_stl=logp_stl)
            delta = torch.where(valid, as_rows(logp_stl).to(delta.dtype) - as_rows(logp_ref), 0.0)
        surrogate_rows = torch.where(valid, ratio_terms(delta, direction).naive, 0.0).sum(-1)
    elif grad == "autodiff":
        if not logp_ref.requires_grad:
            _warn(
                f"grad='autodiff' of value={value!r} on sampled tokens is not an unbiased "
                f"gradient of KL({direction}) (k1: mean 0; k3/cv: the other direction; see "
                "klest.penalty); use grad='cumulative', 'score' or 'rb'"
            )
        surrogate_rows = value_rows
    elif grad == "token":
        if int(counts.max()) > 1:
            _warn(
                "grad='token' is the per-token partial gradient: it misses the effect of each "
                "token on later ones and is biased for a sequence KL; use 'cumulative'"
            )
        w = 1.0 if on_policy else torch.exp(lr.log_w.detach())
        if direction == "pi||ref":
            coef = w * lr.delta.detach()
        else:
            coef = -w * torch.expm1(-lr.delta.detach())
        surrogate_rows = (logp_rows * coef).sum(-1)
    elif grad == "score":
        seq_delta = lr.delta.detach().sum(-1, keepdim=True)
        target = seq_delta if direction == "pi||ref" else torch.exp(-seq_delta)
        ones = torch.ones_like(target, dtype=torch.bool)
        w = prefix_weights(lr.log_w, inclusive=True)
        w_seq = w if on_policy else w[:, -1:]
        coef = w_seq * (target - _baseline(target, ones, baseline, groups))
        if direction == "ref||pi":
            coef = -coef
        surrogate_rows = (logp_rows * coef).sum(-1)
    elif grad == "cumulative":
        w = prefix_weights(lr.log_w, inclusive=True)
        d = lr.delta.detach()
        # KL(pi||ref): the weighted log-ratios to go; KL(ref||pi): the prefix ratio R_{<=t}.
        target = sum_from_here(w * d) if direction == "pi||ref" else w * torch.exp(-d.cumsum(-1))
        # A baseline b_t enters as W_{<=t} b_t: zero mean since E_behavior[W_{<=t} s_t] = 0.
        b = _baseline(target if on_policy else target / w, valid, baseline, groups)
        coef = target - w * b
        if direction == "ref||pi":
            coef = -coef
        surrogate_rows = (logp_rows * torch.where(valid, coef, 0.0)).sum(-1)
    else:  # rb
        if kls is None:  # pragma: no cover - guarded above
            raise AssertionError
        weights = _rb_weights(lr, direction)
        surrogate_rows = (weights * kls).sum(-1)
        if direction == "pi||ref":
            future = sum_after(weights * kls.detach())
            w_incl = prefix_weights(lr.log_w, inclusive=True)
            b = _baseline(future if on_policy else future / w_incl, valid, baseline, groups)
            surrogate_rows = surrogate_rows + (logp_rows * (future - w_incl * b)).sum(-1)

    value_out = _reduce_rows(value_rows, counts, reduction, seq_shape)
    surrogate_out = _reduce_rows(surrogate_rows, counts, reduction, seq_shape)
    loss = decouple(value_out, surrogate_out)
    if not return_details:
        return loss
    per_sequence = value_rows.detach().reshape(seq_shape)
    diag = diagnostics(
        value_rows.detach().unsqueeze(-1),
        torch.ones_like(value_rows.unsqueeze(-1), dtype=torch.bool),
        reduction="seq-mean-token-sum",
    )
    return loss, PenaltyDetails(per_sequence, diag)
