r"""The top-k distillation estimators in the audit suite (``klest audit``).

:func:`klest.logits.topk.kl_from_topk` sees the teacher only through its top-k log-probs and the
log-prob of the sampled token. Here a :class:`~klest.testbeds.CategoricalTestbed` plays both
models (its ``ref`` is the teacher, stored as its top-k), so each estimator's value and gradient
are audited against the exact full KL and its exact gradient with :func:`klest.audit.audit_value`
and :func:`klest.audit.audit_grad`: ``truncated`` and ``truncated-raw`` are biased (what peers
compute), ``tail-bucket`` is biased low (a lower bound), ``unbiased`` and ``unbiased-cv`` are
unbiased in value and gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from klest.audit import audit_grad, audit_value, format_grad_audits, format_value_audits
from klest.logits.topk import kl_from_topk
from klest.testbeds import CategoricalTestbed
from klest.testbeds.base import Sample

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
      graph to the testbed's parameters (for :func:`klest.audit.audit_grad`).

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
    """The batch loss of a per-sample estimate (what :func:`klest.audit.audit_grad` takes)."""

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
      progress: show progress bars (when tqdm is installed).

    Returns:
      Markdown: one value table, then one gradient table per direction.
    """
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
            out.append(audit(fn, testbed, direction=direction, seed=seed, progress=progress, **kw))
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
