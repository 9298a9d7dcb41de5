r"""Per-sample (per-token) Monte Carlo estimators of KL(pi||ref) and KL(ref||pi).

Samples come from pi (or from ``behavior`` when ``logp_behavior`` is given). With
``delta = logp - logp_ref`` and ``r = exp(-delta) = ref / pi``:

=========  ==========================================  ==========================================
estimator  ``direction="pi||ref"``: KL(pi||ref)         ``direction="ref||pi"``: KL(ref||pi)
=========  ==========================================  ==========================================
``k1``     :math:`\delta = -\log r` (unbiased)          :math:`r \log r` (unbiased)
``k2``     :math:`\delta^2 / 2` (biased; 2nd order)     :math:`\delta^2 / 2` (biased; 2nd order)
``k3``     :math:`(r - 1) - \log r` (unbiased, >= 0)    :math:`r \log r - (r - 1)` (unbiased, >= 0)
``abs``    :math:`|\delta|` (biased)                    :math:`|r \log r|` (biased)
``cv``     ``k1 + alpha (r - 1)``                       ``k1 - alpha (r - 1)``
``rb``     :math:`KL(\pi_t\|ref_t)` exactly, per        :math:`R_{<t}\, KL(ref_t\|\pi_t)` exactly,
           position, from the logits                    with the prefix ratio :math:`R_{<t}`
=========  ==========================================  ==========================================

Both directions are f-divergences :math:`E_\pi[f(r)]` (``f = -log`` and ``f(r) = r log r``); k3 is
:math:`f(r) - f'(1)(r - 1)` and ``cv`` is :math:`f(r) - \alpha f'(1)(r - 1)`, so ``alpha = 1`` is
k3 in both directions. :func:`f_divergence` does the same for any f. ``rb`` (Rao-Blackwellized)
replaces each sampled token's term by its expectation over the next-token distribution, which
needs the full logits (:func:`klest.kl_from_logits`).

Off-policy (samples from ``behavior``): each value is multiplied by the importance weight
``w = pi / behavior = exp(logp - logp_behavior)`` (``rb``: by the prefix weight ``W_{<t}``), and
gradients flow through ``w``.

Sequences: per-token values summed over a sequence (``reduction="seq-mean-token-sum"``) estimate
the sequence-level KL(pi||ref) for k1, k3, cv and rb. For KL(ref||pi) the token sum of k1, k3
or cv estimates :math:`\sum_t E_{y_{<t} \sim \pi} KL(ref_t || pi_t)`, which is *not* the
sequence-level KL(ref||pi) (the prefixes come from pi, not ref); ``level="sequence"`` applies the
estimator to the whole-sequence log-ratio instead, which is unbiased for it (``rb`` is unbiased
for it either way, through its prefix ratios).

References:
  "Approximating KL Divergence" by John Schulman (2020, http://joschu.net/blog/kl-approx.html):
  k1, k2, k3. The control variate ``r - 1`` has mean 0 because ``E_pi[ref/pi] = 1``, as an AI
  Tech Inspire article on KL divergence stresses; its coefficient fitted on other samples is
  klest's. "Better Estimation of the Kullback-Leibler Divergence Between Language Models" by Afra
  Amini, Tim Vieira and Ryan Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637): rb.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from klest._checks import (
    KLEST_NAMES,
    ArgumentNames,
    ValueChecks,
    check_choice,
    check_direction,
    check_float_tensor,
    check_group,
    check_log_probs,
    check_mask,
    check_same_shape,
    compute_dtype,
    first_bad,
    resolve_validate,
)
from klest._masks import keep_valid, mask_bits
from klest._numerics import exp_neg_tail, times_exp, x_exp, xexp_tail
from klest._types import DEFAULT_REDUCTION, AlphaFit, Direction, Estimator, Level, Reduction
from klest.aggregation import (
    SEQUENCE_REDUCTIONS,
    KLDiagnostics,
    WithDetails,
    as_rows,
    diagnostics,
    group_keys,
    reduce_rows,
)
from klest.control_variates import AlphaEMA, fit_alpha
from klest.logits.from_logits import position_kls as position_kls_from_logits
from klest.sequence import prefix_weights
from klest.surrogates import group_sizes

Alpha = float | Tensor | AlphaFit | AlphaEMA
"""A control-variate coefficient: fixed (number, tensor), fitted (a name), or an AlphaEMA."""


class EstimateDetails(NamedTuple):
    """What :func:`kl_estimate` reports besides the estimate (``return_details=True``).

    Attributes:
      diagnostics: mean, standard error, fraction of negative values, counts, fitted alpha.
    """

    diagnostics: KLDiagnostics


@dataclass(frozen=True)
class LogRatios:
    """Validated inputs as ``[rows, T]`` tensors in the compute dtype.

    ``delta`` and ``log_w`` are 0 at masked positions (so masked inputs never reach a value or
    a gradient); ``valid`` is None when there is no mask (every position counts: no masking
    pass is spent); ``shape`` is the caller's layout, for :func:`~klest.aggregation.reduce_rows`.
    """

    delta: Tensor
    log_w: Tensor | None
    valid: Tensor | None
    shape: torch.Size
    # log pi per row and token, 0 at masked positions, with the caller's graph; None at the
    # sequence level (scores are per token: surrogates take the token-level LogRatios)
    logp: Tensor | None
    bits: Tensor | None = None  # klest._masks.mask_bits of valid for delta's dtype, for reuse

    def valid_or_all(self) -> Tensor:
        """``valid`` as a tensor (all True without a mask)."""
        if self.valid is None:
            return torch.ones_like(self.delta, dtype=torch.bool)
        return self.valid


def prepare_log_ratios(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    logp_behavior: Tensor | None,
    mask: Tensor | None,
    checks: ValueChecks,
    density: bool = False,
    names: ArgumentNames = KLEST_NAMES,
) -> LogRatios:
    """Check log-probs and mask (value checks queued on ``checks``); per-row log-ratios.

    ``density``: the inputs are log-densities of continuous samples (they may exceed 0);
    ``names``: the caller's names of the arguments, and whether it takes ``density=True`` (the
    message for values above 0 suggests it only then).
    """
    name, name_ref, name_behavior = names.logp, names.logp_ref, names.logp_behavior
    density_hint = names.density_option
    check_float_tensor(name, logp)
    check_float_tensor(name_ref, logp_ref)
    if logp_behavior is not None:
        check_float_tensor(name_behavior, logp_behavior)
    check_same_shape(**{name: logp, name_ref: logp_ref, name_behavior: logp_behavior})
    keep = None
    if mask is not None:
        keep = check_mask(
            mask, logp.shape, logp.device, checks, of="the log-probs", name=names.mask
        )
    dtype = compute_dtype(logp, logp_ref, logp_behavior)
    valid = None if keep is None else as_rows(keep)
    bits = None if valid is None else mask_bits(valid, dtype)

    def rows(x: Tensor) -> Tensor:
        """``[rows, T]`` in the compute dtype, 0 under the mask (which may hold anything)."""
        x = as_rows(x).to(dtype)
        return x if valid is None else keep_valid(x, valid, bits)

    lp, lr = rows(logp), rows(logp_ref)
    # Checked on the masked tensors (a 0 there passes every check), in the caller's layout.
    sampler = "pi" if logp_behavior is None else "behavior"
    for arg, x, original, allow_neg_inf, role in (
        # Off-policy, pi may give a behavior sample probability 0.
        (name, lp, logp, logp_behavior is not None, "a sample pi cannot produce"),
        (name_ref, lr, logp_ref, True, ""),
    ):
        check_log_probs(
            arg,
            x.reshape(original.shape),
            checks,
            allow_neg_inf=allow_neg_inf,
            role=role,
            density=density,
            density_hint=density_hint,
            rounding_of=original.dtype,
        )
    delta = lp - lr
    log_w = None
    if logp_behavior is not None:
        lb = rows(logp_behavior)
        check_log_probs(
            name_behavior,
            lb.reshape(logp_behavior.shape),
            checks,
            allow_neg_inf=False,
            role=f"a sample {sampler} cannot produce",
            density=density,
            density_hint=density_hint,
            rounding_of=logp_behavior.dtype,
        )
        log_w = lp - lb
        # A behavior sample that pi cannot produce has weight 0 and contributes 0 (its log-prob
        # is 0 for the score terms: it has no score).
        producible = lp > -math.inf
        delta = torch.where(producible, delta, 0.0)
        lp = torch.where(producible, lp, 0.0)
    return LogRatios(delta, log_w, valid, logp.shape, lp, bits)


def at_sequence_level(lr: LogRatios) -> LogRatios:
    """One log-ratio (and log-weight) per row: the sums over its tokens, ``[rows, 1]`` (no
    ``logp``: scores stay per token)."""
    if len(lr.shape) < 2:
        return lr  # a 1-D input holds independent samples: each is its own sequence
    return LogRatios(
        lr.delta.sum(-1, keepdim=True),
        None if lr.log_w is None else lr.log_w.sum(-1, keepdim=True),
        None if lr.valid is None else lr.valid.any(-1, keepdim=True),
        torch.Size((*lr.shape[:-1], 1)),
        None,
    )


@dataclass(frozen=True)
class RatioTerms:
    """Per-element pieces of one direction: ``naive`` (k1), ``k3`` and the zero-mean ``u``.

    ``cv(alpha) = naive + alpha * u = k3 + (alpha - 1) * u``; ``E_pi[u] = 0``.
    """

    naive: Tensor
    k3: Tensor
    u: Tensor


def naive_term(delta: Tensor, direction: str) -> Tensor:
    """k1 of ``direction``: ``delta`` (KL(pi||ref)) or ``r log r`` (KL(ref||pi))."""
    return delta if direction == "pi||ref" else x_exp(-delta)


def k3_term(delta: Tensor, direction: str) -> Tensor:
    """k3 of ``direction``, without cancellation near r = 1."""
    return exp_neg_tail(delta) if direction == "pi||ref" else xexp_tail(-delta)


def control_term(delta: Tensor, direction: str) -> Tensor:
    """The zero-mean control variate of ``direction``: ``r - 1`` or ``-(r - 1)``."""
    u = torch.expm1(-delta)
    return u if direction == "pi||ref" else -u


def ratio_terms(delta: Tensor, direction: str) -> RatioTerms:
    """The k1 / k3 / control-variate terms of ``direction`` at log-ratios ``delta``."""
    return RatioTerms(
        naive_term(delta, direction), k3_term(delta, direction), control_term(delta, direction)
    )


def _control_variate(delta: Tensor, direction: str, coef: Tensor) -> Tensor:
    r"""``naive + coef * u``, to a few ulps of its terms, and never ``inf - inf``.

    Two exact forms: ``k3 + (coef - 1) u`` (k3 is computed without cancellation, so this is
    exact near r = 1 for coef near 1) and ``naive + coef * u``. Each element uses the one whose
    terms are smaller in magnitude (its rounding error is a few ulps of them); e.g. coef = 0 at
    small r takes the second, which is k1 itself rather than ``k3 - u``.

    Where neither is finite, r = e^{-delta} (or a product with it) has overflowed; the first
    form is then ``inf - inf`` for coef < 1. There the value is written with one exponential,
    with :math:`x = \log r = -\delta`:

    - KL(pi||ref): :math:`\alpha e^x - x - \alpha`,
    - KL(ref||pi): :math:`(x - \alpha) e^x + \alpha`,

    whose ``c e^x`` term (:func:`~klest._numerics.times_exp`) is finite when the product is and
    the correctly signed infinity otherwise: so the result is the true value, or the true
    value's infinite limit once it is past the dtype's range; never NaN.
    """

    def near_forms(t: RatioTerms) -> Tensor:
        bregman = t.k3 + (coef - 1.0) * t.u
        plain = t.naive + coef * t.u
        with torch.no_grad():
            use_plain = t.naive.abs() + coef.abs() * t.u.abs() < (
                t.k3.abs() + (coef - 1.0).abs() * t.u.abs()
            )
        return torch.where(use_plain, plain, bregman)

    near = near_forms(ratio_terms(delta, direction))
    with torch.no_grad():
        far = ~torch.isfinite(near)
    zero = torch.zeros_like(delta)
    if torch.is_grad_enabled() and (delta.requires_grad or coef.requires_grad):
        # Recompute each form with inputs valid for it, so neither backward sees inf * 0.
        near = near_forms(ratio_terms(torch.where(far, zero, delta), direction))
    # Both forms for every element (no host synchronisation to ask whether any is far).
    x = -torch.where(far, delta, zero)
    if direction == "pi||ref":
        far_value = times_exp(coef, x) - x - coef
    else:
        far_value = times_exp(x - coef, x) + coef
    return torch.where(far, far_value, near)


def per_token_values(
    delta: Tensor, estimator: str, direction: str, *, alpha: float | Tensor | None = None
) -> Tensor:
    """Elementwise on-policy estimator values at log-ratios ``delta`` (fixed alpha for ``cv``).

    No validation or masking: the building block that :func:`kl_estimate` and exact
    expectations (``Testbed.expectation``) share. Each estimator evaluates only its own terms
    (k1 and k2 no exponential).
    """
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator in ("k1", "abs"):
        naive = naive_term(delta, direction)
        return naive.abs() if estimator == "abs" else naive
    if estimator == "k3":
        return k3_term(delta, direction)
    if estimator != "cv":
        raise ValueError(f"per_token_values computes k1, k2, k3, abs and cv, not {estimator!r}")
    if not isinstance(alpha, int | float | Tensor):
        raise ValueError(f"per_token_values needs a fixed alpha for 'cv', got {alpha!r}")
    if isinstance(alpha, Tensor):
        coef = alpha.to(dtype=delta.dtype, device=delta.device)
    else:  # a fill, not a copy from the host (which waits for the GPU)
        coef = torch.full((), float(alpha), dtype=delta.dtype, device=delta.device)
    return _control_variate(delta, direction, coef)


def weighted(x: Tensor, log_w: Tensor | None) -> Tensor:
    """``w x`` with ``w = e^{log_w}``; a zero value stays 0 when ``w`` overflows (no inf * 0)."""
    return x if log_w is None else times_exp(x, log_w)


def rb_weights(lr: LogRatios, direction: str) -> Tensor | float:
    r"""Detached weight of each position's exact KL: :math:`W_{<n}`, times :math:`R_{<n}` for
    KL(ref||pi) (the prefix ratio turns an expectation over pi's prefixes into one over ref's).
    """
    w = prefix_weights(lr.log_w, inclusive=False)
    if direction == "pi||ref":
        return w
    d = lr.delta.detach()
    return w * torch.exp(-(d.cumsum(-1) - d))


def _resolve_alpha(
    alpha: Alpha | None, lr: LogRatios, direction: str, keys: Tensor | None, checks: ValueChecks
) -> Tensor:
    """The coefficient as a tensor broadcastable to ``[rows, T]`` (detached when fitted)."""
    dtype, device = lr.delta.dtype, lr.delta.device
    if alpha is None:
        raise ValueError(
            "estimator 'cv' needs alpha: a number, a tensor, 'loo', 'crossfit', 'in-sample', "
            "or an AlphaEMA"
        )
    if isinstance(alpha, str | AlphaEMA):
        a = weighted(naive_term(lr.delta, direction), lr.log_w)
        b = weighted(control_term(lr.delta, direction), lr.log_w)
        if isinstance(alpha, AlphaEMA):
            return alpha(a, b, lr.valid_or_all()).to(dtype)
        return fit_alpha(a, b, lr.valid_or_all(), alpha, keys=keys).to(dtype).unsqueeze(-1)
    if isinstance(alpha, Tensor):
        alpha = alpha.detach().to(device=device, dtype=dtype)
        checks.add(
            ~torch.isfinite(alpha),
            lambda f: (
                f"alpha must be finite (a NaN or inf coefficient makes every value NaN); "
                f"it is not at {first_bad(f)}"
            ),
        )
        if alpha.numel() == 1:
            return alpha.reshape(())
        if alpha.shape != lr.shape:
            raise ValueError(
                f"alpha has shape {tuple(alpha.shape)}; it must be a scalar or match the "
                f"estimate's per-element shape {tuple(lr.shape)}"
            )
        return as_rows(alpha)
    if isinstance(alpha, int | float) and not isinstance(alpha, bool):
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha}")
        # A fill, not a copy from the host (which waits for the GPU).
        return torch.full((), float(alpha), dtype=dtype, device=device)
    raise TypeError(f"alpha must be a number, tensor, str or AlphaEMA, got {type(alpha).__name__}")


@dataclass(frozen=True)
class Estimate:
    """Per-row values of one estimator at one level, ready for reduction.

    ``values`` ``[rows, T]`` (``[rows, 1]`` at the sequence level) are 0 where ``valid`` is
    False (``valid`` None: every position counts); ``shape`` is the layout
    :func:`~klest.aggregation.reduce_rows` restores; ``coef`` is the control-variate coefficient
    used (``cv`` only).
    """

    values: Tensor
    valid: Tensor | None
    shape: torch.Size
    coef: Tensor | None = None

    def reduce(self, reduction: str) -> Tensor:
        return reduce_rows(self.values, self.valid, reduction, self.shape)

    def diagnostics(self, reduction: str) -> KLDiagnostics:
        return diagnostics(self.values, self.valid, reduction=reduction, alpha=self.coef)


def estimate_rows(
    lr: LogRatios,
    *,
    estimator: str,
    direction: str,
    level: str,
    alpha: Alpha | None,
    keys: Tensor | None,
    kls: Tensor | None,
    checks: ValueChecks,
) -> Estimate:
    """The values of ``estimator`` for validated log-ratios (``kls``: exact per-position KLs
    ``[rows, T]`` for ``"rb"``)."""
    if estimator == "rb":
        assert kls is not None  # 0 at masked positions
        est = Estimate(rb_weights(lr, direction) * kls, lr.valid, lr.shape)
        if level == "sequence" and len(lr.shape) >= 2:
            seq = at_sequence_level(lr)
            est = Estimate(est.values.sum(-1, keepdim=True), seq.valid, seq.shape)
        return est
    lr = at_sequence_level(lr) if level == "sequence" else lr
    coef = _resolve_alpha(alpha, lr, direction, keys, checks) if estimator == "cv" else None
    if estimator == "cv":
        values = _control_variate(lr.delta, direction, coef)
    else:
        values = per_token_values(lr.delta, estimator, direction)
    values = weighted(values, lr.log_w)
    # delta is 0 at masked positions, where k1, k2, k3 and abs are exactly 0 already.
    if lr.valid is not None and (estimator == "cv" or lr.log_w is not None):
        values = torch.where(lr.valid, values, 0.0)
    return Estimate(values, lr.valid, lr.shape, coef)


def check_level(level: object, reduction: str) -> None:
    check_choice("level", level, Level)
    if level == "sequence" and reduction not in SEQUENCE_REDUCTIONS:
        raise ValueError(
            f"reduction {reduction!r} needs per-token values; with level='sequence' use one of "
            f"{', '.join(map(repr, SEQUENCE_REDUCTIONS))}"
        )


def exact_position_kls(
    logits: Tensor | None,
    logits_ref: Tensor | None,
    logp: Tensor,
    lr: LogRatios,
    *,
    position_kls: Tensor | None = None,
    direction: str,
    checks: ValueChecks,
    why: str,
) -> Tensor:
    """The exact per-position KLs ``[rows, T]``: from logits ``logp.shape + (V,)``, or given.

    ``position_kls`` (``logp.shape``, e.g. from :func:`klest.kl_from_hidden` with
    ``reduction="none"``) keeps its graph only where gradients are being recorded.
    """
    if position_kls is not None:
        if logits is not None or logits_ref is not None:
            raise ValueError("pass either position_kls or logits and logits_ref, not both")
        check_float_tensor("position_kls", position_kls)
        check_same_shape(logp=logp, position_kls=position_kls)
        kls = position_kls if torch.is_grad_enabled() else position_kls.detach()
        kls = as_rows(kls).to(lr.delta.dtype)
        bad = ~torch.isfinite(kls)
        checks.add(
            bad if lr.valid is None else bad & lr.valid,
            lambda flags: f"position_kls is NaN or infinite at {first_bad(flags)}",
        )
        return kls if lr.valid is None else torch.where(lr.valid, kls, 0.0)
    if logits is None or logits_ref is None:
        raise ValueError(
            f"{why} needs the full next-token distributions: pass logits and logits_ref "
            f"(shape logp.shape + (V,) = {tuple(logp.shape)} + (V,)), or their exact "
            "per-position KLs as position_kls"
        )
    for name, t in (("logits", logits), ("logits_ref", logits_ref)):
        check_float_tensor(name, t, what="logits")
        if t.shape[:-1] != logp.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected logp's shape {tuple(logp.shape)} "
                "plus a vocabulary dimension"
            )
    keep = None if lr.valid is None else lr.valid.reshape(logp.shape)
    kls = position_kls_from_logits(
        logits, logits_ref, direction=direction, keep=keep, checks=checks
    )
    return as_rows(kls).to(lr.delta.dtype)


SMALL_GROUP = 10
"""Groups of at most this many rows make a leave-one-out alpha noisy at the sequence level."""


def _small_groups(flags: Tensor) -> str:
    return (
        f"kl_estimate(estimator='cv', alpha='loo', level='sequence') fits alpha within groups "
        f"of at most {SMALL_GROUP} rows ({int(flags.sum())} row(s) here): with so few others "
        "the fitted coefficient is noisy, and on language-model sequence log-ratios the "
        "estimate's spread was measured at 59-207x plain k1's (groups of 5 and 10). Leave out "
        "group= to fit alpha on the whole batch (still unbiased: E_pi[R - 1] = 0 under every "
        "prompt), or use estimator='k1' or 'rb'. This warning is given once per process."
    )


def kl_estimate(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    estimator: Estimator = "k3",
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    alpha: Alpha | None = None,
    group: Tensor | None = None,
    logp_behavior: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    position_kls: Tensor | None = None,
    density: bool = False,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[EstimateDetails]:
    r"""Monte Carlo estimate of KL(pi||ref) or KL(ref||pi) from the log-probs of samples.

    .. math::
        KL(\pi\|ref) = E_{x\sim\pi}[\log \pi(x) - \log ref(x)], \qquad
        KL(ref\|\pi) = E_{x\sim ref}[\log ref(x) - \log \pi(x)] = E_{x\sim\pi}[r \log r]

    with :math:`r = ref(x) / \pi(x)`; the estimators are tabled in :mod:`klest.estimators`.

    Samples: ``x ~ pi`` (on-policy), or ``x ~ behavior`` when ``logp_behavior`` is given, in
    which case every value is weighted by :math:`w = \pi(x)/behavior(x)` (per token; per
    sequence with ``level="sequence"``).

    Gradient: plain autodiff of the value, which is *not* an unbiased gradient of the KL for
    sampled x (autodiff of k1 has mean 0, of k3 the gradient of KL(ref||pi)). Use
    :func:`klest.kl_penalty` to choose the gradient estimator.

    Args:
      logp: log pi of the samples, ``[..., T]`` per token or ``[N]`` per sample; any float dtype
        (bf16/fp16 are computed in fp32).
      logp_ref: log ref of the same samples, same shape.
      estimator: ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``, ``"cv"`` (with ``alpha``) or ``"rb"``
        (with ``logits`` and ``logits_ref``).
      direction: ``"pi||ref"`` (default) or ``"ref||pi"``: the KL estimated, named by arguments.
      mask: bool or 0/1, same shape; False/0 positions are ignored in value and gradient.
      reduction: ``"seq-mean-token-sum"`` (default: the sequence-level KL), ``"token-mean"``,
        ``"seq-mean-token-mean"``, ``"sum"``, ``"per-sequence"`` or ``"none"`` (per token,
        ``[..., T]``); the table is in :mod:`klest.aggregation`.
      level: ``"token"`` (per-token estimator) or ``"sequence"`` (the estimator of each
        sequence's summed log-ratio; reductions ``"per-sequence"``, ``"seq-mean-token-sum"``,
        ``"sum"``).
      alpha: for ``"cv"`` only: a number or tensor (fixed), ``"loo"`` / ``"crossfit"`` (fitted
        on other rows: unbiased), ``"in-sample"`` (fitted on the same rows: biased), or an
        :class:`~klest.AlphaEMA` (fitted on earlier batches: unbiased).
      group: integer ids, one per row (``logp.shape[:-1]``, or ``[N]`` for 1-D input): a fitted
        alpha is fitted within each group (e.g. the samples of one prompt). With
        ``alpha="loo"`` and ``level="sequence"``, groups of at most ``SMALL_GROUP`` (10) rows
        give a ``UserWarning``, once per process: the coefficient fitted on so few others is
        noisy (its spread was 59-207x k1's on language-model sequences); the ungrouped fit
        (no ``group``) is the remedy. The check rides on the validation read (none with
        ``validate=False``).
      logp_behavior: log behavior of the samples when they were not drawn from pi.
      logits: for ``"rb"``: pi's next-token logits along the samples, ``logp.shape + (V,)``.
      logits_ref: for ``"rb"``: ref's, same shape.
      position_kls: for ``"rb"``, instead of the logits: the exact per-position KLs
        (``logp.shape``, in ``direction``), e.g. :func:`klest.kl_from_hidden` with
        ``reduction="none"``.
      density: the inputs are log-densities of continuous samples (VAEs, VI), which may exceed
        0; for discrete samples (tokens) a log-prob above 0 is an error.
      validate: run the value checks (NaN, log-probs above 0, ...); None: the global default
        (:func:`klest.set_default_validate`).
      return_details: also return an :class:`EstimateDetails`.

    Returns:
      The estimate in the compute dtype (a scalar, ``[...]`` for ``"per-sequence"``, ``[..., T]``
      for ``"none"``); with ``return_details``, ``(estimate, details)``.

    Raises:
      ValueError: mismatched shapes, NaN or ``+inf`` log-probs, log-probs above 0, a sample pi
        gives probability 0, unknown names, options that do not go together.
      TypeError: non-tensor or non-float inputs.

    Example:
      >>> logp = torch.tensor([[-1.0, -0.5], [-2.0, -0.1]])
      >>> logp_ref = torch.tensor([[-1.2, -0.4], [-1.0, -0.3]])
      >>> kl_estimate(logp, logp_ref, estimator="k1")  # mean over sequences of the token sums
      tensor(-0.3500)
      >>> kl_estimate(logp, logp_ref, estimator="k3", reduction="none").shape
      torch.Size([2, 2])
    """
    check_direction(direction)
    check_choice("estimator", estimator, Estimator)
    check_choice("reduction", reduction, Reduction)
    check_level(level, reduction)
    if alpha is not None and estimator != "cv":
        raise ValueError(f"alpha applies only to estimator='cv', not {estimator!r}")
    if group is not None and not isinstance(alpha, str):
        raise ValueError("group applies only to a fitted alpha ('loo', 'crossfit', 'in-sample')")
    checks = ValueChecks(resolve_validate(validate))
    lr = prepare_log_ratios(
        logp, logp_ref, logp_behavior=logp_behavior, mask=mask, checks=checks, density=density
    )
    keys = None if group is None else group_keys(check_group(group, logp.shape, logp.device))
    if level == "sequence" and alpha == "loo" and keys is not None:
        checks.warn_once("cv-loo-small-groups", group_sizes(keys) <= SMALL_GROUP, _small_groups)
    kls = None
    if estimator == "rb":
        kls = exact_position_kls(
            logits,
            logits_ref,
            logp,
            lr,
            position_kls=position_kls,
            direction=direction,
            checks=checks,
            why="estimator 'rb'",
        )
    elif logits is not None or logits_ref is not None or position_kls is not None:
        raise ValueError(f"logits and position_kls apply only to estimator='rb', not {estimator!r}")
    est = estimate_rows(
        lr,
        estimator=estimator,
        direction=direction,
        level=level,
        alpha=alpha,
        keys=keys,
        kls=kls,
        checks=checks,
    )
    checks.run()
    out = est.reduce(reduction)
    if not return_details:
        return out
    return WithDetails(out, EstimateDetails(est.diagnostics(reduction)))


def k1(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    density: bool = False,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[EstimateDetails]:
    r"""k1: the naive unbiased estimator, ``delta`` for KL(pi||ref), ``r log r`` for KL(ref||pi).

    .. math:: k_1 = \log \pi(x) - \log ref(x) = -\log r, \quad x \sim \pi

    Unbiased; negative for about half the samples; its stdev/KL grows like ``2/mu`` for close
    Gaussians at distance mu. Arguments, shapes and returns as in :func:`kl_estimate`.

    See "Approximating KL Divergence" by John Schulman (2020,
    http://joschu.net/blog/kl-approx.html).

    Example:
      >>> k1(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))  # mean of 0.5 and -1.0
      tensor(-0.2500)
    """
    return kl_estimate(
        logp,
        logp_ref,
        estimator="k1",
        direction=direction,
        mask=mask,
        reduction=reduction,
        level=level,
        logp_behavior=logp_behavior,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def k2(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    density: bool = False,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[EstimateDetails]:
    r"""k2: ``(log r)^2 / 2``, an f-divergence that matches either KL to second order.

    .. math:: k_2 = \tfrac12 (\log \pi(x) - \log ref(x))^2, \quad x \sim \pi

    Biased (for close Gaussians at distance mu, bias/KL = mu^2/4); low variance; >= 0. The same
    value for both directions. Arguments, shapes and returns as in :func:`kl_estimate`.

    See "Approximating KL Divergence" by John Schulman (2020,
    http://joschu.net/blog/kl-approx.html).

    Example:
      >>> k2(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))  # mean of 0.125 and 0.5
      tensor(0.3125)
    """
    return kl_estimate(
        logp,
        logp_ref,
        estimator="k2",
        direction=direction,
        mask=mask,
        reduction=reduction,
        level=level,
        logp_behavior=logp_behavior,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def k3(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    density: bool = False,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[EstimateDetails]:
    r"""k3: the unbiased, non-negative Bregman form ``(r - 1) - log r`` (KL(pi||ref)).

    .. math:: k_3 = (r - 1) - \log r, \quad r = ref(x)/\pi(x), \quad x \sim \pi

    For ``direction="ref||pi"``: :math:`r \log r - (r - 1)`. Computed without cancellation
    (exact near r = 1, no overflow while the true value is finite). As a loss on sampled x its
    autodiff descends KL(ref||pi), the *other* KL: choose gradients with
    :func:`klest.kl_penalty`. Arguments, shapes and returns as in :func:`kl_estimate`.

    See "Approximating KL Divergence" by John Schulman (2020,
    http://joschu.net/blog/kl-approx.html).

    Example:
      >>> logp, logp_ref = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-1.2, -0.4]])
      >>> k3(logp, logp_ref, reduction="none")  # r - 1 - log r with r = e^{-0.2}... >= 0
      tensor([[0.0187, 0.0052]])
    """
    return kl_estimate(
        logp,
        logp_ref,
        estimator="k3",
        direction=direction,
        mask=mask,
        reduction=reduction,
        level=level,
        logp_behavior=logp_behavior,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def k_abs(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    density: bool = False,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[EstimateDetails]:
    r"""``|k1|``: the absolute log-ratio (verl's ``"abs"``); biased upward.

    .. math:: |\log \pi(x) - \log ref(x)|, \quad x \sim \pi

    (``|r log r|`` for ``direction="ref||pi"``). Arguments, shapes and returns as in
    :func:`kl_estimate`.

    Example:
      >>> k_abs(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
      tensor(0.7500)
    """
    return kl_estimate(
        logp,
        logp_ref,
        estimator="abs",
        direction=direction,
        mask=mask,
        reduction=reduction,
        level=level,
        logp_behavior=logp_behavior,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def cv(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    alpha: Alpha,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    group: Tensor | None = None,
    logp_behavior: Tensor | None = None,
    density: bool = False,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[EstimateDetails]:
    r"""Control variate ``k1 + alpha (r - 1)`` with a fixed or fitted coefficient.

    .. math:: k_1 + \alpha (r - 1), \quad E_{x\sim\pi}[r - 1] = 0, \quad
              \alpha^* = -\frac{Cov(k_1, r)}{Var(r)}

    (``k1 - alpha (r - 1)`` for KL(ref||pi), so ``alpha = 1`` is k3 in both directions.)
    Unbiased for any fixed alpha and for alpha fitted on other samples (``"loo"``,
    ``"crossfit"``, :class:`~klest.AlphaEMA`); ``"in-sample"`` is biased. ``group`` ids fit alpha
    within each group. Arguments, shapes and returns as in :func:`kl_estimate`.

    The control variate ``r - 1`` has mean 0 because ``E_pi[ref/pi] = 1`` (an AI Tech Inspire
    article on KL divergence); ``alpha = 1`` is k3 of "Approximating KL Divergence" by John
    Schulman (2020, http://joschu.net/blog/kl-approx.html).

    Example:
      >>> g = torch.Generator().manual_seed(0)
      >>> logp, logp_ref = -torch.rand(64, generator=g), -torch.rand(64, generator=g)
      >>> kl, details = cv(logp, logp_ref, alpha="loo", return_details=True)
      >>> kl.shape, details.diagnostics.n_units
      (torch.Size([]), 64)
    """
    return kl_estimate(
        logp,
        logp_ref,
        estimator="cv",
        direction=direction,
        mask=mask,
        reduction=reduction,
        level=level,
        alpha=alpha,
        group=group,
        logp_behavior=logp_behavior,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def f_divergence(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    f: Callable[[Tensor], Tensor],
    f_prime_at_1: float | None = None,
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    density: bool = False,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[EstimateDetails]:
    r"""Unbiased, non-negative (for convex f) estimate of the f-divergence ``E_pi[f(r)]``.

    .. math::
        D_f(ref \| \pi) = E_{x\sim\pi}[f(r)], \quad r = ref(x)/\pi(x), \qquad
        \text{estimate} = f(r) - f'(1)(r - 1)

    ``f(r) = -log r`` gives KL(pi||ref), ``f(r) = r log r`` KL(ref||pi) (write it
    ``torch.xlogy(r, r)`` so that r = 0 gives 0), ``f(r) = (r-1)^2`` the chi-squared divergence.
    ``f`` maps a tensor of ratios to a tensor (autodiff-able when ``f_prime_at_1`` is not given:
    it is then computed by autograd). Samples, other arguments, shapes and returns as in
    :func:`kl_estimate`.

    Numerics: ``f`` is called on :math:`r = e^{-\delta}` in float64 (whatever the input dtype,
    except on devices without float64) and the result is cast to the compute dtype, so float32
    inputs do not overflow r for :math:`|\delta| \le 709`. For a black-box ``f`` the estimate
    cancels near r = 1: its absolute error is a few float64 ulps of ``f(r)``, so for
    ``f = -log`` the relative error is about :math:`2^{-52} / (\delta^2/2)` (8e-5 at
    :math:`\delta = 10^{-6}`). For the two KLs use :func:`kl_estimate` (k3), which works on
    log r and is exact near r = 1. Where the result would be NaN (``f`` undefined, or
    ``inf - inf`` once r is outside float64's range) or infinite only because r underflowed to
    0, the value checks raise a ValueError naming the positions.

    See "Approximating KL Divergence" by John Schulman (2020,
    http://joschu.net/blog/kl-approx.html), whose k3 is this construction for ``f = -log``.

    Example:
      >>> logp, logp_ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
      >>> chi2 = f_divergence(logp, logp_ref, f=lambda r: (r - 1) ** 2)
      >>> kl = f_divergence(logp, logp_ref, f=lambda r: -torch.log(r))
      >>> torch.allclose(kl, k3(logp, logp_ref))
      True
    """
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    check_choice("reduction", reduction, Reduction)
    check_level(level, reduction)
    checks = ValueChecks(resolve_validate(validate))
    lr = prepare_log_ratios(
        logp, logp_ref, logp_behavior=logp_behavior, mask=mask, checks=checks, density=density
    )
    lr = at_sequence_level(lr) if level == "sequence" else lr
    if f_prime_at_1 is None:
        one = torch.ones((), dtype=torch.float64, requires_grad=True)
        with torch.enable_grad():
            (slope,) = torch.autograd.grad(f(one), one)
        f_prime_at_1 = float(slope)
    wide = torch.float64 if lr.delta.device.type != "mps" else lr.delta.dtype
    delta = lr.delta.to(wide)
    r = torch.exp(-delta)
    values = f(r)
    if not isinstance(values, Tensor) or values.shape != r.shape:
        raise ValueError(
            "f must map a tensor of ratios to a tensor of the same shape; got "
            f"{type(values).__name__} {tuple(getattr(values, 'shape', ()))} for ratios of "
            f"shape {tuple(r.shape)}"
        )
    values = values - f_prime_at_1 * torch.expm1(-delta)
    _check_f_values(values, r, delta, lr.valid_or_all(), checks)
    values = weighted(values.to(lr.delta.dtype), lr.log_w)
    if lr.valid is not None:
        values = torch.where(lr.valid, values, 0.0)
    checks.run()
    est = Estimate(values, lr.valid, lr.shape)
    out = est.reduce(reduction)
    if not return_details:
        return out
    return WithDetails(out, EstimateDetails(est.diagnostics(reduction)))


def _check_f_values(
    values: Tensor, r: Tensor, delta: Tensor, valid: Tensor, checks: ValueChecks
) -> None:
    """Queue: no NaN estimate, and none infinite only because r underflowed to 0."""

    def message(bad: Tensor) -> str:
        first = tuple(bad.nonzero()[0].tolist())
        if bool((bad & ((r == 0) | torch.isinf(r))).any()):
            return (
                f"f(r) - f'(1)(r - 1) is not defined numerically at {int(bad.sum())} "
                f"position(s) (first at row/token {first}, delta = {float(delta[first]):.6g}): "
                "the ratio r = exp(-delta) is outside float64's range there (|delta| > ~709), "
                "so f(r) is inf - inf or f(0) instead of its limit; for KL(pi||ref) and "
                "KL(ref||pi) use klest.kl_estimate, which works with log r"
            )
        return (
            f"f returned NaN at {int(bad.sum())} position(s) (first at row/token {first}, "
            f"r = {float(r[first]):.6g}); f must be defined on (0, inf)"
        )

    checks.add(valid & (torch.isnan(values) | (torch.isinf(values) & (r == 0))), message)
