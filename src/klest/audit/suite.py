r"""The library's audit plan (what ``klest audit`` prints), built on :mod:`klest.audit.core`.

:func:`run_audit_suite` audits every value estimator on every testbed, every gradient estimator
on a tabular autoregressive policy and the pathwise ones on a Gaussian, then the top-k
distillation estimators (:func:`topk_audit_section`), the trust region at the sampler and the
variational bounds.

Top-k: :func:`klest.logits.topk.kl_from_topk` sees the teacher only through its top-k log-probs
and the log-prob of the sampled token. Here a :class:`~klest.testbeds.CategoricalTestbed` plays
both models (its ``ref`` is the teacher, stored as its top-k), so each estimator's value and
gradient are audited against the exact full KL and its exact gradient with
:func:`~klest.audit.audit_value` and :func:`~klest.audit.audit_grad`: ``truncated`` and
``truncated-raw`` are biased (what peers compute), ``generalized`` (the unnormalized KL of the
measures restricted to the top-k) and ``tail-bucket`` are biased low (lower bounds, the first
below the second), ``unbiased`` and ``unbiased-cv`` are unbiased in value and gradient.

The trust region at the sampler (:func:`trust_region_audit_section`): divergences between a
policy and the rollout policy that sampled its tokens (:mod:`klest.sampled.trust_region`), on
testbeds whose samples come from the rollout (:func:`sampler_testbed`). Enumerating the token
(or the sequence) under the rollout gives each estimate's exact mean and mean gradient: DPPO's
binary and top-k divergences are lower bounds of the full divergence, and their gradients those
of their own means; ``half-abs-ratio`` and ``k3`` are unbiased in value and gradient.

The variational bounds (:func:`variational_audit_section`): :func:`klest.iwae_bound` and
:func:`klest.renyi_bound` on a :class:`~klest.testbeds.VariationalGaussian`, each gradient's
mean against the exact gradient of the mean bound (a K-dimensional quadrature): ``pathwise``
and ``dreg`` follow it, ``stl`` only at K = 1 (and at the optimum, where STL's and DReG's
encoder gradients are exactly 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from klest._progress import progress_bar
from klest.audit.core import (
    audit_grad,
    audit_value,
    format_grad_audits,
    format_value_audits,
    gradient_draws,
    mean_shift_z,
)
from klest.logits.topk import kl_from_topk
from klest.sampled.estimators import f_divergence, kl_estimate
from klest.sampled.importance_weighted import renyi_bound
from klest.sampled.trust_region import (
    binary_kl,
    binary_tv,
    squared_log_ratio,
    squared_prob_shift,
    topk_kl,
    topk_tv,
)
from klest.testbeds import (
    CategoricalTestbed,
    GaussianTestbed,
    OffPolicyTestbed,
    TabularAutoregressive,
    VariationalGaussian,
)
from klest.testbeds.base import Sample

__all__ = [
    "GRAD_AUDIT",
    "GRAD_AUDIT_BOTH",
    "GRAD_AUDIT_ONLY",
    "REPARAMETERIZED_GRAD_AUDIT",
    "SEQUENCE_VALUE_AUDIT",
    "TOPK_AUDIT",
    "TRUST_REGION_AUDIT",
    "VALUE_AUDIT",
    "VARIATIONAL_AUDIT",
    "bound_loss_fn",
    "run_audit_suite",
    "sampler_testbed",
    "topk_audit_section",
    "topk_estimate_fn",
    "trust_region_audit_section",
    "trust_region_estimate_fn",
    "variational_audit_section",
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
        "k1/cumulative;discount=0.5",
        "rb/rb;discount=0.5",
        "k1/token;power=0.5",
        "k1/cumulative;power=0.5",
        "k1/token;power=1",
        "k1/cumulative+value",
        "k1/cumulative;weights=clipped-ratio",
        "k1/cumulative;weights=clipped-prefix-ratio",
        "rb/rb;weights=clipped-prefix-ratio",
        "rb/rb;weights=clipped-ratio",
    ),
    "ref||pi": (),
}
"""Gradient estimators the suite checks on that policy for one claimed KL only, per direction.

