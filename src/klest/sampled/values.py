r"""Stage 3 of the sampled-token path: each value estimator's per-row values, ready to reduce.

:func:`estimate_rows` turns validated log-ratios into one estimator's values at one level
(per token, or per sequence on the summed log-ratio), with importance weights off-policy and the
Rao-Blackwellized ``rb`` from the exact per-position KLs (weighted by the prefix weights, and for
KL(ref||pi) by the prefix ratios). :class:`Estimate` carries them to the one reduction rule of
:mod:`klest.aggregation` and to the diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klest._checks import ValueChecks
from klest.aggregation import GlobalCounts, KLDiagnostics, diagnostics, reduce_rows
from klest.layout import Layout
from klest.sampled.control_variates import Alpha, resolve_alpha
from klest.sampled.log_ratios import LogRatios, at_sequence_level
from klest.sampled.sequence import prefix_weights
from klest.sampled.terms import control_variate, per_token_values, weighted

__all__ = ["Estimate", "estimate_rows", "rb_weights"]


def rb_weights(lr: LogRatios, direction: str) -> Tensor | float:
    r"""Detached weight of each position's exact KL: :math:`W_{<n}`, times :math:`R_{<n}` for
    KL(ref||pi) (the prefix ratio turns an expectation over pi's prefixes into one over ref's).
    """
    w = prefix_weights(lr.log_w, inclusive=False)
    if direction == "pi||ref":
        return w
    d = lr.delta.detach()
    return w * torch.exp(-(d.cumsum(-1) - d))


@dataclass(frozen=True)
class Estimate:
    """Per-row values of one estimator at one level, ready for reduction.

    ``values`` ``[rows, T]`` (``[rows, 1]`` at the sequence level) are 0 where ``valid`` is
    False (``valid`` None: every position counts); ``layout`` is the caller's, which
    :func:`~klest.aggregation.reduce_rows` restores; ``coef`` is the control-variate coefficient
    used (``cv`` only).
    """

    values: Tensor
    valid: Tensor | None
    layout: Layout
    coef: Tensor | None = None

    def reduce(self, reduction: str, counts: GlobalCounts | None = None) -> Tensor:
        return reduce_rows(self.values, self.valid, reduction, self.layout, counts)

    def diagnostics(self, reduction: str, pareto_k: Tensor | None = None) -> KLDiagnostics:
        """The diagnostics under ``reduction``, with the tail diagnostic ``pareto_k`` (0-dim,
        :mod:`klest.sampled.tails`) when the values carry a ratio."""
        return diagnostics(
            self.values, self.valid, reduction=reduction, alpha=self.coef, pareto_k=pareto_k
        )


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
        est = Estimate(rb_weights(lr, direction) * kls, lr.valid, lr.layout)
        if level == "sequence" and not lr.layout.samples:
            seq = at_sequence_level(lr)
            est = Estimate(est.values.sum(-1, keepdim=True), seq.valid, seq.layout)
        return est
    lr = at_sequence_level(lr) if level == "sequence" else lr
    coef = resolve_alpha(alpha, lr, direction, keys, checks) if estimator == "cv" else None
    if estimator == "cv":
        values = control_variate(lr.delta, direction, coef)
    else:
        values = per_token_values(lr.delta, estimator, direction)
    values = weighted(values, lr.log_w)
    # delta is 0 at masked positions, where k1, k2, k3 and abs are exactly 0 already.
    if lr.valid is not None and (estimator == "cv" or lr.log_w is not None):
        values = torch.where(lr.valid, values, 0.0)
    return Estimate(values, lr.valid, lr.layout, coef)
