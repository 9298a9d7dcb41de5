"""The names klest's options take, as ``Literal`` types (read by the checks, shown by IDEs).

Every option that takes a name is typed with one of these aliases; :func:`klest._checks.
check_choice` reads the allowed values from the alias itself, so the type and the check cannot
drift apart.
"""

from __future__ import annotations

from typing import Literal

Direction = Literal["pi||ref", "ref||pi"]
"""Which KL, named by its arguments: ``KL(pi||ref) = E_pi[log pi - log ref]`` or ``KL(ref||pi)``."""

Reduction = Literal[
    "none", "per-sequence", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "sum"
]
"""How per-token values become the result (see :func:`klest.aggregate` for the table)."""

DEFAULT_REDUCTION: Reduction = "seq-mean-token-sum"
"""The one default of every function that reduces per-token values: the sequence-level KL."""

Level = Literal["token", "sequence"]
"""Apply a value estimator per token, or to each sequence's summed log-ratio."""

Estimator = Literal["k1", "k2", "k3", "abs", "cv", "rb"]
"""Value estimators (``"rb"``: exact per-position KLs from logits, Rao-Blackwellized)."""

Grad = Literal["pathwise", "adaptive", "stl", "score", "cumulative", "rb", "token", "autodiff"]
"""Gradient estimators of :func:`klest.kl_penalty` (see ``klest.GRADIENT_ESTIMATORS``)."""

BoundGrad = Literal["pathwise", "stl", "dreg"]
"""Gradient estimators of the importance-weighted bounds (:func:`klest.iwae_bound`,
:func:`klest.renyi_bound`): autodiff of the bound, sticking the landing, doubly reparameterized."""

BoundReduction = Literal["mean", "sum", "none"]
"""How the bounds of a batch's data points become the result: their mean, sum, or each one."""

Baseline = Literal["loo", "mean", "loo-fitted", "exact-kl", "exact-kl+loo"]
"""Baselines computed within a batch (``"loo-fitted"``: leave-one-out times a cross-fitted
scale; ``"exact-kl"``: each position's exact KL(pi||ref) from logits, optionally plus the
leave-one-out mean of the rest); a :class:`klest.BaselineEMA` remembers earlier batches."""

AlphaFit = Literal["loo", "crossfit", "in-sample"]
"""How the control-variate coefficient is fitted within a batch (``"in-sample"`` is biased)."""

Backend = Literal["auto", "torch", "triton"]
"""Where the exact-from-logits path computes: Triton kernels on CUDA, or chunked PyTorch."""

SamplerDirection = Literal["rollout||pi", "pi||rollout"]
"""Which divergence between the training policy pi and the rollout (sampler) policy, named by its
arguments: ``KL(rollout||pi) = E_rollout[log rollout - log pi]`` (DPPO's) or ``KL(pi||rollout)``."""

SamplerDivergence = Literal["binary-tv", "binary-kl", "topk-tv", "topk-kl"]
"""The divergences between pi and the rollout policy that :func:`klest.dppo_mask` thresholds:
over the partition {sampled token, the rest} (``binary-*``) or {top-k tokens, sampled token, the
rest} (``topk-*``)."""
