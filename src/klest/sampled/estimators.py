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

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributions import Distribution

from klest._checks import (
    ValueChecks,
    check_choice,
    check_direction,
    check_group,
    resolve_validate,
)
from klest._types import DEFAULT_REDUCTION, Direction, Estimator, Level, Reduction
from klest.aggregation import GlobalCounts, KLDiagnostics, WithDetails, check_counts
from klest.sampled.control_variates import Alpha
from klest.sampled.distributions import Method, closed_form, resolve
from klest.sampled.groups import group_keys, group_sizes
from klest.sampled.log_ratios import (
    at_sequence_level,
    check_level,
    exact_position_kls,
    prepare_log_ratios,
)
from klest.sampled.tails import tail_check
from klest.sampled.terms import weighted
from klest.sampled.values import Estimate, estimate_rows

__all__ = [
    "SMALL_GROUP",
    "EstimateDetails",
    "cv",
    "f_divergence",
    "k1",
    "k2",
    "k3",
    "k_abs",
    "kl_estimate",
]


class EstimateDetails(NamedTuple):
    """What :func:`kl_estimate` reports besides the estimate (``return_details=True``).

    Attributes:
      diagnostics: mean, standard error, fraction of negative values, counts, fitted alpha,
        the ratios' tail diagnostic ``pareto_k``.
      method: ``"log-probs"`` (the samples passed), or for ``torch.distributions`` inputs
        ``"closed-form"`` (``kl_divergence``) or ``"monte-carlo"`` (``pi.rsample()``):
        :mod:`klest.sampled.distributions`.
    """

    diagnostics: KLDiagnostics
    method: Method = "log-probs"


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
    logp: Tensor | Distribution,
    logp_ref: Tensor | Distribution,
    *,
    estimator: Estimator = "k3",
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    alpha: Alpha | None = None,
    group: Tensor | None = None,
    logp_behavior: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
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

    with :math:`r = ref(x) / \pi(x)`; the estimators are tabled in :mod:`klest.sampled.estimators`.

    Samples: ``x ~ pi`` (on-policy), or ``x ~ behavior`` when ``logp_behavior`` is given, in
    which case every value is weighted by :math:`w = \pi(x)/behavior(x)` (per token; per
    sequence with ``level="sequence"``).

    Gradient: plain autodiff of the value, which is *not* an unbiased gradient of the KL for
    sampled x (autodiff of k1 has mean 0, of k3 the gradient of KL(ref||pi)). Use
    :func:`klest.kl_penalty` to choose the gradient estimator.

    Args:
      logp: log pi of the samples, ``[..., T]`` per token or ``[N]`` per sample; any float dtype
        (bf16/fp16 are computed in fp32). Or pi itself, a ``torch.distributions.Distribution``
        (with ref one too): the closed-form KL where ``torch.distributions.kl_divergence`` has
        one, else one draw of ``pi.rsample()`` per batch element
        (:mod:`klest.sampled.distributions`; ``details.method`` says which).
      logp_ref: log ref of the same samples, same shape (or ref, a ``Distribution``).
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
      cu_seqlens: packed sequences: offsets ``[S + 1]`` of the S sequences whose tokens
        ``logp`` (``[total]`` or ``[1, total]``) holds one after another (:mod:`klest.layout`);
        the same estimate as the padded batch.
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known (no host read).
      counts: global token and sequence counts of a batch computed in pieces
        (:class:`~klest.GlobalCounts`): the mean reductions divide by them.
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
    source = resolve(
        logp,
        logp_ref,
        direction=direction,
        function="kl_estimate",
        refused={
            "logp_behavior": logp_behavior,
            "logits": logits,
            "logits_ref": logits_ref,
            "position_kls": position_kls,
            "cu_seqlens": cu_seqlens,
        },
    )
    if source is not None and source.kl is not None:
        out, est = closed_form(
            source.kl, mask=mask, reduction=reduction, counts=counts, validate=validate
        )
        if not return_details:
            return out
        return WithDetails(out, EstimateDetails(est.diagnostics(reduction), source.method))
    if source is not None:
        logp, logp_ref, density = source.logp, source.logp_ref, True
    checks = ValueChecks(resolve_validate(validate))
    lr = prepare_log_ratios(
        logp,
        logp_ref,
        logp_behavior=logp_behavior,
        mask=mask,
        checks=checks,
        density=density,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )
    check_counts(counts, reduction)
    keys = None
    if group is not None:
        keys = group_keys(
            check_group(group, lr.layout.sequences_shape, logp.device, of_shape=logp.shape)
        )
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
    tail = tail_check(
        lr,
        estimator=estimator,
        direction=direction,
        level=level,
        checks=checks,
        details=return_details,
        caller=f"kl_estimate(estimator={estimator!r})",
    )
    checks.run()
    out = est.reduce(reduction, counts)
    if not return_details:
        return out
    method: Method = "log-probs" if source is None else source.method
    return WithDetails(out, EstimateDetails(est.diagnostics(reduction, tail), method))


def k1(
    logp: Tensor | Distribution,
    logp_ref: Tensor | Distribution,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
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
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def k2(
    logp: Tensor | Distribution,
    logp_ref: Tensor | Distribution,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
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
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def k3(
    logp: Tensor | Distribution,
    logp_ref: Tensor | Distribution,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
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

    Unbiased, but its value averages r: where r's upper tail is heavy
    (``details.diagnostics.pareto_k`` above 0.7, which warns once per process; a Gaussian
    posterior with sigma below 1/sqrt(2) of its standard normal prior) a batch's value is
    typically below the KL by more than its standard error shows. Log k1's value or the exact KL
    then (:mod:`klest.sampled.tails`).

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
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def k_abs(
    logp: Tensor | Distribution,
    logp_ref: Tensor | Distribution,
    *,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    logp_behavior: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
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
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
        density=density,
        validate=validate,
        return_details=return_details,
    )


def cv(
    logp: Tensor | Distribution,
    logp_ref: Tensor | Distribution,
    *,
    alpha: Alpha,
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    level: Level = "token",
    group: Tensor | None = None,
    logp_behavior: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
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
    within each group. Arguments, shapes and returns as in :func:`kl_estimate`. Its value
    averages r as k3's does: ``details.diagnostics.pareto_k`` measures r's tail
    (:mod:`klest.sampled.tails`).

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
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        counts=counts,
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
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
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
        logp,
        logp_ref,
        logp_behavior=logp_behavior,
        mask=mask,
        checks=checks,
        density=density,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )
    check_counts(counts, reduction)
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
    tail = tail_check(
        lr,
        estimator="f",
        direction="pi||ref",
        level="token",  # lr is already at the call's level
        checks=checks,
        details=return_details,
        caller="f_divergence",
    )
    checks.run()
    est = Estimate(values, lr.valid, lr.layout)
    out = est.reduce(reduction, counts)
    if not return_details:
        return out
    return WithDetails(out, EstimateDetails(est.diagnostics(reduction, tail)))


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