``+value`` is a critic's baseline passed as a tensor (the exact expected future KL from each
prefix): unbiased. ``;weights=RULE`` weights each token's penalty
(:data:`~klest.audit.WEIGHT_RULES`); the mean gradient is then also tested against the policy
gradient of the weighted penalties held fixed (:meth:`~klest.audit.GradSpec.objective`), which
``cumulative`` follows for either rule and ``rb``
only for weights that read the tokens before their own."""
GRAD_AUDIT = {direction: GRAD_AUDIT_BOTH + only for direction, only in GRAD_AUDIT_ONLY.items()}
"""Gradient estimators (:class:`~klest.audit.GradSpec` strings) the suite checks on a tabular
autoregressive policy, per claimed direction: ``GRAD_AUDIT_BOTH`` then that direction's
``GRAD_AUDIT_ONLY``."""
REPARAMETERIZED_GRAD_AUDIT = ("k1/pathwise", "k3/autodiff", "k3/adaptive")
"""Pathwise gradient estimators, audited on reparameterized Gaussian samples in both
directions."""


TOPK_AUDIT = (
    "truncated",
    "truncated-raw",
    "generalized",
    "tail-bucket",
    "unbiased",
    "unbiased-cv",
)
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
        "`truncated*` are what peers compute (biased), `generalized` and `tail-bucket` lower "
        "bounds (deterministic: the first below the second), "
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
    the top-k distillation estimators (:func:`topk_audit_section`), the divergences between
    a policy and its rollout policy (:func:`trust_region_audit_section`) and the K-sample
    variational bounds (:func:`variational_audit_section`).

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
    parts.append(trust_region_audit_section(quick=quick, seed=seed, progress=progress))
    parts.append(variational_audit_section(quick=quick, seed=seed, progress=progress))
    return "".join(parts)


# -- the trust region at the sampler ------------------------------------------------------------

TRUST_REGION_AUDIT = (
    "binary-tv",
    "topk-tv",
    "half-abs-ratio",
    "binary-kl",
    "topk-kl",
    "k3",
    "squared-log-ratio",
    "squared-prob-shift",
)
"""The estimates of a divergence between pi and its rollout policy the audit suite checks
(:func:`trust_region_estimate_fn`): DPPO's binary and top-k TV and KL, Kimi's squared log-ratio
(with tau = 1/2), DRPO's squared probability shift, and the unbiased references from the same
log-probs, ``half-abs-ratio`` (the TV) and ``k3`` (the KL)."""

_TR_TARGET = {
    "binary-tv": "TV",
    "topk-tv": "TV",
    "half-abs-ratio": "TV",
    "squared-prob-shift": "L2^2",
}
"""What each estimate is compared with (the KL of its ``direction`` where not listed)."""


def trust_region_estimate_fn(
    estimator: str, *, direction: str = "rollout||pi", k: int = 4
) -> Callable[[Sample], Tensor]:
    r"""A per-row estimate ``[n]`` of a divergence between pi and the policy that sampled.

    The :class:`~klest.testbeds.Sample` is read as the trust-region setting: its tokens were
    drawn from the rollout policy, ``logp`` is pi's log-prob (with graph), ``logp_ref`` the
    rollout's, ``logits_ref`` the rollout's full log-probs (its top-k are taken from them),
    ``logits`` pi's. An :class:`~klest.testbeds.OffPolicyTestbed` whose target's ref and whose
    behavior are the rollout policy gives such samples (:func:`sampler_testbed`). Rows are
    sequences (token sums) or single tokens.

    Estimators (:data:`TRUST_REGION_AUDIT`): ``binary-tv``, ``topk-tv``, ``binary-kl``,
    ``topk-kl`` (:func:`klest.binary_tv` ... with the top ``k`` and the sampled token),
    ``squared-log-ratio`` (:func:`klest.squared_log_ratio`, :math:`\tau = 1/2`),
    ``squared-prob-shift`` (:func:`klest.squared_prob_shift`), ``half-abs-ratio``
    (:math:`\tfrac12|\pi/\mu - 1|`, unbiased for the TV, through :func:`klest.f_divergence`) and
    ``k3`` (:func:`klest.kl_estimate` with the rollout as the sampler: :math:`r - 1 - \log r`
    for ``"rollout||pi"``, :math:`r\log r - (r - 1)` for ``"pi||rollout"``, :math:`r = \pi/\mu`;
    unbiased for the KL).

    Args:
      estimator: one of :data:`TRUST_REGION_AUDIT`.
      direction: ``"rollout||pi"`` or ``"pi||rollout"`` (the KLs only).
      k: the rollout's top-k kept by the top-k divergences.

    Returns:
      A function from a :class:`~klest.testbeds.Sample` of n rows to n estimates, with the graph
      to pi's parameters.

    Example:
      >>> tb = sampler_testbed(seed=0)
      >>> s = tb.sample(3, generator=klest.testbeds.make_generator(0))
      >>> trust_region_estimate_fn("topk-kl", k=2)(s).shape
      torch.Size([3])
    """
    if estimator not in TRUST_REGION_AUDIT:
        raise ValueError(f"estimator must be one of {TRUST_REGION_AUDIT}, got {estimator!r}")
    if direction not in ("rollout||pi", "pi||rollout"):
        raise ValueError(f"direction must be 'rollout||pi' or 'pi||rollout', got {direction!r}")

    def estimate(sample: Sample) -> Tensor:
        assert sample.logits is not None and sample.logits_ref is not None
        lp, lq, mask = sample.logp, sample.logp_ref, sample.mask
        common = {"mask": mask, "reduction": "per-sequence"}
        if estimator.startswith("topk"):
            assert sample.x is not None
            top, ids = sample.logits_ref.detach().topk(k, dim=-1)
            fn = topk_tv if estimator == "topk-tv" else topk_kl
            extra = {} if estimator == "topk-tv" else {"direction": direction}
            return fn(
                lp, lq, top, logits=sample.logits, topk_ids=ids, labels=sample.x, **extra, **common
            )
        if estimator == "binary-tv":
            return binary_tv(lp, lq, **common)
        if estimator == "binary-kl":
            return binary_kl(lp, lq, direction=direction, **common)
        if estimator == "squared-log-ratio":
            return squared_log_ratio(lp, lq, tau=0.5, **common)
        if estimator == "squared-prob-shift":
            return squared_prob_shift(lp, lq, **common)
        if estimator == "half-abs-ratio":  # f(r) = |r - 1| / 2 of r = pi / rollout
            return f_divergence(lq, lp, f=lambda r: 0.5 * (r - 1).abs(), f_prime_at_1=0.0, **common)
        klest_direction = "pi||ref" if direction == "rollout||pi" else "ref||pi"
        return kl_estimate(lq, lp, estimator="k3", direction=klest_direction, **common)

    estimate.__name__ = f"sampler:{estimator}" + (
        "" if estimator in _TR_TARGET else f"({direction})"
    )
    return estimate


def sampler_testbed(
    *, outcomes: int = 32, scale: float = 2.0, shift: float = 0.5, seed: int = 0
) -> OffPolicyTestbed:
    """A categorical policy and its rollout policy, samples drawn from the rollout.

    pi's logits are N(0, scale^2); the rollout's are pi's plus N(0, shift^2) noise (a mismatched
    inference engine, or a policy a few steps stale). The testbed's exact KLs are pi's against
    the rollout (``"pi||ref"`` is KL(pi||rollout), ``"ref||pi"`` KL(rollout||pi)); its samples
    come from the rollout and carry its log-probs as ``logp_ref``.

    Args:
      outcomes: the number of outcomes (the vocabulary).
      scale: the spread of pi's logits.
      shift: the spread of the rollout's difference from pi.
      seed: seeds both.

    Returns:
      An :class:`~klest.testbeds.OffPolicyTestbed`: target (pi, rollout), behavior the rollout.
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(outcomes, generator=g, dtype=torch.float64) * scale
    zr = z + torch.randn(outcomes, generator=g, dtype=torch.float64) * shift
    return OffPolicyTestbed(CategoricalTestbed(z, zr), CategoricalTestbed(zr, zr))


