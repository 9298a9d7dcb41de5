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

``token``'s mean is :math:`\sum_t E_{y_{<t}}[\nabla KL_t(y_{<t})]`: the gradients of the
per-position KLs :math:`KL_t = KL(\pi(\cdot|y_{<t})\|ref(\cdot|y_{<t}))` (or ref||pi) with
the prefix distribution held fixed, prefixes drawn from the sampler (pi on-policy; behavior
off-policy, since :math:`w_t` reweights only the token at t). It misses each token's effect on
the later ones, so it is not the gradient of the sequence KL for T > 1.

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
from klest.estimators import (
    ESTIMATORS,
    Alpha,
    LogRatios,
    kl_estimate,
    prepare_log_ratios,
    ratio_terms,
)
from klest.logits.from_logits import kl_from_logits
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
    return as_rows(kl_from_logits(logits, logits_ref, direction=direction, mask=mask))


def _rb_weights(lr: LogRatios, direction: str) -> Tensor | float:
    """Detached weight of each position's exact KL: W_{<n} (times R_{<n} for KL(ref||pi))."""
    w = prefix_weights(lr.log_w, inclusive=False)
    if direction == "pi||ref":
        return w
    ratio = torch.exp(-(lr.delta.detach().cumsum(-1) - lr.delta.detach()))
    return w * ratio


@dataclass(frozen=True)
class _SurrogateInputs:
    lr: LogRatios
    logp_rows: Tensor  # log pi of each valid token, [rows, T], with graph; 0 where masked
    direction: str
    baseline: str | BaselineEMA | None
    groups: Tensor | None

    @property
    def on_policy(self) -> bool:
        return self.lr.log_w is None

    def baseline_for(self, targets: Tensor, valid: Tensor) -> Tensor | float:
        return _baseline(targets, valid, self.baseline, self.groups)


def _pathwise(
    x: _SurrogateInputs, grad: str, logp: Tensor, logp_ref: Tensor, logp_stl: Tensor | None
) -> Tensor:
    """Autodiff of the direction's k1 through reparameterized samples (``stl``: pi stopped)."""
    if not x.on_policy:
        raise ValueError(f"grad={grad!r} needs samples from pi itself, not logp_behavior")
    if not logp_ref.requires_grad:
        raise ValueError(
            f"grad={grad!r} claims reparameterized samples x = g(theta, eps), but logp_ref "
            "carries no graph to pi's parameters (was x detached, or are the samples "
            "discrete?); use grad='score' or 'cumulative' for sampled tokens"
        )
    valid, delta = x.lr.valid, x.lr.delta
    if grad == "stl":
        if x.direction != "pi||ref":
            raise ValueError(
                "grad='stl' drops a term that has mean zero only for KL(pi||ref); use "
                "grad='pathwise' for KL(ref||pi)"
            )
        if logp_stl is None:
            raise ValueError("grad='stl' needs logp_stl: log pi(x) with pi's parameters stopped")
        check_float_tensor("logp_stl", logp_stl)
        check_same_shape(logp=logp, logp_stl=logp_stl)
        stl = as_rows(logp_stl).to(delta.dtype) - as_rows(logp_ref).to(delta.dtype)
        delta = torch.where(valid, stl, 0.0)
    return torch.where(valid, ratio_terms(delta, x.direction).naive, 0.0).sum(-1)


def _token(x: _SurrogateInputs, kls: Tensor | None) -> Tensor:
    """Each token's score times its own (weighted) log-ratio term only."""
    d = x.lr.delta.detach()
    w = 1.0 if x.on_policy else torch.exp(x.lr.log_w.detach())
    coef = w * d if x.direction == "pi||ref" else -w * torch.expm1(-d)
    return (x.logp_rows * coef).sum(-1)


def _score(x: _SurrogateInputs, kls: Tensor | None) -> Tensor:
    """The sequence score times the whole sequence's (weighted, baselined) target."""
    seq_delta = x.lr.delta.detach().sum(-1, keepdim=True)
    target = seq_delta if x.direction == "pi||ref" else torch.exp(-seq_delta)
    w = prefix_weights(x.lr.log_w, inclusive=True)
    w_seq = w if x.on_policy else w[:, -1:]
    coef = w_seq * (target - x.baseline_for(target, torch.ones_like(target, dtype=torch.bool)))
    return (x.logp_rows * (coef if x.direction == "pi||ref" else -coef)).sum(-1)


