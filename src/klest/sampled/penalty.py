r"""The KL term to add to a training loss: a value estimator and a gradient estimator, chosen apart.

:func:`kl_penalty` returns ``decouple(value, surrogate)``: its forward value is the chosen value
estimator's, its gradient the chosen gradient estimator's. Notation: samples
:math:`y \sim \pi` (or ``behavior``), tokens :math:`t`, the per-token log-ratio
:math:`\rho_t = \log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t})`, the score
:math:`s_t = \nabla\log\pi(y_t|y_{<t})`, the sequence ratio
:math:`R = \prod_t ref/\pi = e^{-\sum_t\rho_t}` and prefix ratio :math:`R_{\le t}`, importance
weights :math:`W_{\le t} = \prod_{u\le t}\pi/behavior` (1 on-policy), a baseline :math:`b`, and
the exact per-position KL :math:`KL_n` between the next-token distributions (from logits).

Gradient estimators (``grad=``; the table ``GRADIENT_ESTIMATORS`` holds each one's rules):

============== ============================================================ =====================
``grad``       surrogate gradient per sequence                              mean
============== ============================================================ =====================
``pathwise``   autodiff of the direction's k1 through reparameterized x     grad of the KL
``stl``        same with log pi's parameters stopped ("sticking the         grad KL(pi||ref)
               landing"; drops a zero-mean term)
``adaptive``   autodiff of k1 + c (k3 - k1), c fitted on the other rows to  grad of the KL
               lower the variance (:mod:`klest.sampled.baselines`)
``score``      KL(pi||ref): :math:`W (\sum_t s_t)(\sum_u \rho_u - b)`;      grad of the KL
               KL(ref||pi): :math:`-W (\sum_t s_t)(R - b)`
``cumulative`` KL(pi||ref): :math:`\sum_t s_t (\sum_{u\ge t} W_{\le u}          grad of the KL
               \rho_u - W_{\le t} b_t)`; KL(ref||pi): :math:`-\sum_t s_t
               W_{\le t}(R_{\le t} - b_t)`
``rb``         KL(pi||ref): :math:`\sum_n W_{<n}\nabla KL_n + \sum_m s_m     grad of the KL
               (\sum_{n>m} W_{<n} KL_n - W_{\le m} b_m)`; KL(ref||pi):
               :math:`\sum_n W_{<n} R_{<n} \nabla KL_n`
``token``      :math:`\sum_t s_t w_t\rho_t` (what k2-per-token losses give)  biased for T > 1
``autodiff``   autodiff of the value estimator itself (TRL/verl's k3 loss)  see below
============== ============================================================ =====================

``token``'s mean is :math:`\sum_t E_{y_{<t}}[\nabla KL_t(y_{<t})]`: the gradients of the
per-position KLs with the prefix distribution held fixed, prefixes drawn from the sampler. It
misses each token's effect on the later ones, so it is not the gradient of the sequence KL for
T > 1.

``autodiff`` on sampled (not reparameterized) tokens: k1 has mean gradient 0; k3 and cv descend
:math:`\sum_t E_{y_{<t}\sim\pi} KL(ref_t\|\pi_t)` (the *other* direction, token by token); k2
gives ``token``; rb gives only the first (pathwise) sum of ``rb``. On reparameterized samples it
is the pathwise gradient of the value (unbiased for an unbiased value; k3's has exploding variance
in high dimensions, which is why the Chimera estimator takes k3's value and k1's gradient).

Baselines (``baseline=``) apply to ``score``, ``cumulative`` and ``rb`` (KL(pi||ref)): see
:mod:`klest.sampled.baselines`. Per-position baselines align completions at their first valid
token, so left- and right-padded batches give the same loss and gradient.

The exact-KL baselines (``"exact-kl"``, ``"exact-kl+loo"``; KL(pi||ref), ``cumulative`` and
``token``, with ``logits``/``logits_ref`` or ``position_kls``) subtract from token t's target
the exact :math:`KL_t(y_{<t}) = E[\rho_t|y_{<t}]`, the value function of the per-token reward
:math:`-\rho_t`. On-policy distillation with a per-token reward is ``grad="token"`` (each
token's own log-ratio), and ``grad="token", baseline="exact-kl"`` is vOPD's estimator,
:math:`\sum_t s_t (\rho_t - KL_t)`; ``grad="cumulative", baseline="exact-kl"`` is
:math:`\sum_t s_t (\sum_{u\ge t} \rho_u - KL_t)`, unbiased for the sequence KL, and
``"exact-kl+loo"`` adds the other samples' mean residual :math:`\sum_{u\ge t}\rho_u - KL_t`
(the expected future KLs, which the logits do not give). ``rb`` already replaces each
:math:`\rho_t` by :math:`KL_t` (its score terms start after t), so it takes ``"loo"`` instead.

References:
  "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi Munos
  (2025, https://arxiv.org/abs/2506.09477): autodiff pitfalls, cumulative, leave-one-out.
  "Better Estimation of the Kullback-Leibler Divergence Between Language Models" by Afra Amini,
  Tim Vieira and Ryan Cotterell (NeurIPS 2025, https://arxiv.org/abs/2504.10637): rb.
  "The Chimera Estimator" by Kirato Yoshihara (2026,
  https://kiratoyoshihara.github.io/essays/chimera-kl.html): value and gradient chosen apart.
  "KL for a KL: On-Policy Distillation with Control Variate Baseline" by Minjae Oh, Sangjun
  Song, Gyubin Choi, Yunho Choi and Yohan Jo (2026, https://arxiv.org/abs/2605.07865): the
  exact per-position KL as a baseline (vOPD).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.distributions import Distribution

from klest._checks import (
    ArgumentNames,
    ValueChecks,
    caller_names,
    check_choice,
    check_direction,
    check_finite_surrogate,
    check_flag,
    check_float_tensor,
    check_group,
    check_same_shape,
    first_bad,
    resolve_validate,
    warn_at_caller,
)
from klest._types import (
    DEFAULT_REDUCTION,
    Baseline,
    Direction,
    Estimator,
    Grad,
    Level,
    Reduction,
)
from klest.aggregation import GlobalCounts, KLDiagnostics, WithDetails, check_counts
from klest.sampled.baselines import (
    BaselineEMA,
    LooScaleEMA,
    baseline_scale,
    exact_kl_baseline,
    group_baseline,
    mix_coefficient,
)
from klest.sampled.context_parallel import (
    ContextParallel,
    local_columns,
    whole_sequences,
)
from klest.sampled.control_variates import Alpha
from klest.sampled.distributions import Method, closed_form, resolve
from klest.sampled.groups import group_keys
from klest.sampled.log_ratios import (
    LogRatios,
    check_level,
    exact_position_kls,
    prepare_log_ratios,
)
from klest.sampled.sequence import (
    align_left,
    discounted_sum_from_here,
    first_token,
    prefix_weights,
    sum_from_here,
    unalign,
)
from klest.sampled.tails import tail_check
from klest.sampled.terms import k3_term, naive_term
from klest.sampled.values import Estimate, estimate_rows, rb_weights
from klest.surrogates import join

__all__ = [
    "EXACT_KL_BASELINES",
    "GRADIENT_ESTIMATORS",
    "GradientEstimator",
    "KLGradientWarning",
    "PenaltyDetails",
    "PenaltyTargets",
    "kl_penalty",
    "penalty_targets",
]


class KLGradientWarning(UserWarning):
    """A gradient estimator was chosen whose mean is not the gradient of the stated KL, or no
    gradient can reach the policy."""


class PenaltyDetails(NamedTuple):
    """What :func:`kl_penalty` reports besides the loss (``return_details=True``).

    Attributes:
      per_sequence: the value estimate of each sequence (row), detached, ``logp.shape[:-1]``
        (``[N]`` for 1-D input); 0 for a row with no valid token.
      diagnostics: mean, standard error, fraction of negative values and counts of the value
        estimate under the call's reduction (its ``mean`` is the loss for mean reductions).
      n_singleton_samples: samples (rows with a valid token) with no other such row in their
        group (leave-one-out gives them baseline 0); empty rows are not samples.
      method: ``"log-probs"`` (the samples passed), or for ``torch.distributions`` inputs
        ``"closed-form"`` (``kl_divergence``, its exact gradient) or ``"monte-carlo"``
        (``pi.rsample()``, a pathwise gradient): :mod:`klest.sampled.distributions`.
    """

    per_sequence: Tensor
    diagnostics: KLDiagnostics
    n_singleton_samples: int
    method: Method = "log-probs"


@dataclass(frozen=True)
class SurrogateInputs:
    """What a gradient estimator's surrogate is built from (validated, ``[rows, T]``)."""

    lr: LogRatios
    logp_rows: Tensor  # log pi of each valid token, with graph; 0 where masked
    direction: str
    value: Estimate
    baseline: Baseline | BaselineEMA | LooScaleEMA | Tensor | None
    keys: Tensor | None
    kls: Tensor | None
    stl_delta: Tensor | None
    discount: float = 1.0  # of the later tokens' terms in cumulative and rb targets
    token_weights: Tensor | None = None  # per-token weights of the objective, detached rows
    power: float = 0.0  # Box-Cox power of the per-token rewards in the score coefficients

    @property
    def on_policy(self) -> bool:
        return self.lr.log_w is None

    def rewards(self, d: Tensor) -> Tensor:
        """What the scores are multiplied by per token: the log-ratio, or its Box-Cox power
        transform :math:`(1 - e^{-\alpha\rho_t})/\alpha` (``power=``)."""
        return d if self.power == 0.0 else -torch.expm1(-self.power * d) / self.power

    def weighted(self, x: Tensor) -> Tensor:
        """Per-token terms times the objective's token weights (none: as they are)."""
        return x if self.token_weights is None else x * self.token_weights

    def to_go(self, x: Tensor) -> Tensor:
        """The (discounted) sums from each token on, ``sum_{u >= t} discount^(u - t) x_u``."""
        if self.discount == 1.0:
            return sum_from_here(x)
        return discounted_sum_from_here(x, self.discount)

    def token_estimate(self, values: Tensor) -> Estimate:
        valid = self.lr.valid
        return Estimate(
            values if valid is None else torch.where(valid, values, 0.0), valid, self.lr.layout
        )

    def score_estimate(self, coef: Tensor) -> Estimate:
        """``log pi`` of each valid token times a detached coefficient ``[rows, T]`` (or
        ``[rows, 1]``). Not masked again: ``logp_rows`` is 0 at masked positions, where the mask
        that zeroed it passes no gradient, and a coefficient there is finite unless one at a
        valid position is not (it repeats the targets of the valid positions after it, and
        weights and baselines of earlier ones), which the surrogate check reports."""
        return Estimate(self.logp_rows * coef, self.lr.valid, self.lr.layout)

    def unweighted(self, target: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """``target / w`` for a baseline (off-policy), and where it counts: positions whose
        prefix weight underflowed to 0 (or is 0: pi cannot produce the prefix) neither feed the
        baseline nor take one (``w b = 0`` there)."""
        counted = w > 0
        if self.lr.valid is not None:
            counted = counted & self.lr.valid
        return torch.where(counted, target / torch.where(counted, w, 1.0), 0.0), counted

    def baseline_for(self, targets: Tensor, valid: Tensor | None) -> Tensor | float:
        """The baseline of detached ``targets`` ``[rows, T]``, per position from each row's
        first valid token (so left and right padding agree; ``valid`` None: all count)."""
        if self.baseline is None:
            return 0.0
        if isinstance(self.baseline, Tensor):  # given: rows like the targets, 0 where invalid
            given = self.baseline
            return given if valid is None else torch.where(valid, given, 0.0)
        if valid is None:
            valid = torch.ones_like(targets, dtype=torch.bool)
        if not isinstance(self.baseline, BaselineEMA):
            keys = self.keys
            if keys is None:
                keys = torch.zeros(targets.shape[0], dtype=torch.int64, device=targets.device)
            if isinstance(self.baseline, LooScaleEMA):
                return self.baseline(targets, valid, keys)
            if self.baseline == "loo-fitted":
                scale = baseline_scale(targets, valid, keys)
                return scale * group_baseline(targets, valid, "loo", keys)
            if self.baseline in EXACT_KL_BASELINES:
                assert self.kls is not None
                return exact_kl_baseline(targets, valid, self.kls, self.baseline, keys)
            return group_baseline(targets, valid, self.baseline, keys)
        if targets.shape[-1] == 1:
            return self.baseline(targets, valid)
        first = first_token(valid)
        aligned, aligned_valid = align_left(targets, valid, first)
        return unalign(self.baseline(aligned, aligned_valid), first)


def _pathwise(x: SurrogateInputs) -> Estimate:
    """Autodiff of the direction's k1 through reparameterized samples."""
    return x.token_estimate(naive_term(x.lr.delta, x.direction))


def _adaptive(x: SurrogateInputs) -> Estimate:
    """k1 + c (k3 - k1) through reparameterized samples, c fitted on the other rows."""
    d = x.lr.delta
    k1 = naive_term(d, x.direction)
    c = mix_coefficient(d, x.lr.valid, x.direction)
    return x.token_estimate(k1 + c * (k3_term(d, x.direction) - k1))


def _stl(x: SurrogateInputs) -> Estimate:
    """The pathwise surrogate with log pi's parameters stopped ("sticking the landing")."""
    assert x.stl_delta is not None
    return x.token_estimate(naive_term(x.stl_delta, x.direction))


def _token(x: SurrogateInputs) -> Estimate:
    """Each token's score times its own (weighted) log-ratio term only."""
    d = x.lr.delta.detach()
    coef = x.weighted(x.rewards(d)) if x.direction == "pi||ref" else -torch.expm1(-d)
    coef = coef - x.baseline_for(coef, x.lr.valid)  # only an exact-KL baseline gets here
    if x.lr.log_w is not None:
        coef = torch.exp(x.lr.log_w.detach()) * coef
    return x.score_estimate(coef)


class Targets(NamedTuple):
    """What a score-function estimator multiplies each score by, before and after a baseline.

    The coefficient of the scores is ``value - weight * b`` with ``b`` the baseline of
    ``baseline_in`` at the positions ``valid`` (off-policy: ``baseline_in`` is the unweighted
    target and ``weight`` the prefix importance weight; on-policy both are the target and 1).
    """

    value: Tensor
    baseline_in: Tensor
    valid: Tensor | None
    weight: Tensor | float


def score_targets(x: SurrogateInputs) -> Targets:
    """``score``: the whole sequence's target ``[rows, 1]``: its summed log-ratio (KL(pi||ref))
    or its ratio R (KL(ref||pi)), weighted by the sequence's importance weight."""
    seq_delta = x.weighted(x.rewards(x.lr.delta.detach())).sum(-1, keepdim=True)
    target = seq_delta if x.direction == "pi||ref" else torch.exp(-seq_delta)
    w = prefix_weights(x.lr.log_w, inclusive=True)
    w_seq = w if x.on_policy else w[:, -1:]
    rows_valid = None if x.lr.valid is None else x.lr.valid.any(-1, keepdim=True)
    return Targets(w_seq * target, target, rows_valid, w_seq)


def cumulative_targets(x: SurrogateInputs) -> Targets:
    """``cumulative``: each token's target ``[rows, T]``: the (weighted) log-ratios from it on
    (KL(pi||ref)) or the prefix ratio (KL(ref||pi))."""
    d = x.lr.delta.detach()
    if x.on_policy:
        if x.direction == "pi||ref":
            target = x.to_go(x.weighted(x.rewards(d)))
        else:
            target = torch.exp(-d.cumsum(-1))
        return Targets(target, target, x.lr.valid, 1.0)
    w = prefix_weights(x.lr.log_w, inclusive=True)
    if x.direction == "pi||ref":
        target = x.to_go(w * x.weighted(d))
        return Targets(target, *x.unweighted(target, w), w)
    unweighted = torch.exp(-d.cumsum(-1))
    return Targets(w * unweighted, unweighted, x.lr.valid, w)


def rb_targets(x: SurrogateInputs) -> Targets:
    """``rb`` (KL(pi||ref)): each token's target ``[rows, T]``: the exact KLs after it."""
    assert x.kls is not None
    terms = x.weighted(rb_weights(x.lr, x.direction) * x.kls.detach())
    future = x.to_go(terms) - terms  # the (discounted) exact KLs after each token
    if x.on_policy:
        return Targets(future, future, x.lr.valid, 1.0)
    w_incl = prefix_weights(x.lr.log_w, inclusive=True)
    return Targets(future, *x.unweighted(future, w_incl), w_incl)


def _baselined(x: SurrogateInputs, t: Targets) -> Tensor:
    """The scores' coefficient: the target less its (weighted) baseline. A baseline ``b_t``
    enters as ``W_{<=t} b_t``: zero mean, since ``E_behavior[W_{<=t} s_t] = 0``."""
    return t.value - t.weight * x.baseline_for(t.baseline_in, t.valid)


def _score(x: SurrogateInputs) -> Estimate:
    """The sequence score times the whole sequence's (weighted, baselined) target."""
    coef = _baselined(x, score_targets(x))
    return x.score_estimate(coef if x.direction == "pi||ref" else -coef)


def _cumulative(x: SurrogateInputs) -> Estimate:
    """Each token's score times what it influences: the log-ratios from it on (prefix ratio)."""
    coef = _baselined(x, cumulative_targets(x))
    return x.score_estimate(coef if x.direction == "pi||ref" else -coef)


def _rb(x: SurrogateInputs) -> Estimate:
    """Pathwise through the exact per-position KLs, plus (KL(pi||ref)) the scores of the future."""
    assert x.kls is not None
    surrogate = x.weighted(rb_weights(x.lr, x.direction) * x.kls)
    if x.direction == "pi||ref":
        surrogate = surrogate + x.logp_rows * _baselined(x, rb_targets(x))
    return x.token_estimate(surrogate)


def _autodiff(x: SurrogateInputs) -> Estimate:
    """The value estimator itself: its autodiff is the gradient."""
    return x.value


Samples = Literal["reparameterized", "sampled", "either"]


@dataclass(frozen=True)
class GradientEstimator:
    """One gradient estimator of :func:`kl_penalty`: its surrogate and its rules.

    Attributes:
      name: the ``grad=`` name.
      surrogate: builds the per-token surrogate whose gradient is the estimator.
      mean: what its expected gradient is.
      samples: ``"reparameterized"`` (x = g(theta, eps), log-probs carry the graph through x),
        ``"sampled"`` (discrete or detached samples: score-function estimators) or ``"either"``.
      directions: the KLs it estimates the gradient of.
      baseline_directions: the KLs for which it takes a baseline.
      needs_logits: it uses the exact per-position KLs from ``logits``/``logits_ref``.
      on_policy_only: it needs samples from pi itself (no ``logp_behavior``).
    """

    name: str
    surrogate: Callable[[SurrogateInputs], Estimate]
    mean: str
    samples: Samples
    directions: tuple[Direction, ...] = ("pi||ref", "ref||pi")
    baseline_directions: tuple[Direction, ...] = ()
    needs_logits: bool = False
    on_policy_only: bool = False


_BOTH: tuple[Direction, ...] = ("pi||ref", "ref||pi")

GRADIENT_ESTIMATORS: dict[str, GradientEstimator] = {
    e.name: e
    for e in (
        GradientEstimator(
            "pathwise", _pathwise, "grad of the KL", "reparameterized", on_policy_only=True
        ),
        GradientEstimator(
            "adaptive", _adaptive, "grad of the KL", "reparameterized", on_policy_only=True
        ),
        GradientEstimator(
            "stl",
            _stl,
            "grad of KL(pi||ref)",
            "reparameterized",
            directions=("pi||ref",),
            on_policy_only=True,
        ),
        GradientEstimator("score", _score, "grad of the KL", "sampled", baseline_directions=_BOTH),
        GradientEstimator(
            "cumulative", _cumulative, "grad of the KL", "sampled", baseline_directions=_BOTH
        ),
        GradientEstimator(
            "rb",
            _rb,
            "grad of the KL",
            "sampled",
            baseline_directions=("pi||ref",),
            needs_logits=True,
        ),
        GradientEstimator(
            "token", _token, "per-position partial gradients: biased for T > 1", "sampled"
        ),
        GradientEstimator(
            "autodiff",
            _autodiff,
            "the value's own gradient: biased on sampled tokens (k1: 0; k3: the other KL)",
            "either",
        ),
    )
}
"""Every gradient estimator of :func:`kl_penalty`, by name."""


EXACT_KL_BASELINES: tuple[str, ...] = ("exact-kl", "exact-kl+loo")
"""Baselines built from the exact per-position KLs (they need logits or ``position_kls``)."""

EXACT_KL_GRADS: tuple[str, ...] = ("cumulative", "token")
"""The gradient estimators that take an exact-KL baseline, for KL(pi||ref) only."""


GROUP_BASELINES: tuple[str, ...] = ("loo", "mean", "loo-fitted", "exact-kl+loo")
"""The named baselines computed within the groups of ``group=``."""

LOO_BASELINES: tuple[str, ...] = ("loo", "loo-fitted", "exact-kl+loo")
"""The named baselines that leave each sample out: 0 for a sample alone in its group."""


def check_group_is_used(group: object, baseline: object, estimator: str, alpha: object) -> None:
    """Warn when ``group=`` is given but nothing uses it (no group baseline, no fitted alpha):
    the ids would be ignored, and a reader of the call would believe leave-one-out is on.

    A warning, not an error: trainers and drop-ins forward their prompt ids with every call,
    also with a moving-average baseline that pools every group; the warning names the fix.
    """
    if group is None:
        return
    uses = (
        (isinstance(baseline, str) and baseline in GROUP_BASELINES)
        or isinstance(baseline, LooScaleEMA)
        or (estimator == "cv" and isinstance(alpha, str))
    )
    if not uses:
        warn_at_caller(
            f"group= is used only by the group baselines ({', '.join(map(repr, GROUP_BASELINES))}"
            ", LooScaleEMA) and by a fitted alpha ('loo', 'crossfit', 'in-sample'); with "
            f"baseline={_baseline_name(baseline)} the group ids are ignored. Pass baseline='loo' "
            "for a leave-one-out baseline within each group, or leave group out",
            UserWarning,
        )


def _baseline_name(baseline: object) -> str:
    return (
        type(baseline).__name__
        if isinstance(baseline, torch.nn.Module | Tensor)
        else repr(baseline)
    )


def _one_row(_: Tensor) -> str:
    return (
        "a leave-one-out baseline over a batch of one sequence has no other sample to take its "
        "baseline from: it is 0 and changes nothing (with gradient accumulation of one sample "
        "per micro-batch, compute the baselines where the whole group is visible and pass them "
        "as baseline=<tensor>: klest.group_baselines). This warning is given once per process."
    )


def given_baseline(baseline: Tensor, lr: LogRatios, *, per_sequence: bool) -> Tensor:
    """A baseline computed elsewhere, as rows like the targets it is subtracted from: one per
    token (the log-probs' layout) or, for ``grad="score"``, one per sequence. Detached."""
    check_float_tensor("baseline", baseline)
    expected = lr.layout.sequences_shape if per_sequence else lr.layout.shape
    if baseline.shape != expected:
        what = "one per sequence" if per_sequence else "one per token, the log-probs' shape"
        raise ValueError(
            f"baseline has shape {tuple(baseline.shape)}; a precomputed baseline holds {what}: "
            f"{tuple(expected)} (klest.group_baselines of klest.penalty_targets gives it)"
        )
    if baseline.device != lr.delta.device:
        raise ValueError(f"baseline is on {baseline.device} but logp is on {lr.delta.device}")
    b = baseline.detach().to(lr.delta.dtype)
    return b.reshape(-1, 1) if per_sequence else lr.layout.rows(b)


DISCOUNTED_GRADS: tuple[str, ...] = ("cumulative", "rb")
"""The gradient estimators whose targets sum the later tokens' terms (``discount=``)."""


def check_objective_options(
    est: GradientEstimator,
    discount: object,
    weights: object,
    *,
    direction: str,
    level: str,
) -> float:
    """``discount`` in [0, 1] for the estimators that sum later tokens' terms; per-token
    ``weights`` for the sampled-token estimators of KL(pi||ref), at the token level."""
    if isinstance(discount, bool) or not isinstance(discount, int | float):
        raise TypeError(f"discount must be a float in [0, 1], got {type(discount).__name__}")
    if not (math.isfinite(discount) and 0.0 <= discount <= 1.0):
        raise ValueError(f"discount must be in [0, 1], got {discount!r}")
    if discount != 1.0 and (est.name not in DISCOUNTED_GRADS or direction != "pi||ref"):
        raise ValueError(
            f"discount={discount} discounts the later tokens' log-ratios (or exact KLs) in the "
            f"targets of grad='cumulative' and grad='rb' for KL(pi||ref); not grad={est.name!r} "
            f"with direction={direction!r} (discount=0 is grad='token')"
        )
    if weights is None:
        return float(discount)
    if est.samples != "sampled" or direction != "pi||ref":
        raise ValueError(
            "weights= weights each token's term of the KL(pi||ref) objective for the sampled-token "
            f"gradients (score, cumulative, rb, token); not grad={est.name!r} with "
            f"direction={direction!r}"
        )
    if level == "sequence":
        raise ValueError("weights= weights tokens: use level='token'")
    return float(discount)


POWERED_GRADS: tuple[str, ...] = ("score", "cumulative", "token")
"""The score-function estimators whose per-token rewards ``power=`` transforms."""


def check_power(
    power: object, est: GradientEstimator, *, direction: str, weights: object, off_policy: bool
) -> float:
    """``power`` >= 0 (0: the log-ratio itself) for on-policy score-function KL(pi||ref)."""
    if isinstance(power, bool) or not isinstance(power, int | float):
        raise TypeError(f"power must be a float >= 0, got {type(power).__name__}")
    if not (math.isfinite(power) and power >= 0.0):
        raise ValueError(f"power must be a finite float >= 0, got {power!r}")
    if power == 0.0:
        return 0.0
    if est.name not in POWERED_GRADS or direction != "pi||ref" or off_policy:
        raise ValueError(
            f"power={power} transforms the per-token rewards of the on-policy score-function "
            f"gradients of KL(pi||ref) (grad in {POWERED_GRADS}); not grad={est.name!r} with "
            f"direction={direction!r}{' off-policy' if off_policy else ''}"
        )
    if weights is not None:
        raise ValueError("power= and weights= together are not supported")
    return float(power)


def given_weights(weights: object, lr: LogRatios, checks: ValueChecks) -> Tensor:
    """Per-token weights of the objective as rows, detached, 0 where not valid."""
    w = check_float_tensor("weights", weights)
    if w.shape != lr.layout.shape:
        raise ValueError(
            f"weights has shape {tuple(w.shape)}; it holds one weight per token, the log-probs' "
            f"shape {tuple(lr.layout.shape)}"
        )
    if lr.log_w is not None:
        raise ValueError("weights= is for on-policy samples: pass no log_w (behavior log-probs)")
    rows = lr.layout.rows(w.detach()).to(lr.delta.dtype)
    bad = ~torch.isfinite(rows)
    checks.add(
        bad if lr.valid is None else bad & lr.valid,
        lambda flags: f"weights is NaN or infinite at {first_bad(flags)}",
    )
    return rows if lr.valid is None else torch.where(lr.valid, rows, 0.0)


def check_context_parallel(
    cp: object,
    est: GradientEstimator,
    *,
    level: str,
    reduction: str,
    counts: GlobalCounts | None,
) -> None:
    """What a context-parallel call can compute: sampled-token gradients, per-token values,
    reductions whose pieces add up over the ranks (means with the step's counts)."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(
            f"context_parallel must be a klest.ContextParallel, got {type(cp).__name__}"
        )
    if est.samples == "reparameterized":
        raise ValueError(
            f"grad={est.name!r} is for reparameterized samples; context_parallel splits token "
            "sequences: use a score-function gradient ('cumulative', 'score', 'rb', ...)"
        )
    if level == "sequence" or reduction == "per-sequence":
        raise ValueError(
            "with context_parallel each rank holds part of every sequence: level='sequence' and "
            "reduction='per-sequence' have no per-rank part; use per-token values (details "
            "report each whole sequence's value)"
        )
    if counts is None and reduction not in ("sum", "none"):
        raise ValueError(
            f"reduction={reduction!r} with context_parallel needs counts= (the step's global "
            "token and sequence counts, klest.distributed.global_counts over the data- and "
            "context-parallel ranks, counting each sequence once): a rank's own counts are of "
            "parts of sequences"
        )


def this_ranks_part(
    est: Estimate, whole: LogRatios, local: LogRatios, columns: Tensor, reduction: str
) -> tuple[Estimate, str]:
    """This rank's columns of an estimate over whole sequences, and the reduction that sums the
    ranks' parts to the whole's (``"seq-mean-token-mean"``: each token divided by its whole
    sequence's length first)."""
    values = local_columns(est.values, columns)
    if reduction == "seq-mean-token-mean":
        assert whole.valid is not None
        length = whole.valid.sum(-1, keepdim=True).clamp(min=1).to(values.dtype)
        values, reduction = values / length, "seq-mean-token-sum"
    if local.valid is not None:
        values = torch.where(local.valid, values, 0.0)
    return Estimate(values, local.valid, local.layout), reduction


def _check_exact_kl_baseline(grad: str, direction: str, baseline: str) -> None:
    if direction != "pi||ref":
        raise ValueError(
            f"baseline={baseline!r} subtracts the exact per-position KL(pi||ref), the mean of "
            f"each sampled log-ratio given its prefix: it applies to direction='pi||ref' only, "
            f"not {direction!r}"
        )
    if grad not in EXACT_KL_GRADS:
        why = {
            "rb": "rb already replaces each sampled log-ratio by its exact KL; use "
            "baseline='loo' with it",
            "score": "score multiplies the whole sequence's score by one target; use "
            "grad='cumulative'",
        }.get(grad, "it is not a per-token score-function estimator")
        raise ValueError(
            f"baseline={baseline!r} applies to grad='cumulative' and grad='token' only, not "
            f"grad={grad!r}: {why}"
        )


def _warn(message: str) -> None:
    warn_at_caller(message, KLGradientWarning)


def _check_rules(
    est: GradientEstimator,
    *,
    direction: str,
    reparameterized: bool,
    baseline: object,
    on_policy: bool,
    logp_ref: Tensor,
    logp_stl: Tensor | None,
) -> None:
    """The estimator's table entry against the call: samples, direction, baseline."""
    if direction not in est.directions:
        raise ValueError(
            f"grad={est.name!r} estimates the gradient of KL({', '.join(est.directions)}) only "
            f"(it drops a term that has mean zero only there); use grad='pathwise' for "
            f"KL({direction})"
        )
    if est.samples == "reparameterized" and not reparameterized:
        raise ValueError(
            f"grad={est.name!r} is a pathwise gradient: it needs reparameterized samples "
            "x = g(theta, eps) whose log-probs carry the graph through x; say so with "
            "reparameterized=True, or use grad='score' / 'cumulative' for sampled tokens"
        )
    if est.samples == "sampled" and reparameterized:
        raise ValueError(
            f"grad={est.name!r} is a score-function gradient, for samples that carry no graph "
            "to pi's parameters; with reparameterized=True use grad='pathwise' or 'stl' (or "
            "detach the samples and pass reparameterized=False)"
        )
    if est.on_policy_only and not on_policy:
        raise ValueError(f"grad={est.name!r} needs samples from pi itself, not logp_behavior")
    if est.samples == "reparameterized" and torch.is_grad_enabled() and not logp_ref.requires_grad:
        raise ValueError(
            f"grad={est.name!r} with reparameterized=True needs logp_ref to carry the graph "
            "through x = g(theta, eps), but it does not require grad (was x detached?)"
        )
    if est.name == "stl" and logp_stl is None:
        raise ValueError("grad='stl' needs logp_stl: log pi(x) with pi's parameters stopped")
    if baseline is None:
        return
    if not isinstance(baseline, BaselineEMA | LooScaleEMA | Tensor):
        check_choice("baseline", baseline, Baseline)
        if baseline in EXACT_KL_BASELINES:
            _check_exact_kl_baseline(est.name, direction, baseline)
            return
    if direction not in est.baseline_directions:
        takes = ", ".join(
            f"{e.name} ({' and '.join(f'KL({d})' for d in e.baseline_directions)})"
            for e in GRADIENT_ESTIMATORS.values()
            if e.baseline_directions
        )
        raise ValueError(
            f"baseline applies to grad in {takes}; not grad={est.name!r} with "
            f"direction={direction!r}"
        )


def _surrogate_explanation(
    logp: Tensor, logp_ref: Tensor, lr: LogRatios, direction: str, names: ArgumentNames
) -> Callable[[], str]:
    """The message for a non-finite surrogate, naming the responsible argument (by the caller's
    ``names``)."""
    lp, ref, behavior = names.logp, names.logp_ref, names.logp_behavior

    def explain() -> str:
        keep = lr.layout.tokens(lr.valid_or_all()) & (logp > -torch.inf)
        zero_ref = keep & (logp_ref == -torch.inf)
        if bool(zero_ref.any()):
            first = tuple(zero_ref.nonzero()[0].tolist())
            return (
                f"{ref} is -inf at {int(zero_ref.sum())} position(s) (first at index {first}) "
                f"where pi sampled the token: ref gives it probability 0, so KL({direction}) is "
                "infinite and has no finite gradient; mask those tokens out"
            )
        if lr.log_w is not None:
            return (
                "the gradient surrogate is not finite: the importance weights "
                f"exp({lp} - {behavior}) (largest log-weight "
                f"{float(lr.log_w.max()):.4g}) or the log-ratios {lp} - {ref} overflow; "
                "clip or mask such tokens"
            )
        return (
            f"the gradient surrogate is not finite: the log-ratios {lp} - {ref} (largest "
            f"|{lp} - {ref}| {float(lr.delta.detach().abs().max()):.4g}) overflow the ratio "
            f"exp(-({lp} - {ref})) or its sum; mask such tokens"
        )

    return explain


def kl_penalty(
    logp: Tensor | Distribution,
    logp_ref: Tensor | Distribution,
    *,
    estimator: Estimator = "k3",
    grad: Grad = "cumulative",
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    reduction: Reduction = DEFAULT_REDUCTION,
    baseline: Baseline | BaselineEMA | LooScaleEMA | Tensor | None = None,
    group: Tensor | None = None,
    reparameterized: bool = False,
    level: Level = "token",
    alpha: Alpha | None = None,
    logp_behavior: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    position_kls: Tensor | None = None,
    logp_stl: Tensor | None = None,
    discount: float = 1.0,
    weights: Tensor | None = None,
    power: float = 0.0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    counts: GlobalCounts | None = None,
    context_parallel: ContextParallel | None = None,
    density: bool = False,
    validate: bool | None = None,
    return_details: bool = False,
) -> Tensor | WithDetails[PenaltyDetails]:
    r"""A KL term for a loss: ``estimator``'s value forward, ``grad``'s estimator backward.

    .. math::
        \text{loss} = \mathrm{sg}(\widehat{KL}_{estimator}) + S_{grad} - \mathrm{sg}(S_{grad}),
        \qquad E[\nabla S_{grad}] = \nabla KL(\pi\|ref) \text{ (or } KL(ref\|\pi))

    for the unbiased gradient estimators (each surrogate is in :mod:`klest.sampled.penalty`).

    Samples: sequences y ~ pi (or ~ behavior with ``logp_behavior``); for ``grad="pathwise"`` /
    ``"stl"``, continuous samples x = g(theta, eps) reparameterized through pi's parameters
    (``reparameterized=True``).

    See "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi
    Munos (2025, https://arxiv.org/abs/2506.09477) and "The Chimera Estimator" by Kirato
    Yoshihara (2026, https://kiratoyoshihara.github.io/essays/chimera-kl.html).

    Args:
      logp: log pi of the sampled tokens ``[..., T]`` (or samples ``[N]``), carrying the graph
        of the trainable model. Or pi itself, a ``torch.distributions.Distribution`` (with ref
        one too): the closed-form KL and its exact gradient where
        ``torch.distributions.kl_divergence`` has one, else one draw of ``pi.rsample()`` per
        batch element with a pathwise gradient (the default ``grad`` means ``"pathwise"``
        then); :mod:`klest.sampled.distributions`, ``details.method`` says which.
      logp_ref: log ref of the same tokens (a graph only through reparameterized samples), or
        ref, a ``Distribution``.
      estimator: the value: ``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``, ``"cv"`` (with
        ``alpha``) or ``"rb"`` (exact per-position KLs; needs logits).
      grad: the gradient: ``"pathwise"``, ``"adaptive"``, ``"stl"``, ``"score"``,
        ``"cumulative"``, ``"rb"``, ``"token"`` or ``"autodiff"`` (see ``GRADIENT_ESTIMATORS``).
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      mask: bool ``[..., T]``: valid tokens. Rows may be empty.
      reduction: by the rule of :mod:`klest.aggregation`: ``"seq-mean-token-sum"`` (default:
        the sequence KL), ``"token-mean"``, ``"sum"``, ``"seq-mean-token-mean"`` (each sequence
        divided by its length: not the gradient of a KL), ``"per-sequence"`` (one loss per
        sequence) or ``"none"`` (one loss per token, ``[..., T]``, summing to the per-sequence
        losses in value and gradient).
      baseline: ``"loo"``, ``"mean"``, ``"loo-fitted"`` (leave-one-out times a cross-fitted
        scale in [0, 1]: :mod:`klest.sampled.baselines`), a :class:`~klest.LooScaleEMA`
        (leave-one-out times a per-position scale fitted on earlier batches) or a
        :class:`~klest.BaselineEMA`, for
        ``score``, ``cumulative`` and ``rb``; ``"exact-kl"`` (vOPD: each token's exact
        per-position KL, from ``logits``/``logits_ref`` or ``position_kls``) or
        ``"exact-kl+loo"`` (plus the leave-one-out mean of the residuals), for ``cumulative``
        and ``token`` with ``direction="pi||ref"`` (see the module docstring). The exact KLs
        enter detached, and
        any function of the prefix keeps the gradient unbiased: ``position_kls`` may be an
        approximation (top-k's ``"tail-bucket"``, say; not a sampled estimate such as top-k's
        ``"unbiased"``, which depends on the token itself). With ``grad="rb"``, sampled
        per-position estimates with their graph (top-k's ``"unbiased"`` / ``"unbiased-cv"``,
        ``reduction="none"``) give an unbiased gradient of the sequence KL. A tensor is a
        baseline computed elsewhere (where a prompt's whole group is visible, when the trainer
        splits it over ranks or micro-batches: :func:`klest.group_baselines` of
        :func:`klest.penalty_targets`), one per token (``logp``'s shape; one per sequence for
        ``grad="score"``). It must not depend on the sample it is subtracted from (a
        leave-one-out mean over the *other* samples, say), or the gradient is biased.
      group: integer ids, one per sequence (``logp.shape[:-1]``; ``[S]`` packed): samples of
        the same prompt (baselines and fitted alphas are computed within a group; a group of
        one gets leave-one-out baseline 0). Where nothing uses it (no group baseline, no fitted
        alpha) a ``UserWarning`` says so: leave-one-out is never believed on when it is off.
      reparameterized: the samples are x = g(theta, eps) and ``logp`` / ``logp_ref`` carry the
        graph through x (VAEs, VI): required by ``pathwise`` / ``adaptive`` / ``stl``, refused
        by the score-function estimators.
      level: ``"token"`` or ``"sequence"`` for the value (see :func:`klest.kl_estimate`). For
        KL(ref||pi) the token-level value summed over a sequence is not the sequence KL (the
        prefixes come from pi): use ``level="sequence"`` or ``estimator="rb"`` there; every
        gradient estimator targets the sequence KL either way.
      alpha: coefficient for ``estimator="cv"`` (see :func:`klest.kl_estimate`).
      logp_behavior: log behavior of the tokens when they were not sampled from pi.
      logits: pi's next-token logits along the samples, ``logp.shape + (V,)``, with graph
        (read only by ``estimator="rb"`` / ``grad="rb"`` / the exact-KL baselines; a training
        loop may pass them always). With ``grad="rb"`` the exact KLs' gradient is written
        during the forward pass, so the loss can be backpropagated once.
      logits_ref: ref's, same shape.
      position_kls: instead of ``logits`` / ``logits_ref``: the exact per-position KLs
        ``logp.shape`` in ``direction``, with their graph (e.g. :func:`klest.kl_from_hidden`
        with ``reduction="none"`` and the same mask: the fused LM heads, no ``[..., V]``
        tensor). With ``grad="rb"`` they are backpropagated through as given.
      logp_stl: for ``grad="stl"``: log pi of the samples with pi's distribution parameters
        stopped (x itself still differentiable).
      discount: :math:`\gamma \in [0, 1]` for ``cumulative`` and ``rb`` (KL(pi||ref)): each
        token's target sums the later tokens' log-ratios (exact KLs) discounted by
        :math:`\gamma^{u-t}`, between the token-local gradient (0: ``grad="token"``) and the
        sequence KL's (1, the default). Its mean is
        :math:`\sum_u \sum_{t \le u} \gamma^{u-t} E[s_t \rho_u]`, the gradient of no
        divergence for :math:`0 < \gamma < 1` (GAE-OPD's discounted return-to-go, arXiv
        2606.22793).
      weights: per-token weights :math:`w_t` ``logp.shape`` (detached; on-policy) of the
        per-token penalties :math:`w_t \rho_t` (KL(pi||ref), sampled-token gradients;
        IW-OPD's token weights, arXiv 2606.22600): the value and every token's term are
        weighted. ``score`` and ``cumulative``'s mean gradient is the policy gradient of
        these penalties held fixed, :math:`\nabla_{\theta'} E_{y\sim\pi_{\theta'}}
        [\sum_t w_t\rho_t]`, for weights that read the tokens up to their own,
        :math:`w_t(y_{\le t})` (``token``: the same with the prefixes fixed); where they read
        only the tokens before, :math:`w_t(y_{<t})`, it is the gradient of
        :math:`E_\pi[\sum_t w_t\rho_t]` (``rb``: only then). Weights that read later tokens
        (IW-OPD's read the whole sequence's) bias both. With ``context_parallel``, each rank
        passes its own tokens' weights (weights that read other ranks' tokens, such as
        :func:`klest.iw_opd_weights`, computed on the whole sequences before the split).
      power: :math:`\alpha \ge 0`: the scores of ``score``, ``cumulative`` and ``token``
        (on-policy, KL(pi||ref)) are multiplied by the Box-Cox transformed rewards
        :math:`\rho^{(\alpha)}_t = (1 - (ref_t/\pi_t)^{\alpha})/\alpha` in place of
        :math:`\rho_t` (0, the default: :math:`\rho_t` itself; PowerOPD, arXiv 2606.17199);
        bounded above by :math:`1/\alpha`. The value is still the KL estimate. Per token the
        mean gradient is Amari's alpha-divergence's,
        :math:`\nabla D_\alpha(\pi_t\|ref_t)`,
        :math:`D_\alpha = (1 - \sum_v \pi^{1-\alpha} ref^{\alpha})/(\alpha(1-\alpha))`
        (KL(ref||pi) at :math:`\alpha = 1`): ``token``'s mean is
        :math:`\sum_t E_{y_{<t}}[\nabla D_\alpha(\pi_t\|ref_t)]` with the prefixes fixed;
        ``cumulative``'s adds each prefix's effect on the later tokens' rewards held fixed,
        :math:`\sum_u \nabla_{\theta'} E_{y\sim\pi_{\theta'}}[\rho^{(\alpha)}_u]`, which
        weights the prefixes' terms by :math:`1-\alpha` relative to the divergence's: for
        :math:`\alpha \ne 0` the mean gradient of no sequence divergence.
      cu_seqlens: packed sequences (:mod:`klest.layout`): the offsets ``[S + 1]`` of the S
        sequences whose tokens ``logp`` (``[total]`` or ``[1, total]``) holds one after
        another; every per-token input, the mask and ``reduction="none"``'s output share that
        layout, ``group`` and ``"per-sequence"`` are ``[S]``. The same loss and gradient as the
        padded batch of the same sequences.
      max_seqlen: with ``cu_seqlens``, the longest sequence's length if known (flash-attention
        varlen calls carry it): saves reading ``cu_seqlens`` on the host.
      counts: the step's global token and sequence counts (:class:`~klest.GlobalCounts`,
        :func:`klest.distributed.global_counts`), for a loss computed in pieces over
        data-parallel ranks or micro-batches: the mean reductions divide by them, so the
        pieces' gradients add up to the whole batch's.
      context_parallel: a :class:`~klest.ContextParallel` when each rank of a
        context-parallel group holds part of every sequence (zig-zag, head-tail or contiguous;
        with ``cu_seqlens``, document by document): the sequence-level coefficients are computed
        on the whole sequences from one all-gather of the detached per-token inputs, and each
        rank's loss and gradient are its tokens' part (summed over the ranks: the whole
        sequences'). Needs ``counts`` for the mean reductions; refuses ``level="sequence"``,
        ``"per-sequence"`` and the reparameterized gradients.
      density: the inputs are log-densities of continuous samples, which may exceed 0 (implied
        by ``reparameterized=True``); for tokens a log-prob above 0 is an error.
      validate: run the value checks once for the whole call (None: the global default).
      return_details: also return a :class:`PenaltyDetails`.

    Returns:
      The loss (a scalar, ``[...]`` for ``"per-sequence"``, ``[..., T]`` for ``"none"``) in the
      compute dtype; with ``return_details``, ``(loss, details)``.

    Raises:
      ValueError: bad log-probs (as :func:`klest.kl_estimate`), a gradient estimator that does
        not fit the samples (``reparameterized``), direction or baseline, or a non-finite
        gradient surrogate.

    Example:
      >>> logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.9, -0.1]], requires_grad=True)
      >>> logp_ref = torch.tensor([[-1.2, -0.4, -1.5], [-0.5, -0.7, -0.2]])
      >>> mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
      >>> loss = kl_penalty(logp, logp_ref, mask=mask, estimator="k3", grad="cumulative",
      ...                   baseline="loo", group=torch.tensor([0, 0]))
      >>> loss.backward()
      >>> logp.grad.shape
      torch.Size([2, 3])
    """
    check_direction(direction)
    check_choice("estimator", estimator, Estimator)
    check_choice("grad", grad, Grad)
    check_choice("reduction", reduction, Reduction)
    check_level(level, reduction)
    check_flag("reparameterized", reparameterized)
    source = resolve(
        logp,
        logp_ref,
        direction=direction,
        function="kl_penalty",
        refused={
            "baseline": baseline,
            "logp_behavior": logp_behavior,
            "logits": logits,
            "logits_ref": logits_ref,
            "position_kls": position_kls,
            "logp_stl": logp_stl,
            "cu_seqlens": cu_seqlens,
        },
    )
    if source is not None and source.kl is not None:
        out, exact = closed_form(
            source.kl, mask=mask, reduction=reduction, counts=counts, validate=validate
        )
        if not return_details:
            return out
        per_sequence = exact.reduce("per-sequence").detach()
        return WithDetails(
            out, PenaltyDetails(per_sequence, exact.diagnostics(reduction), 0, source.method)
        )
    if source is not None:  # one reparameterized draw: the pathwise gradient
        logp, logp_ref, reparameterized = source.logp, source.logp_ref, True
        grad = "pathwise" if grad == "cumulative" else grad
    est = GRADIENT_ESTIMATORS[grad]
    _check_rules(
        est,
        direction=direction,
        reparameterized=reparameterized,
        baseline=baseline,
        on_policy=logp_behavior is None,
        logp_ref=logp_ref,
        logp_stl=logp_stl,
    )
    checks = ValueChecks(resolve_validate(validate))
    check_flag("density", density)
    names = caller_names()  # a drop-in's names of the arguments, for the messages
    lr = prepare_log_ratios(
        logp,
        logp_ref,
        logp_behavior=logp_behavior,
        mask=mask,
        checks=checks,
        density=density or reparameterized,
        names=names,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )
    check_counts(counts, reduction)
    discount = check_objective_options(est, discount, weights, direction=direction, level=level)
    token_weights = None if weights is None else given_weights(weights, lr, checks)
    power = check_power(
        power, est, direction=direction, weights=weights, off_policy=logp_behavior is not None
    )
    if context_parallel is not None:
        check_context_parallel(
            context_parallel, est, level=level, reduction=reduction, counts=counts
        )
    check_group_is_used(group, baseline, estimator, alpha)
    keys = None
    if group is not None:
        keys = group_keys(
            check_group(group, lr.layout.sequences_shape, logp.device, of_shape=logp.shape)
        )
    if isinstance(baseline, Tensor):
        baseline = given_baseline(baseline, lr, per_sequence=grad == "score")
    elif baseline in LOO_BASELINES and lr.delta.shape[0] == 1 and not lr.layout.samples:
        checks.warn_once("loo-one-row", torch.ones((), dtype=torch.bool), _one_row)
    kls = None
    exact_baseline = isinstance(baseline, str) and baseline in EXACT_KL_BASELINES
    if "rb" in (estimator, grad) or exact_baseline:
        # A graph (and the gradient buffer the logits path writes) only if the gradient uses it.
        with torch.set_grad_enabled(torch.is_grad_enabled() and grad in ("rb", "autodiff")):
            kls = exact_position_kls(
                logits,
                logits_ref,
                logp,
                lr,
                position_kls=position_kls,
                direction=direction,
                checks=checks,
                why=f"estimator={estimator!r} / grad={grad!r} / baseline={baseline!r}",
            )
    if alpha is not None and estimator != "cv":
        raise ValueError(f"alpha applies only to estimator='cv', not {estimator!r}")
    stl_delta = None
    if grad == "stl":
        assert logp_stl is not None
        check_float_tensor("logp_stl", logp_stl)
        check_same_shape(logp=logp, logp_stl=logp_stl)
        rows = lr.layout.rows
        stl = rows(logp_stl).to(lr.delta.dtype) - rows(logp_ref).to(lr.delta.dtype)
        stl_delta = stl if lr.valid is None else torch.where(lr.valid, stl, 0.0)
    _warn_about_gradient(
        est,
        estimator,
        direction,
        reparameterized,
        logp,
        logp_ref,
        logits if logits is not None else position_kls,
        logp_stl,
        names.logp,
    )

    local, columns = lr, None
    if context_parallel is not None:  # whole sequences, this rank's tokens with their graph
        lr, kls, columns, token_weights = whole_sequences(context_parallel, lr, kls, token_weights)
    # The value passes no gradient (decouple detaches it) unless it is the gradient (autodiff).
    with torch.set_grad_enabled(torch.is_grad_enabled() and grad == "autodiff"):
        value = estimate_rows(
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
        caller=f"kl_penalty(estimator={estimator!r})",
    )
    if token_weights is not None:  # the objective's per-token weights, in the value too
        value = replace(value, values=value.values * token_weights)
    inputs = SurrogateInputs(
        lr,
        lr.logp,
        direction,
        value,
        baseline,
        keys,
        kls,
        stl_delta,
        discount,
        token_weights,
        power,
    )
    surrogate = est.surrogate(inputs)
    local_value, local_reduction = value, reduction
    if columns is not None:  # this rank's tokens of the whole sequences' terms
        local_value, local_reduction = this_ranks_part(value, lr, local, columns, reduction)
        surrogate, _ = this_ranks_part(surrogate, lr, local, columns, reduction)
    value_out = local_value.reduce(local_reduction, counts)
    surrogate_out = surrogate.reduce(local_reduction, counts)
    check_finite_surrogate(
        surrogate_out, checks, _surrogate_explanation(logp, logp_ref, local, direction, names)
    )
    checks.run()
    loss = surrogate_out if grad == "autodiff" else join(value_out, surrogate_out)
    if not return_details:
        return loss
    singletons = 0
    if keys is not None:  # samples with tokens whose group has no other sample with tokens
        has_tokens = lr.valid.any(-1) if lr.valid is not None else lr.delta.shape[-1] > 0
        counted = torch.zeros_like(keys).add_(has_tokens)  # 0/1 per row, no boolean indexing
        per_group = torch.zeros_like(keys).index_add_(0, keys, counted)  # keys < row count
        singletons = int((per_group == 1).sum())
    details = PenaltyDetails(
        per_sequence=value.reduce("per-sequence").detach(),
        diagnostics=value.diagnostics(reduction, tail),
        n_singleton_samples=singletons,
        method="log-probs" if source is None else source.method,
    )
    return WithDetails(loss, details)


def _warn_about_gradient(
    est: GradientEstimator,
    estimator: str,
    direction: str,
    reparameterized: bool,
    logp: Tensor,
    logp_ref: Tensor,
    logits: Tensor | None,
    logp_stl: Tensor | None,
    logp_name: str,
) -> None:
    """Warn when the chosen gradient is biased for the stated KL, or cannot reach the policy
    (``logp_name``: the caller's name of ``logp``)."""
    if est.name == "autodiff" and not reparameterized:
        _warn(
            f"grad='autodiff' of estimator={estimator!r} on sampled tokens is not an unbiased "
            f"gradient of KL({direction}) (k1: mean 0; k3/cv: the other direction; see "
            "klest.sampled.penalty); use grad='cumulative', 'score' or 'rb'"
        )
    if est.name == "token" and logp.ndim >= 2 and logp.shape[-1] > 1:
        _warn(
            "grad='token' is the per-token partial gradient: it misses the effect of each "
            "token on later ones and is biased for a sequence KL; use 'cumulative'"
        )
    carriers = (logp, logits, logp_stl, logp_ref if reparameterized else None)
    if torch.is_grad_enabled() and not any(t is not None and t.requires_grad for t in carriers):
        _warn(
            f"grad={est.name!r}: {logp_name} does not require grad, so no gradient will reach the "
            "policy (was it computed under torch.no_grad(), or detached?)"
        )


class PenaltyTargets(NamedTuple):
    """What :func:`penalty_targets` returns: the targets and where they count.

    Attributes:
      targets: detached, one per token (``logp``'s shape), or one per sequence for
        ``grad="score"``; 0 where they do not count.
      mask: bool, the same shape: where a target counts (and takes a baseline).
    """

    targets: Tensor
    mask: Tensor


_TARGETS: dict[str, Callable[[SurrogateInputs], Targets]] = {
    "score": score_targets,
    "cumulative": cumulative_targets,
    "rb": rb_targets,
}


def penalty_targets(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    grad: Grad = "cumulative",
    direction: Direction = "pi||ref",
    mask: Tensor | None = None,
    logp_behavior: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    position_kls: Tensor | None = None,
    discount: float = 1.0,
    weights: Tensor | None = None,
    power: float = 0.0,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    validate: bool | None = None,
) -> PenaltyTargets:
    r"""The targets that :func:`kl_penalty`'s baselines are computed from, for a batch.

    The score-function estimators multiply each score by a target less a baseline; a group
    baseline averages the targets of the *other* samples of a prompt. When a trainer splits a
    prompt's samples over ranks or micro-batches, compute the targets and their baselines where
    the whole group is visible (where the engine computes advantages) and pass each piece's
    baselines to its loss::

        t = klest.penalty_targets(logp_old, logp_ref, mask=mask)          # whole batch
        b = klest.group_baselines(t.targets, mask=t.mask, group=prompt_ids)
        loss = klest.kl_penalty(logp[rows], logp_ref[rows], mask=mask[rows], baseline=b[rows])

    With ``logp`` from the policy that sampled (on-policy: the same log-probs) the loss and
    gradient equal ``kl_penalty(..., baseline="loo", group=prompt_ids)`` on the whole batch.

    .. math::
        A_t = \sum_{u \ge t} \rho_u \ (\texttt{cumulative}), \quad
        A = \sum_u \rho_u \ (\texttt{score}), \quad
        A_t = \sum_{n > t} KL_n \ (\texttt{rb}) \qquad \text{(KL(pi||ref); KL(ref||pi):}
        \ R_{\le t},\ R)

    Off-policy (``logp_behavior``) they are the unweighted targets. Samples: as for
    :func:`kl_penalty`.

    Args:
      logp: log pi of the sampled tokens, as for :func:`kl_penalty` (detached here).
      logp_ref: log ref of the same tokens.
      grad: ``"cumulative"``, ``"score"`` or ``"rb"``: the estimators that take a baseline.
      direction: ``"pi||ref"`` or ``"ref||pi"``.
      mask: the tokens that count.
      logp_behavior: log behavior of the tokens, off-policy.
      logits: pi's logits along the samples, for ``grad="rb"``.
      logits_ref: ref's, for ``grad="rb"``.
      position_kls: instead of the logits, the exact per-position KLs.
      discount: as for :func:`kl_penalty`.
      weights: as for :func:`kl_penalty`.
      power: as for :func:`kl_penalty`.
      cu_seqlens: packed sequences (:mod:`klest.layout`).
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known.
      validate: run the value checks (None: the global default).

    Returns:
      A :class:`PenaltyTargets` ``(targets, mask)``, detached.

    Example:
      >>> logp = torch.tensor([[-1.0, -0.5], [-0.3, -0.9]])
      >>> t = penalty_targets(logp, torch.tensor([[-1.2, -0.4], [-0.5, -0.7]]))
      >>> t.targets  # the log-ratios from each token on
      tensor([[ 0.1000, -0.1000],
              [ 0.0000, -0.2000]])
    """
    check_direction(direction)
    check_choice("grad", grad, Grad)
    if grad not in _TARGETS:
        raise ValueError(
            f"grad={grad!r} takes no baseline; targets exist for {', '.join(map(repr, _TARGETS))}"
        )
    est = GRADIENT_ESTIMATORS[grad]
    if direction not in est.baseline_directions:
        raise ValueError(f"grad={grad!r} takes no baseline for direction={direction!r}")
    checks = ValueChecks(resolve_validate(validate))
    with torch.no_grad():
        lr = prepare_log_ratios(
            logp,
            logp_ref,
            logp_behavior=logp_behavior,
            mask=mask,
            checks=checks,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
        kls = None
        if grad == "rb":
            kls = exact_position_kls(
                logits,
                logits_ref,
                logp,
                lr,
                position_kls=position_kls,
                direction=direction,
                checks=checks,
                why="grad='rb'",
            )
        discount = check_objective_options(
            est, discount, weights, direction=direction, level="token"
        )
        token_weights = None if weights is None else given_weights(weights, lr, checks)
        power = check_power(
            power, est, direction=direction, weights=weights, off_policy=logp_behavior is not None
        )
        checks.run()
        x = SurrogateInputs(
            lr,
            lr.logp,
            direction,
            None,
            None,
            None,
            kls,
            None,
            discount,
            token_weights,  # type: ignore[arg-type]
            power,
        )
        t = _TARGETS[grad](x)
        valid = t.valid if t.valid is not None else torch.ones_like(t.baseline_in, dtype=torch.bool)
        targets = torch.where(valid, t.baseline_in, 0.0)
    if grad == "score":
        shape = lr.layout.sequences_shape
        return PenaltyTargets(targets.reshape(shape), valid.reshape(shape))
    return PenaltyTargets(lr.layout.tokens(targets), lr.layout.tokens(valid))