def _full_divergence(target: str, direction: str, logits: Tensor, logits_rollout: Tensor):
    """The full-vocabulary divergence an estimate is compared with, differentiable in pi."""
    lp, lq = torch.log_softmax(logits, -1), torch.log_softmax(logits_rollout, -1)
    if target == "TV":
        return 0.5 * (lp.exp() - lq.exp()).abs().sum()
    if target == "L2^2":
        return ((lp.exp() - lq.exp()) ** 2).sum()
    la, lb = (lq, lp) if direction == "rollout||pi" else (lp, lq)
    return (la.exp() * (la - lb)).sum()


def _exact_row(name: str, direction: str, k: int, target: CategoricalTestbed) -> str:
    """One row of the exact table: every outcome enumerated under the rollout."""
    fn = trust_region_estimate_fn(name, direction=direction, k=k)
    n = target.logits.numel()
    with torch.enable_grad():
        values = fn(target.evaluate(torch.arange(n)))
        weights = torch.softmax(target.logits_ref, -1)
        mean = (weights * values).sum()
        (grad,) = torch.autograd.grad(mean, target.logits)
        goal = _TR_TARGET.get(name, "KL")
        full = _full_divergence(goal, direction, target.logits, target.logits_ref)
        (full_grad,) = torch.autograd.grad(full, target.logits)
    mean, full = mean.detach(), full.detach()
    std = float((weights.detach() * (values.detach() - mean) ** 2).sum().sqrt())
    cos = float(grad @ full_grad / (grad.norm() * full_grad.norm()))
    label = name if goal != "KL" else f"{name} ({direction})"
    what = goal if goal != "KL" else f"KL({direction})"
    return (
        f"| {label} | {what} | {float(full):.5g} | {float(mean):.5g} | "
        f"{float(mean) / float(full):.3f} | {std:.4g} | {cos:+.4f} | "
        f"{float(grad.norm() / full_grad.norm()):.3f} | "
        f"{float((grad - full_grad).norm() / full_grad.norm()):.2e} |"
    )


