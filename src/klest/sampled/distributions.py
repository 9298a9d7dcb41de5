r"""Stage 0 of the sampled-token path: ``torch.distributions`` objects in place of log-probs.

:func:`klest.kl_estimate` and :func:`klest.kl_penalty` (and :func:`klest.k1`, :func:`klest.k2`,
:func:`klest.k3`, :func:`klest.k_abs`, :func:`klest.cv`) take a pair of
``torch.distributions.Distribution`` objects ``(pi, ref)`` in place of ``(logp, logp_ref)``:

- **closed form**, when ``torch.distributions.kl_divergence`` has a rule for the pair's types
  (Normal, MultivariateNormal, Independent of those, Categorical, Bernoulli, Beta, ...): the value
  is that KL for each batch element, :math:`KL(\pi\|ref)` = ``kl_divergence(pi, ref)`` or
  :math:`KL(ref\|\pi)` = ``kl_divergence(ref, pi)``, exact; ``estimator`` is not used, and
  :func:`klest.kl_penalty`'s gradient is the closed form's own (autodiff), exact too.
- **Monte Carlo**, otherwise: one reparameterized draw per batch element, :math:`x` =
  ``pi.rsample()``, and the log-prob path on ``pi.log_prob(x)``, ``ref.log_prob(x)`` (log
  densities: ``density=True``); :func:`klest.kl_penalty` takes the pathwise gradient
  (``reparameterized=True``): its default ``grad="cumulative"``, a score-function estimator
  that does not apply to reparameterized samples, means ``"pathwise"`` here, and ``"adaptive"``
  or ``"autodiff"`` may be chosen. ``pi`` must have ``rsample``.

The details say which (``details.method``: ``"closed-form"`` or ``"monte-carlo"``;
``"log-probs"`` for log-prob inputs).

Shapes. The batch shape plays the part of the log-probs' shape: ``[N]`` is N independent
samples (one KL per data point, averaged by the default reduction), ``[B, T]`` is B sequences
whose T terms add up (so a ``Normal`` over ``[N, D]`` without ``Independent`` gives each data
point the sum of its D coordinates' KLs: the diagonal Gaussian's KL; over ``[D]`` alone it is D
samples, averaged: wrap one D-dimensional Gaussian as ``Independent(Normal(mu, sigma), 1)``).
``ref``'s batch shape may broadcast against ``pi``'s (a prior ``Normal(0, 1)`` for a batch of
posteriors); the event shapes must be equal. A scalar batch is one sample. For S draws per data
point with the Monte Carlo path, expand ``pi`` and ``ref`` to ``(S, N)`` and pass
``reduction="token-mean"``.

Options that need log-probs of given samples (``logp_behavior``, ``logits``, ``logits_ref``,
``position_kls``, ``logp_stl``, ``baseline``, ``cu_seqlens``) are refused with distributions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.distributions import Distribution, kl_divergence

from klest._checks import ValueChecks, check_mask, compute_dtype, first_bad, resolve_validate
from klest.aggregation import GlobalCounts, check_counts
from klest.layout import PaddedLayout
from klest.sampled.values import Estimate

__all__ = ["Method", "Resolved", "closed_form", "closed_form_estimate", "resolve"]

Method = Literal["log-probs", "monte-carlo", "closed-form"]
"""How a value was computed: from the log-probs passed, from ``rsample``, or in closed form."""


@dataclass(frozen=True)
class Resolved:
    """Distributions turned into what the log-prob path takes: the closed-form KL per batch
    element (``kl``), or the log-probs of one draw from pi (``logp``, ``logp_ref``)."""

    method: Method
    kl: Tensor | None = None
    logp: Tensor | None = None
    logp_ref: Tensor | None = None


def _closed_form(p: Distribution, q: Distribution) -> Tensor | None:
    """``torch.distributions.kl_divergence(p, q)``, or None where it has no rule for the pair
    (it raises NotImplementedError then, also from a rule that does not cover the arguments:
    ``Independent`` pairs over different event dimensions, say)."""
    try:
        return kl_divergence(p, q)
    except NotImplementedError:
        return None


def _recipe(function: str) -> str:
    call = (
        'klest.kl_penalty(pi.log_prob(x), ref.log_prob(x), estimator="k1", grad="pathwise", '
        "reparameterized=True)"
        if function == "kl_penalty"
        else f"klest.{function}(pi.log_prob(x), ref.log_prob(x), density=True)"
    )
    return f"\n    x = pi.rsample()\n    {call}"


def resolve(
    pi: object,
    ref: object,
    *,
    direction: str,
    function: str,
    refused: dict[str, object],
) -> Resolved | None:
    """None for two tensors (the log-prob path); for two distributions the closed form or one
    draw (module docstring). ``refused``: the call's options that need log-probs, by name
    (an error if any is not None)."""
    pi_dist, ref_dist = isinstance(pi, Distribution), isinstance(ref, Distribution)
    if not (pi_dist or ref_dist):
        return None
    if not (pi_dist and ref_dist):
        raise TypeError(
            f"{function} takes two torch.distributions objects (pi, ref) or two tensors of "
            f"log-probs, got {type(pi).__name__} and {type(ref).__name__}. With samples of "
            f"your own, pass their log-probs:{_recipe(function)}"
        )
    assert isinstance(pi, Distribution) and isinstance(ref, Distribution)
    given = [name for name, value in refused.items() if value is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to log-probs of "
            f"given samples, not to distributions; pass the log-probs instead:{_recipe(function)}"
        )
    if pi.event_shape != ref.event_shape:
        raise ValueError(
            f"pi ({type(pi).__name__}) has event shape {tuple(pi.event_shape)} but ref "
            f"({type(ref).__name__}) has {tuple(ref.event_shape)}; they must be equal (wrap "
            "independent coordinates as torch.distributions.Independent(d, 1))"
        )
    try:
        shape = torch.broadcast_shapes(pi.batch_shape, ref.batch_shape)
    except RuntimeError:
        raise ValueError(
            f"pi has batch shape {tuple(pi.batch_shape)} and ref {tuple(ref.batch_shape)}, which "
            "do not broadcast"
        ) from None
    first, second = (pi, ref) if direction == "pi||ref" else (ref, pi)
    kl = _closed_form(first, second)
    if kl is not None:
        return Resolved("closed-form", kl=kl.expand(shape).reshape(shape or (1,)))
    if not pi.has_rsample:
        raise ValueError(
            f"torch.distributions has no closed-form KL between {type(first).__name__} and "
            f"{type(second).__name__}, and {type(pi).__name__} has no rsample for a "
            "reparameterized Monte Carlo estimate; draw the samples yourself and pass their "
            "log-probs (score-function gradients for samples without a graph):"
            f"\n    x = pi.sample()\n    klest.{function}(pi.log_prob(x), ref.log_prob(x), "
            "density=True)"
        )
    if pi.batch_shape != shape:
        pi = pi.expand(shape)
    x = pi.rsample()
    logp, logp_ref = pi.log_prob(x), ref.log_prob(x)
    if logp_ref.shape != logp.shape:
        raise ValueError(
            f"ref.log_prob of pi's samples has shape {tuple(logp_ref.shape)} but pi.log_prob "
            f"has {tuple(logp.shape)}"
        )
    flat = shape or (1,)
    return Resolved("monte-carlo", logp=logp.reshape(flat), logp_ref=logp_ref.reshape(flat))


def closed_form_estimate(kl: Tensor, *, mask: Tensor | None, checks: ValueChecks) -> Estimate:
    """The closed-form KLs ``[...]`` (with their graph) as the rows of an :class:`Estimate` in
    the compute dtype, 0 at masked elements; a NaN KL at a counted element is queued as an
    error."""
    layout = PaddedLayout(kl.shape)
    rows = layout.rows(kl.to(compute_dtype(kl)))
    valid = None
    if mask is not None:
        keep = check_mask(mask, kl.shape, kl.device, checks, of="the distributions' batch")
        valid = layout.rows(keep)
        rows = torch.where(valid, rows, 0.0)
    bad = torch.isnan(rows.detach())
    checks.add(
        bad if valid is None else bad & valid,
        lambda flags: f"torch.distributions.kl_divergence is NaN at {first_bad(flags)}",
    )
    return Estimate(rows, valid, layout)


def closed_form(
    kl: Tensor,
    *,
    mask: Tensor | None,
    reduction: str,
    counts: GlobalCounts | None,
    validate: bool | None,
) -> tuple[Tensor, Estimate]:
    """The closed-form KLs reduced by klest's rule (with their graph: the exact gradient), and
    their :class:`Estimate` for the details; the mask checked and NaN refused in one read."""
    checks = ValueChecks(resolve_validate(validate))
    check_counts(counts, reduction)
    est = closed_form_estimate(kl, mask=mask, checks=checks)
    checks.run()
    return est.reduce(reduction, counts), est
