r"""The library's audit plan (what ``klest audit`` prints), built on :mod:`klest.audit.core`.

:func:`run_audit_suite` audits every value estimator on every testbed, every gradient estimator
on a tabular autoregressive policy and the pathwise ones on a Gaussian, then the top-k
distillation estimators (:func:`topk_audit_section`).

Top-k: :func:`klest.logits.topk.kl_from_topk` sees the teacher only through its top-k log-probs
and the log-prob of the sampled token. Here a :class:`~klest.testbeds.CategoricalTestbed` plays
both models (its ``ref`` is the teacher, stored as its top-k), so each estimator's value and
gradient are audited against the exact full KL and its exact gradient with
:func:`~klest.audit.audit_value` and :func:`~klest.audit.audit_grad`: ``truncated`` and
``truncated-raw`` are biased (what peers compute), ``tail-bucket`` is biased low (a lower
bound), ``unbiased`` and ``unbiased-cv`` are unbiased in value and gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from klest._progress import progress_bar
from klest.audit.core import audit_grad, audit_value, format_grad_audits, format_value_audits
from klest.logits.topk import kl_from_topk
from klest.testbeds import CategoricalTestbed, GaussianTestbed, TabularAutoregressive
from klest.testbeds.base import Sample

__all__ = [
    "GRAD_AUDIT",
    "GRAD_AUDIT_BOTH",
    "GRAD_AUDIT_ONLY",
    "REPARAMETERIZED_GRAD_AUDIT",
    "SEQUENCE_VALUE_AUDIT",
    "TOPK_AUDIT",
    "VALUE_AUDIT",
    "run_audit_suite",
    "topk_audit_section",
    "topk_estimate_fn",
]

VALUE_AUDIT = ("k1", "k2", "k3", "abs", "cv:0.5", "cv:loo", "cv:ema")
"""Value estimators (:class:`~klest.audit.EstimatorSpec` strings) the suite checks on every
testbed."""
SEQUENCE_VALUE_AUDIT = ("k1", "k3", "cv:0.5", "cv:loo", "cv:ema")
"""Value estimators the suite also checks at the sequence level on sequence testbeds: per-token
values of KL(ref||pi) summed over a sequence estimate the token sum of
E_{y<t ~ pi} KL(ref_t||pi_t), not the sequence KL(ref||pi); ``level="sequence"`` is the unbiased
option."""

GRAD_AUDIT_BOTH = (
    "k1/autodiff",
    "k3/autodiff",
    "k3/token",
    "k3/score",
    "k3/score+loo",
    "k3/score+ema",
    "k3/score+mean",
    "k3/cumulative",
    "k3/cumulative+loo",
    "k3/cumulative+ema",
    "k3/score+loo-fitted",
    "k3/cumulative+loo-fitted",
    "k3/score+loo-ema",
    "k3/cumulative+loo-ema",
    "rb/rb",
)
"""Gradient estimators the suite checks on a tabular autoregressive policy as claims on either
KL."""
GRAD_AUDIT_ONLY = {
    "pi||ref": (
        "k2/autodiff",
        "rb/rb+loo",
        "rb/rb+loo-fitted",
        "rb/rb+loo-ema",
        "rb/autodiff",
        "k3/cumulative+exact-kl",
        "k3/token+exact-kl",
    ),
    "ref||pi": (),
}
"""Gradient estimators the suite checks on that policy for one claimed KL only, per direction."""
GRAD_AUDIT = {direction: GRAD_AUDIT_BOTH + only for direction, only in GRAD_AUDIT_ONLY.items()}
"""Gradient estimators (:class:`~klest.audit.GradSpec` strings) the suite checks on a tabular
autoregressive policy, per claimed direction: ``GRAD_AUDIT_BOTH`` then that direction's
``GRAD_AUDIT_ONLY``."""
REPARAMETERIZED_GRAD_AUDIT = ("k1/pathwise", "k3/autodiff", "k3/adaptive")
"""Pathwise gradient estimators, audited on reparameterized Gaussian samples in both
directions."""


TOPK_AUDIT = ("truncated", "truncated-raw", "tail-bucket", "unbiased", "unbiased-cv")
"""The estimators of :func:`~klest.logits.topk.kl_from_topk` the audit suite checks."""


def topk_estimate_fn(
    estimator: str, testbed: CategoricalTestbed, *, k: int, direction: str
) -> Callable[[Sample], Tensor]:
    r"""A per-sample estimate ``[n]`` of ``testbed``'s KL from its teacher's top-k only.

    The teacher's top-k log-probs come from ``testbed.logits_ref``; the samples (and the
    teacher's log-prob of each) from the testbed's draws from pi.

    Args:
      estimator: one of :data:`TOPK_AUDIT`.
      testbed: the categorical testbed (pi trainable, ref the teacher).
      k: the number of teacher log-probs kept.
      direction: ``"pi||ref"`` or ``"ref||pi"``.

    Returns:
      A function from a :class:`~klest.testbeds.Sample` of n outcomes to n estimates, with the
      graph to the testbed's parameters (for :func:`~klest.audit.audit_grad`).

    Example:
      >>> tb = CategoricalTestbed.random(20, scale=2.0, seed=0)
      >>> fn = topk_estimate_fn("unbiased", tb, k=4, direction="pi||ref")
      >>> fn(tb.sample(3, generator=klest.testbeds.make_generator(0))).shape
      torch.Size([3])
    """
    top, idx = torch.log_softmax(testbed.logits_ref.detach(), -1).topk(k)

    def estimate(sample: Sample) -> Tensor:
        assert sample.logits is not None and sample.x is not None
        n = sample.x.shape[0]
        return kl_from_topk(
            sample.logits,
            idx.expand(n, k),
            top.expand(n, k),
            labels=sample.x,
            logp_ref_label=sample.logp_ref,
            estimator=estimator,  # type: ignore[arg-type]
            direction=direction,  # type: ignore[arg-type]
            reduction="none",
        )

    estimate.__name__ = f"topk:{estimator}"
    return estimate


def _batch_mean(fn: Callable[[Sample], Tensor]) -> Callable[[Sample], Tensor]:
    """The batch loss of a per-sample estimate (what :func:`~klest.audit.audit_grad` takes)."""

    def loss(sample: Sample) -> Tensor:
        return fn(sample).mean()

    loss.__name__ = fn.__name__
    return loss


def topk_audit_section(*, quick: bool = False, seed: int = 0, progress: bool = False) -> str:
    """The audit suite's top-k section, as markdown: value and gradient tables, both KLs.

    A random categorical (K = 64 outcomes, logits N(0, 2^2): a peaky teacher) whose teacher is
    stored as its top 6; values in batches of 16, gradients in batches of 8.

    Args:
      quick: 100 value trials and 150 gradient trials instead of 2000 each.
      seed: seeds the testbed and the sampling.
      progress: report progress on standard error (see :func:`run_audit_suite`).

    Returns:
      Markdown: one value table, then one gradient table per direction.
    """
    total = 4 * len(TOPK_AUDIT)
    with progress_bar(total=total, desc="top-k audit", enabled=progress) as bar:
        return _topk_section(quick=quick, seed=seed, progress=progress, bar=bar)


def _topk_section(*, quick: bool, seed: int, progress: bool, bar: Any) -> str:
    """:func:`topk_audit_section`, advancing ``bar`` by one per audit (4 per estimator)."""
    k = 6
    testbed = CategoricalTestbed.random(64, scale=2.0, seed=seed)
    trials, grad_trials = (100, 150) if quick else (2000, 2000)

    def each(audit: Callable, direction: str, **kw) -> list:
        """``audit`` of every estimator of TOPK_AUDIT claiming KL(direction)."""
        out = []
        for est in TOPK_AUDIT:
            fn = topk_estimate_fn(est, testbed, k=k, direction=direction)
            if audit is audit_grad:
                fn = _batch_mean(fn)
            bar.set_postfix_str(f"topk:{est} {'value' if audit is audit_value else 'gradient'}")
            out.append(audit(fn, testbed, direction=direction, seed=seed, progress=progress, **kw))
            bar.update(1)
        return out

    values = [
        a
        for direction in ("pi||ref", "ref||pi")
        for a in each(audit_value, direction, batch_size=16, n_trials=trials)
    ]
    parts = [
        f"## Top-k distillation (`kl_from_topk`): the teacher known by its top {k} of "
        f"{testbed.logits.numel()} log-probs\n\n"
        "`truncated*` are what peers compute (biased), `tail-bucket` a lower bound, "
        "`unbiased*` unbiased in value and gradient.\n\n" + format_value_audits(values) + "\n"
    ]
    for direction in ("pi||ref", "ref||pi"):
        grads = each(audit_grad, direction, batch_size=8, n_trials=grad_trials)
        parts.append(
            f"### Top-k gradients claiming KL({direction}) (batches of 8, {grad_trials} trials)\n\n"
            + format_grad_audits(grads)
            + "\n"
        )
    return "".join(parts)


def run_audit_suite(*, quick: bool = False, seed: int = 0, progress: bool = False) -> str:
    """The library's audit plan, as markdown (what ``klest audit`` prints).

    Value estimators (``VALUE_AUDIT``) in both directions on a Gaussian (Schulman's mu = 1),
    a random categorical and a tabular autoregressive testbed (with ``SEQUENCE_VALUE_AUDIT`` also
    at the sequence level there), batches of 16; then the gradient estimators of ``GRAD_AUDIT``
    on a tabular autoregressive policy (V = 3, T = 4, with eos), batches of 8, and those of
    ``REPARAMETERIZED_GRAD_AUDIT`` on reparameterized samples of a 4-dimensional Gaussian; then
    the top-k distillation estimators (:func:`topk_audit_section`).

    Args:
      quick: 200 value trials and 300 gradient trials instead of 2000 each.
      seed: seeds the random testbeds and every audit's sampling.
      progress: report progress on standard error: a bar (tqdm, on a terminal) or a line every
        few seconds, counting the audits done (and the trials of the running one).

    Returns:
      Markdown: a value table, then one gradient table per direction.
    """
    testbeds = [
        GaussianTestbed.schulman(1.0),
        CategoricalTestbed.random(6, scale=1.0, seed=seed),
        TabularAutoregressive.random(3, 4, eos=2, seed=seed),
    ]
    n_values = sum(
        2 * (len(VALUE_AUDIT) + len(SEQUENCE_VALUE_AUDIT) * isinstance(tb, TabularAutoregressive))
        for tb in testbeds
    )
    n_grads = sum(map(len, GRAD_AUDIT.values())) + 2 * len(REPARAMETERIZED_GRAD_AUDIT)
    total = n_values + n_grads + 4 * len(TOPK_AUDIT)
    with progress_bar(total=total, desc="klest audit", enabled=progress) as bar:
        return _suite(testbeds, quick=quick, seed=seed, progress=progress, bar=bar)


def _suite(testbeds: list, *, quick: bool, seed: int, progress: bool, bar: Any) -> str:
    """:func:`run_audit_suite` on ``testbeds``, advancing ``bar`` by one per audit."""

    def step(label: str, audit: Callable, *args: Any, **kw: Any) -> Any:
        bar.set_postfix_str(label)
        out = audit(*args, seed=seed, progress=progress, **kw)
        bar.update(1)
        return out

    trials = 200 if quick else 2000
    audits = []
    for tb in testbeds:
        plan = [(spec, "token") for spec in VALUE_AUDIT]
        if isinstance(tb, TabularAutoregressive):
            plan += [(spec, "sequence") for spec in SEQUENCE_VALUE_AUDIT]
        for direction in ("pi||ref", "ref||pi"):
            for spec, level in plan:
                audits.append(
                    step(
                        f"{spec} {tb.name} {direction}",
                        audit_value,
                        spec,
                        tb,
                        direction=direction,
                        level=level,
                        batch_size=16,
                        n_trials=trials,
                    )
                )
    parts = [
        "## Value estimators (bias against the exact KL)\n\n",
        "On sequences, token-level values of KL(ref||pi) are biased (their prefixes come from pi,"
        " not ref); the `@sequence` rows apply the estimator to the whole-sequence log-ratio.\n\n",
        format_value_audits(audits) + "\n",
    ]
    tabular = TabularAutoregressive.random(3, 4, eos=2, seed=seed, scale=0.7)
    grad_trials = 300 if quick else 2000
    for direction, specs in GRAD_AUDIT.items():
        grads = [
            step(
                f"{spec} {direction}",
                audit_grad,
                spec,
                tabular,
                direction=direction,
                batch_size=8,
                n_trials=grad_trials,
            )
            for spec in specs
        ]
        parts.append(
            f"## Gradient estimators claiming KL({direction}) on a tabular autoregressive "
            f"policy (V=3, T=4, eos; exact KL {float(tabular.exact_kl(direction).detach()):.3f};"
            f" batches of 8, {grad_trials} trials)\n\n"
        )
        parts.append(format_grad_audits(grads) + "\n")
    gaussian = GaussianTestbed(mean=0.3, log_std=0.1, mean_ref=0.0, log_std_ref=0.0, dim=4)
    for direction in ("pi||ref", "ref||pi"):
        grads = [
            step(
                f"{spec} {direction}",
                audit_grad,
                spec,
                gaussian,
                direction=direction,
                batch_size=8,
                n_trials=grad_trials,
            )
            for spec in REPARAMETERIZED_GRAD_AUDIT
        ]
        parts.append(
            f"## Pathwise gradient estimators claiming KL({direction}) on reparameterized "
            f"samples of a Gaussian (D=4; exact KL "
            f"{float(gaussian.exact_kl(direction).detach()):.3f}; batches of 8, "
            f"{grad_trials} trials)\n\n"
        )
        parts.append(format_grad_audits(grads) + "\n")
    parts.append(_topk_section(quick=quick, seed=seed, progress=progress, bar=bar))
    return "".join(parts)