def _sequence_row(name: str, k: int, target: TabularAutoregressive) -> str:
    """One row of the exact sequence table: every sequence enumerated under the rollout."""
    fn = trust_region_estimate_fn(name, direction="rollout||pi", k=k)
    tokens, _ = target.all_sequences()
    with torch.enable_grad():
        sample = target.evaluate(tokens)
        mask = sample.mask
        log_mu = sample.logp_ref if mask is None else torch.where(mask, sample.logp_ref, 0.0)
        weights = log_mu.sum(-1).exp()
        mean = (weights * fn(sample)).sum()
        (grad,) = torch.autograd.grad(mean, target.logits)
        full = target.exact_kl("ref||pi")
        (full_grad,) = torch.autograd.grad(full, target.logits)
    mean, full = mean.detach(), full.detach()
    grad, full_grad = grad.reshape(-1), full_grad.reshape(-1)
    cos = float(grad @ full_grad / (grad.norm() * full_grad.norm()))
    return (
        f"| {name} (rollout||pi) | {float(full):.5g} | {float(mean):.5g} | "
        f"{float(mean) / float(full):.3f} | "
        f"{cos:+.4f} | {float((grad - full_grad).norm() / full_grad.norm()):.2e} |"
    )


def trust_region_audit_section(
    *, quick: bool = False, seed: int = 0, progress: bool = False
) -> str:
    r"""The audit suite's section on divergences between pi and its rollout policy, as markdown.

    Three parts. (1) Exact, by enumerating the token under the rollout on
    :func:`sampler_testbed` (32 outcomes, pi's logits N(0, 2^2), the rollout's shifted by
    N(0, 0.5^2)): each estimate's exact mean against the full-vocabulary divergence it
    approximates (the TV, a KL, or the squared Euclidean distance), the spread of one token's
    value, and the exact mean gradient against the divergence's gradient (cosine, norm ratio,
    relative distance). (2) Exact, by enumerating sequences of a tabular autoregressive pair
    (V = 4, T = 3, eos; the rollout's table shifted by N(0, 0.5^2)): token sums against the
    sequence-level KL(rollout||pi). (3) Monte Carlo, :func:`~klest.audit.audit_value` and
    :func:`~klest.audit.audit_grad` on the categorical pair, for the estimates that claim a KL
    (the testbed's ``ref`` is the rollout).

    Args:
      quick: 50 value and 50 gradient trials instead of 2000 each.
      seed: seeds the testbeds and the sampling.
      progress: show progress bars (when tqdm is installed).

    Returns:
      Markdown: two exact tables, a value table and a gradient table.
    """
    k = 4
    testbed = sampler_testbed(seed=seed)
    target = testbed.target
    assert isinstance(target, CategoricalTestbed)
    plan = [(name, "rollout||pi") for name in TRUST_REGION_AUDIT]
    plan += [(n, "pi||rollout") for n in ("binary-kl", "topk-kl", "k3")]
    rows = [_exact_row(name, direction, k, target) for name, direction in plan]
    parts = [
        "## The trust region at the sampler: divergences between pi and its rollout policy\n\n"
        f"Tokens sampled from the rollout policy; a categorical pi of {target.logits.numel()} "
        f"outcomes and its rollout, exact by enumeration; top-k with k = {k} plus the sampled "
        "token. Binary and top-k are lower bounds of the full divergence for every token "
        "(mean / full < 1); `half-abs-ratio` and `k3` are unbiased. Every mean gradient is the "
        "gradient of the estimate's own mean (tokens from the rollout need no score term): "
        "that of the full divergence only where the estimate is unbiased.\n\n"
        "| estimate | compared with | full | exact mean | mean / full | std of one token "
        "| cos(E∇, ∇full) | ‖E∇‖ / ‖∇full‖ | ‖E∇ − ∇full‖ / ‖∇full‖ |\n"
        "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
    ]
    g = torch.Generator().manual_seed(seed)
    seq_pi = TabularAutoregressive.random(4, 3, eos=3, seed=seed, scale=1.5)
    shifted = seq_pi.logits.detach() + 0.5 * torch.randn(
        seq_pi.logits.shape, generator=g, dtype=seq_pi.logits.dtype
    )
    seq_target = TabularAutoregressive(seq_pi.logits.detach(), shifted, horizon=3, eos=3)
    seq_rows = [
        _sequence_row(name, 1, seq_target)
        for name in ("binary-kl", "topk-kl", "k3", "squared-log-ratio")
    ]
    parts.append(
        "### Sequences: token sums against the sequence-level KL(rollout||pi)\n\n"
        "A tabular autoregressive pi (V = 4, T = 3, eos) and its rollout, every sequence "
        "enumerated; top-k with k = 1 plus the sampled token. Prefixes come from the rollout, "
        "so the token sum of the full per-position KL(rollout||pi) is the sequence KL.\n\n"
        "| estimate | sequence KL | exact mean | mean / KL | cos(E∇, ∇KL) "
        "| ‖E∇ − ∇KL‖ / ‖∇KL‖ |\n|---|---|---|---|---|---|\n" + "\n".join(seq_rows) + "\n\n"
    )
    trials = 50 if quick else 2000
    claims = [(n, "rollout||pi") for n in ("binary-kl", "topk-kl", "k3", "squared-log-ratio")]
    claims += [(n, "pi||rollout") for n in ("binary-kl", "topk-kl", "k3")]
    values, grads = [], []
    for name, direction in claims:
        fn = trust_region_estimate_fn(name, direction=direction, k=k)
        claim = "ref||pi" if direction == "rollout||pi" else "pi||ref"
        common = {"direction": claim, "seed": seed, "progress": progress}
        values.append(audit_value(fn, testbed, batch_size=16, n_trials=trials, **common))
        grads.append(audit_grad(_batch_mean(fn), testbed, batch_size=8, n_trials=trials, **common))
    parts.append(
        "### Monte Carlo: the estimates that claim a KL (the testbed's ref is the rollout: "
        "KL(ref||pi) = KL(rollout||pi))\n\n"
        + format_value_audits(values)
        + "\n"
        + f"Gradients (batches of 8, {trials} trials):\n\n"
        + format_grad_audits(grads)
        + "\n"
    )
    return "".join(parts)