def _cumulative(x: _SurrogateInputs, kls: Tensor | None) -> Tensor:
    """Each token's score times what it influences: the log-ratios from it on (prefix ratio)."""
    w = prefix_weights(x.lr.log_w, inclusive=True)
    d = x.lr.delta.detach()
    # KL(pi||ref): the weighted log-ratios to go; KL(ref||pi): the prefix ratio R_{<=t}.
    target = sum_from_here(w * d) if x.direction == "pi||ref" else w * torch.exp(-d.cumsum(-1))
    # A baseline b_t enters as W_{<=t} b_t: zero mean since E_behavior[W_{<=t} s_t] = 0.
    b = x.baseline_for(target if x.on_policy else target / w, x.lr.valid)
    coef = target - w * b
    coef = torch.where(x.lr.valid, coef if x.direction == "pi||ref" else -coef, 0.0)
    return (x.logp_rows * coef).sum(-1)


def _rb(x: _SurrogateInputs, kls: Tensor | None) -> Tensor:
    """Pathwise through the exact per-position KLs, plus (KL(pi||ref)) the scores of the future."""
    weights = _rb_weights(x.lr, x.direction)
    surrogate = (weights * kls).sum(-1)
    if x.direction == "pi||ref":
        future = sum_after(weights * kls.detach())
        w_incl = prefix_weights(x.lr.log_w, inclusive=True)
        b = x.baseline_for(future if x.on_policy else future / w_incl, x.lr.valid)
        surrogate = surrogate + (x.logp_rows * (future - w_incl * b)).sum(-1)
    return surrogate


def _first_position(flags: Tensor) -> str:
    return f"{int(flags.sum())} position(s) (first at index {tuple(flags.nonzero()[0].tolist())})"


def _check_surrogate_finite(
    surrogate: Tensor,
    logp: Tensor,
    logp_ref: Tensor,
    logp_behavior: Tensor | None,
    mask: Tensor | None,
    direction: str,
) -> None:
    """Raise, naming the responsible argument, when the surrogate (the gradient) is not finite."""
    with torch.no_grad():
        if bool(torch.isfinite(surrogate).all()):
            return
        keep = torch.ones_like(logp, dtype=torch.bool) if mask is None else mask.bool()
        keep = keep & (logp > float("-inf"))
        zero_ref = keep & (logp_ref == float("-inf"))
        if bool(zero_ref.any()):
            raise ValueError(
                f"logp_ref is -inf at {_first_position(zero_ref)} where pi sampled the token: "
                f"ref gives it probability 0, so KL({direction}) is infinite and has no finite "
                "gradient; mask those tokens out (or give ref nonzero mass there)"
            )
        if logp_behavior is not None:
            raise ValueError(
                "the gradient surrogate is not finite: the importance weights "
                "exp(logp - logp_behavior) (largest log-weight "
                f"{float(torch.where(keep, logp - logp_behavior, float('-inf')).max()):.4g}) or "
                "the log-ratios logp - logp_ref overflow; clip or mask such tokens"
            )
        raise ValueError(
            "the gradient surrogate is not finite: the log-ratios logp - logp_ref (largest "
            f"|logp - logp_ref| {float(torch.where(keep, logp - logp_ref, 0.0).abs().max()):.4g})"
            " overflow the ratio exp(-(logp - logp_ref)) or its sum; mask such tokens"
        )


_SCORE_SURROGATES = {"token": _token, "score": _score, "cumulative": _cumulative, "rb": _rb}


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
    inputs = _SurrogateInputs(lr, logp_rows, direction, baseline, groups)
    if grad in ("pathwise", "stl"):
        surrogate_rows = _pathwise(inputs, grad, logp, logp_ref, logp_stl)
    elif grad == "autodiff":
        if not logp_ref.requires_grad:
            _warn(
                f"grad='autodiff' of value={value!r} on sampled tokens is not an unbiased "
                f"gradient of KL({direction}) (k1: mean 0; k3/cv: the other direction; see "
                "klest.penalty); use grad='cumulative', 'score' or 'rb'"
            )
        surrogate_rows = value_rows
    else:
        if logp_ref.requires_grad:
            _warn(
                f"grad={grad!r} is a score-function gradient, but logp_ref carries a graph "
                "(reparameterized samples, or a trained ref?): gradients through the samples "
                "would mix in; detach the samples, or use grad='pathwise'"
            )
        if grad == "token" and int(counts.max()) > 1:
            _warn(
                "grad='token' is the per-token partial gradient: it misses the effect of each "
                "token on later ones and is biased for a sequence KL; use 'cumulative'"
            )
        surrogate_rows = _SCORE_SURROGATES[grad](inputs, kls)

    value_out = _reduce_rows(value_rows, counts, reduction, seq_shape)
    surrogate_out = _reduce_rows(surrogate_rows, counts, reduction, seq_shape)
    _check_surrogate_finite(surrogate_out, logp, logp_ref, logp_behavior, mask, direction)
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