# -- variational bounds ---------------------------------------------------------------------------

VARIATIONAL_AUDIT = ((0.0, 1), (0.0, 2), (0.0, 3), (0.5, 2))
"""The (alpha, K) of :func:`klest.renyi_bound` (alpha = 0: :func:`klest.iwae_bound`) the audit
suite checks, each with the gradients ``pathwise``, ``stl`` and ``dreg``
(:func:`variational_audit_section`)."""

_BOUND_GRADS = ("pathwise", "stl", "dreg")


def _bound_name(alpha: float, k: int) -> str:
    return f"IWAE_{k}" if alpha == 0.0 else f"L_{alpha:g},{k}"


def bound_loss_fn(alpha: float, grad: str) -> Callable[[Sample], Tensor]:
    r"""The loss :math:`-\mathcal L_{\alpha,K}` of a batch of a
    :class:`~klest.testbeds.VariationalGaussian` (its data points' mean), with ``grad``'s gradient.

    Args:
      alpha: the Rényi order (0: IWAE).
      grad: ``"pathwise"``, ``"stl"`` or ``"dreg"``.

    Returns:
      A function from a :class:`~klest.testbeds.Sample` (``logp`` ``[n, K]``, ``x`` the samples)
      to the scalar loss, for :func:`~klest.audit.audit_grad`.
    """

    def loss(sample: Sample) -> Tensor:
        return -renyi_bound(
            sample.logp,
            sample.logp_ref,
            alpha=alpha,
            grad=grad,  # type: ignore[arg-type]
            samples=sample.x,
            logp_stl=sample.logp_stl,
        )

    loss.__name__ = f"{'iwae' if alpha == 0.0 else f'renyi:{alpha:g}'}/{grad}"
    return loss


def variational_audit_section(*, quick: bool = False, seed: int = 0, progress: bool = False) -> str:
    r"""The audit suite's section on the K-sample variational bounds, as markdown.

    On a :class:`~klest.testbeds.VariationalGaussian` (1-D latent; pi = N(0.5, e^{0.4}) against
    the joint 3 N(0, 1), the model's mean theta trainable), for each (alpha, K) of
    :data:`VARIATIONAL_AUDIT` and each gradient, :func:`~klest.audit.audit_grad` of the loss
    :math:`-\mathcal L_{\alpha,K}` with the objective :math:`-E[\mathcal L_{\alpha,K}]`,
    whose exact gradient is the testbed's K-dimensional Gauss-Hermite quadrature (60 nodes; its
    change from 60 to 80 nodes is printed). Here ref is the posterior, so KL(pi||ref) is the
    ELBO's gap, the objective at K = 1. Then, at the optimum (pi the posterior, K = 2), each
    gradient's spread on the encoder's parameters: STL's and DReG's are exactly 0.

    Args:
      quick: 100 trials instead of 2000.
      seed: seeds the sampling.
      progress: show progress bars.

    Returns:
      Markdown: the quadrature's convergence, a gradient table and the optimum's table.
    """
    trials = 100 if quick else 2000
    audits, converged = [], []
    for alpha, k in VARIATIONAL_AUDIT:
        tb = VariationalGaussian(k=k, mean=0.5, log_std=0.2, mean_ref=0.0)
        exact = -tb.exact_bound_grad(alpha, nodes=60)
        finer = -tb.exact_bound_grad(alpha, nodes=80)
        converged.append(
            f"| {_bound_name(alpha, k)} | {-float(tb.exact_bound(alpha).detach()):.12f} | "
            f"{float((finer - exact).norm() / exact.norm()):.1e} |"
        )
        objective = (f"-E[{_bound_name(alpha, k)}]", exact)
        for grad in _BOUND_GRADS:
            fn = bound_loss_fn(alpha, grad)
            audits.append(
                audit_grad(
                    fn,
                    tb,
                    batch_size=32,
                    n_trials=trials,
                    seed=seed,
                    progress=progress,
                    name=f"{fn.__name__} K={k}",
                    objective=objective,
                )
            )
    optimum = VariationalGaussian(k=2, mean=0.3, log_std=-0.1, mean_ref=0.3, log_std_ref=-0.1)
    rows = []
    for grad in _BOUND_GRADS:
        fn = bound_loss_fn(0.0, grad)
        draws = gradient_draws(fn, optimum, batch_size=32, n_trials=trials, seed=seed)
        encoder = draws[:, : 2 * optimum.dim]
        rows.append(
            f"| {fn.__name__} K=2 | {float(encoder.abs().max()):.3g} | "
            f"{float(encoder.var(0).sum()):.4g} | "
            f"{mean_shift_z(draws, torch.zeros(draws.shape[1], dtype=draws.dtype)):.1f} |"
        )
    return (
        "## Variational bounds (`iwae_bound`, `renyi_bound`): K samples per data point\n\n"
        "A 1-D Gaussian encoder pi against an unnormalized Gaussian joint (Z = 3, the model's "
        "mean trainable); the loss is minus the bound. Here ref is the posterior: KL(pi||ref) "
        "= log Z - ELBO, the objective at K = 1. The objective's exact gradient, that of "
        "-E[bound], is a K-dimensional Gauss-Hermite quadrature (60 nodes; relative change of "
        "the gradient at 80 nodes):\n\n"
        "| bound | -E[bound] | change at 80 nodes |\n|---|---|---|\n"
        + "\n".join(converged)
        + f"\n\nGradients (batches of 32 data points, {trials} trials): pathwise and DReG descend "
        "-E[bound]; STL only at K = 1.\n\n"
        + format_grad_audits(audits)
        + "\nAt the optimum (pi the posterior, K = 2): every gradient's mean is 0; STL's and "
        "DReG's are exactly 0 on the encoder's parameters for every draw.\n\n"
        "| estimator | max \\|∇ encoder\\| | variance on the encoder | z(zero) |\n"
        "|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
    )
