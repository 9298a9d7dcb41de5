r"""Measure an estimator against a testbed's exact answer: bias, spread, and significance.

An estimator is audited by drawing independent batches from a testbed with fixed seeds,
applying the estimator to each, and comparing the draws with the exact KL:

- ``mean``, ``bias = mean - exact`` and its standard error ``std / sqrt(n_draws)``;
- ``std``, the spread of one draw, and the standard error of that std (delta method with the
  fourth central moment, so heavy tails widen it honestly);
- ``z = bias / se_bias`` and ``significant = |z| > z_threshold``; draws that never vary beyond
  rounding are deterministic: std and se are 0, z is 0 when the mean is the exact KL to
  rounding, else infinite, and the tables print ``exact``;
- ``expected``: the estimator's exact mean where the testbed can compute it (biased estimators
  are checked against their own exact mean, not only against the KL).

A *draw* is whatever the estimator returns per batch: a scalar (the batch estimate) or one
value per independent row (per-sample estimates; e.g. Schulman's table uses batch_size rows).

The library's own audit plan, built on these primitives, is :mod:`klest.audit.suite`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import get_args

import numpy as np
import torch
from torch import Tensor

from klest._checks import check_choice, check_direction
from klest._progress import progress_bar
from klest._types import AlphaFit, Baseline, Estimator
from klest.audit._quadratic_forms import chi2_combination_log_tails, normal_upper_deviate
from klest.sampled.baselines import BaselineEMA, LooScaleEMA
from klest.sampled.control_variates import AlphaEMA
from klest.sampled.estimators import kl_estimate
from klest.sampled.penalty import (
    EXACT_KL_BASELINES,
    GRADIENT_ESTIMATORS,
    KLGradientWarning,
    kl_penalty,
)
from klest.sampled.terms import per_token_values
from klest.testbeds.base import Sample, Testbed, make_generator

__all__ = [
    "WEIGHT_RULES",
    "EstimateFn",
    "EstimatorSpec",
    "GradAudit",
    "GradSpec",
    "ValueAudit",
    "audit_grad",
    "audit_value",
    "format_grad_audits",
    "format_value_audits",
    "gradient_draws",
    "mean_shift_z",
]

EstimateFn = Callable[[Sample], Tensor]
"""A value estimator as a function: one batch (a :class:`~klest.testbeds.Sample`) to its draws."""


@dataclass(frozen=True)
class ValueAudit:
    """The outcome of :func:`audit_value` (all numbers are Python floats)."""

    estimator: str
    testbed: str
    direction: str
    exact: float
    expected: float | None
    mean: float
    bias: float
    se_bias: float
    std: float
    se_std: float
    n_draws: int
    z: float
    significant: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EstimatorSpec:
    """A named value estimator: ``"k1"``, ``"k3"``, ``"cv:0.5"``, ``"cv:loo"``, ``"cv:ema"``..."""

    estimator: str
    alpha: float | str | None = None
    level: str = "token"

    @classmethod
    def parse(cls, spec: str, *, level: str = "token") -> EstimatorSpec:
        name, _, arg = spec.partition(":")
        # Every value estimator but rb, which needs logits: a spec names a per-sample formula.
        check_choice("estimator", name, tuple(e for e in get_args(Estimator) if e != "rb"))
        if name != "cv":
            if arg:
                raise ValueError(f"estimator {name!r} takes no argument, got {spec!r}")
            return cls(name, None, level)
        if not arg:
            raise ValueError("estimator 'cv' needs a coefficient: 'cv:0.5', 'cv:loo', 'cv:ema'...")
        try:
            return cls(name, float(arg), level)
        except ValueError:
            check_choice("alpha", arg, (*get_args(AlphaFit), "ema"))
            return cls(name, arg, level)

    @property
    def fitted(self) -> bool:
        return isinstance(self.alpha, str)

    def label(self) -> str:
        text = self.estimator if self.alpha is None else f"{self.estimator}:{self.alpha}"
        return text if self.level == "token" else f"{text}@sequence"

    def build(self, direction: str) -> EstimateFn:
        """A function from one batch to its draws: per-row values, or the batch mean if fitted."""
        alpha: object = AlphaEMA() if self.alpha == "ema" else self.alpha

        def estimate(sample: Sample) -> Tensor:
            per_row = self.per_row(sample, direction, alpha=alpha)
            # A fitted coefficient couples the rows of a batch: only the batch mean is one draw.
            return per_row.mean() if self.fitted else per_row

        return estimate

    def per_row(
        self, sample: Sample, direction: str, *, alpha: object = None, group: Tensor | None = None
    ) -> Tensor:
        """The estimate of each row (a sequence's token sum), ``[rows]``."""
        return kl_estimate(
            sample.logp,
            sample.logp_ref,
            estimator=self.estimator,
            direction=direction,
            alpha=self.alpha if alpha is None else alpha,
            mask=sample.mask,
            level=self.level,
            reduction="per-sequence",
            group=group,
            density=sample.density,
        )

    def exact_mean(self, testbed: Testbed, direction: str) -> float | None:
        """The estimator's exact expectation on ``testbed``, when computable."""
        if self.fitted:
            return None

        def per_token(delta: Tensor) -> Tensor:
            return per_token_values(delta, self.estimator, direction, alpha=self.alpha)

        try:
            if self.level == "sequence":
                return float(testbed.sequence_expectation(per_token))
            return float(testbed.expectation(per_token))
        except (NotImplementedError, ValueError):
            return None


_ROWS_PER_CALL = 1 << 20


@torch.no_grad()
def _vectorized_draws(
    spec: EstimatorSpec,
    testbed: Testbed,
    direction: str,
    batch_size: int,
    n_trials: int,
    generator: torch.Generator,
    progress: bool,
) -> Tensor:
    """Many trials per call: one sample of ``trials x batch`` rows, trials as fitting groups."""
    per_call = max(1, _ROWS_PER_CALL // batch_size)
    blocks = [min(per_call, n_trials - i) for i in range(0, n_trials, per_call)]
    draws = []
    for trials in progress_bar(blocks, desc=f"audit {spec.label()}", leave=False, enabled=progress):
        sample = testbed.sample(trials * batch_size, generator=generator)
        group = None
        if spec.fitted:
            group = torch.arange(trials).repeat_interleave(batch_size)
        per_row = spec.per_row(sample, direction, group=group).double()
        draws.append(per_row.view(trials, batch_size).mean(1) if spec.fitted else per_row)
    return torch.cat(draws)


def _std_and_se(draws: Tensor) -> tuple[float, float]:
    n = draws.numel()
    centred = draws - draws.mean()
    var = float(centred.pow(2).mean())
    std = math.sqrt(var * n / max(n - 1, 1))
    m4 = float(centred.pow(4).mean())
    se_std = math.sqrt(max(m4 - var * var, 0.0) / n) / (2 * std) if std > 0 else 0.0
    return std, se_std


def audit_value(
    estimator: str | EstimateFn,
    testbed: Testbed,
    *,
    direction: str = "pi||ref",
    level: str = "token",
    batch_size: int = 1,
    n_trials: int = 1000,
    seed: int = 0,
    z_threshold: float = 3.0,
    progress: bool = False,
    name: str | None = None,
) -> ValueAudit:
    r"""Audit a value estimator's bias and spread against the exact KL of ``testbed``.

    .. math:: \text{bias} = E[\hat K] - KL, \quad \widehat{se} = \hat\sigma / \sqrt{n_{draws}}

    Samples: ``n_trials`` independent batches of ``batch_size`` draws from pi, generator seeded
    with ``seed``.

    Args:
      estimator: a spec string (``"k3"``, ``"cv:loo"``, ...; see :class:`EstimatorSpec`) or a
        function from a :class:`~klest.testbeds.Sample` to a scalar or per-row tensor.
      testbed: the exact testbed.
      direction: the KL the estimator claims, ``"pi||ref"`` or ``"ref||pi"``.
      level: for spec strings, ``"token"`` or ``"sequence"`` (see :func:`klest.kl_estimate`).
      batch_size: rows per batch.
      n_trials: number of batches.
      seed: seed of the sampling generator.
      z_threshold: ``|bias| / se`` above which the bias is called significant.
      progress: show a progress bar.
      name: label for a function estimator.

    Returns:
      A :class:`ValueAudit`.

    Example:
      >>> from klest.testbeds import GaussianTestbed
      >>> a = audit_value("k2", GaussianTestbed.schulman(1.0), batch_size=1000, n_trials=20)
      >>> round(a.exact, 6), round(a.expected, 6)  # KL = mu^2/2; k2's mean: mu^2/2 + mu^4/8
      (0.5, 0.625)
      >>> a.significant
      True
    """
    check_direction(direction)
    spec = EstimatorSpec.parse(estimator, level=level) if isinstance(estimator, str) else None
    fn = spec.build(direction) if spec is not None else estimator
    label = spec.label() if spec is not None else (name or getattr(fn, "__name__", "estimator"))
    generator = make_generator(seed)
    if spec is not None and spec.alpha != "ema":
        values = _vectorized_draws(
            spec, testbed, direction, batch_size, n_trials, generator, progress
        )
    else:
        trials = progress_bar(range(n_trials), desc=f"audit {label}", leave=False, enabled=progress)
        with torch.no_grad():
            values = torch.cat(
                [
                    fn(testbed.sample(batch_size, generator=generator)).double().reshape(-1)
                    for _ in trials
                ]
            )
    exact = float(testbed.exact_kl(direction).detach())
    mean = float(values.mean())
    bias = mean - exact
    if values.numel() < 2:  # no spread to measure
        std = se_std = se_bias = z = math.nan
    elif _deterministic(values.reshape(-1, 1), torch.tensor([exact]))[0]:
        # No spread beyond rounding: the estimate is exact or off, not a huge z.
        std = se_std = se_bias = 0.0
        off = abs(bias) > 1e-12 * max(abs(exact), abs(mean))
        z = math.copysign(math.inf, bias) if off else 0.0
    else:
        std, se_std = _std_and_se(values)
        se_bias = std / math.sqrt(values.numel())
        z = bias / se_bias
    return ValueAudit(
        estimator=label,
        testbed=testbed.name,
        direction=direction,
        exact=exact,
        expected=spec.exact_mean(testbed, direction) if spec is not None else None,
        mean=mean,
        bias=bias,
        se_bias=se_bias,
        std=std,
        se_std=se_std,
        n_draws=values.numel(),
        z=z,
        significant=abs(z) > z_threshold,
    )


def _z_cell(z: float, deterministic: bool, spec: str) -> str:
    """A table's z: ``exact`` for deterministic draws that match (z = 0 there), ``inf`` for
    deterministic ones that do not, else the number."""
    if deterministic:
        return "exact" if z == 0 else f"{z:+}".replace("+inf", "inf") + " (deterministic)"
    return format(z, spec)


def format_value_audits(audits: list[ValueAudit]) -> str:
    """A markdown table of value audits.

    Args:
      audits: the :class:`ValueAudit` results, one row each, in order.

    Returns:
      The table (header, separator, rows), ending with a newline.
    """
    head = (
        "| estimator | testbed | KL | exact | exact mean of estimator | mean | bias ± se | z "
        "| std | significant bias |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for a in audits:
        expected = "—" if a.expected is None else f"{a.expected:.5g}"
        rows.append(
            f"| {a.estimator} | {a.testbed} | KL({a.direction}) | {a.exact:.5g} | {expected} | "
            f"{a.mean:.5g} | {a.bias:+.3g} ± {a.se_bias:.2g} | {_z_cell(a.z, a.std == 0, '+.2f')} "
            f"| {a.std:.4g} | "
            f"{'yes' if a.significant else 'no'} |"
        )
    return head + "\n".join(rows) + "\n"


# -- gradients ------------------------------------------------------------------------------


def _masked(x: Tensor, mask: Tensor | None) -> Tensor:
    return x if mask is None else torch.where(mask, x, torch.zeros_like(x))


def _clipped_ratio(logp: Tensor, logp_ref: Tensor, mask: Tensor | None) -> Tensor:
    """``min(ref_t / pi_t, 2)``: reads the token's own log-probs."""
    return _masked(torch.exp((logp_ref - logp).clamp(max=math.log(2.0))), mask)


def _clipped_prefix_ratio(logp: Tensor, logp_ref: Tensor, mask: Tensor | None) -> Tensor:
    """``min(prod_{u<t} ref_u / pi_u, 2)``: reads only the tokens before its own (1 at t = 0)."""
    log_ratio = _masked(logp_ref - logp, mask).cumsum(-1) - _masked(logp_ref - logp, mask)
    return _masked(torch.exp(log_ratio.clamp(max=math.log(2.0))), mask)


WEIGHT_RULES: dict[str, Callable[[Tensor, Tensor, Tensor | None], Tensor]] = {
    "clipped-ratio": _clipped_ratio,
    "clipped-prefix-ratio": _clipped_prefix_ratio,
}
r"""Per-token weight rules of :class:`GradSpec` (``;weights=RULE``), functions of the detached
log-probs ``[n, T]`` and the mask: ``clipped-ratio``, :math:`w_t = \min(ref_t/\pi_t, 2)` (reads
the token itself), and ``clipped-prefix-ratio``, :math:`w_t = \min(\prod_{u<t}
ref_u/\pi_u, 2)` (reads only the tokens before it)."""


@dataclass(frozen=True)
class GradSpec:
    """A value/gradient pair for :func:`klest.kl_penalty`: ``"k3/cumulative+loo"``, ``"rb/rb"``.

    Syntax: ``VALUE/GRAD[+BASELINE][;discount=G][;power=A][;weights=RULE]`` where VALUE is a
    value estimator (``cv:0.5`` allowed), GRAD a gradient estimator and BASELINE ``loo``,
    ``mean``, ``loo-fitted``, ``ema`` (a :class:`~klest.BaselineEMA`), ``loo-ema`` (a
    :class:`~klest.LooScaleEMA`), ``exact-kl``, ``exact-kl+loo``
    (``"k3/cumulative+exact-kl+loo"``) or ``value``: a critic's baseline passed as a tensor,
    here the testbed's exact expected future KL(pi||ref) from each prefix (its ``future_kl``;
    for ``score``, from the empty prefix: the KL); an EMA lives as long as the built loss.
    ``discount`` and ``power`` are :func:`klest.kl_penalty`'s (``"k1/cumulative;discount=0.5"``);
    ``weights`` names a rule of per-token weights :math:`w_t` of the objective
    (:data:`WEIGHT_RULES`), passed as ``kl_penalty(weights=...)``.
    """

    value: str
    grad: str
    baseline: str | None = None
    alpha: float | str | None = None
    discount: float = 1.0
    power: float = 0.0
    weights: str | None = None

    @classmethod
    def parse(cls, spec: str) -> GradSpec:
        spec, *settings = spec.split(";")
        options: dict = {}
        for setting in settings:
            key, eq, arg = setting.partition("=")
            if not eq or key not in ("discount", "power", "weights"):
                raise ValueError(
                    f"gradient spec option {setting!r} must be 'discount=G', 'power=A' or "
                    "'weights=RULE'"
                )
            if key == "weights":
                check_choice("weights", arg, tuple(WEIGHT_RULES))
                options[key] = arg
            else:
                options[key] = float(arg)
        value_part, sep, grad_part = spec.partition("/")
        if not sep:
            raise ValueError(f"gradient spec {spec!r} must look like 'k3/cumulative[+loo]'")
        value = value_part.partition(":")[0]
        check_choice("estimator", value, Estimator)
        alpha = None
        if value == "cv":
            alpha = EstimatorSpec.parse(value_part).alpha
        grad, _, baseline = grad_part.partition("+")
        check_choice("grad", grad, tuple(GRADIENT_ESTIMATORS))
        if baseline:
            check_choice("baseline", baseline, (*get_args(Baseline), "ema", "loo-ema", "value"))
        return cls(value, grad, baseline or None, alpha, **options)

    def label(self) -> str:
        value = self.value if self.alpha is None else f"{self.value}:{self.alpha}"
        label = f"{value}/{self.grad}" + (f"+{self.baseline}" if self.baseline else "")
        if self.discount != 1.0:
            label += f";discount={self.discount:g}"
        if self.power != 0.0:
            label += f";power={self.power:g}"
        if self.weights is not None:
            label += f";weights={self.weights}"
        return label

    def objective(self, testbed: Testbed) -> tuple[str, Tensor] | None:
        r"""The objective a weighted spec's mean gradient is claimed to follow, and its exact
        gradient over ``testbed.parameters()`` (flattened), by enumerating every sequence.

        With per-token weights :math:`w_t` (``;weights=RULE``) the claim is the policy gradient
        of the weighted penalties held fixed, :math:`\nabla_{\theta'} E_{y\sim\pi_{\theta'}}
        [\sum_t w_t\rho_t]` (``score`` and ``cumulative``; for weights that read only the tokens
        before their own it is also the gradient of :math:`E_\pi[\sum_t w_t\rho_t]`, which
        ``rb`` follows then). None without weights, or on a testbed that cannot enumerate its
        sequences (``all_sequences``).
        """
        if self.weights is None or not hasattr(testbed, "all_sequences"):
            return None
        tokens, valid = testbed.all_sequences()
        with torch.enable_grad():
            s = testbed.evaluate(tokens)
            logp = s.logp if valid is None else torch.where(valid, s.logp, 0.0)
            w = WEIGHT_RULES[self.weights](s.logp.detach(), s.logp_ref, valid)
            rho = logp - (s.logp_ref if valid is None else torch.where(valid, s.logp_ref, 0.0))
            total = (logp.sum(-1).exp() * (w * rho.detach()).sum(-1)).sum()
            grads = torch.autograd.grad(total, testbed.parameters(), allow_unused=True)
        flat = [
            (torch.zeros_like(p) if g is None else g).reshape(-1).double()
            for g, p in zip(grads, testbed.parameters(), strict=True)
        ]
        return "E[Σ w·ρ] (w·ρ fixed)", torch.cat(flat)

    def build(self, direction: str, testbed: Testbed | None = None) -> Callable[[Sample], Tensor]:
        """A function from a batch to the scalar loss whose gradient is audited (``testbed``:
        where the samples come from, for ``+value``)."""
        if self.baseline == "value" and (
            direction != "pi||ref" or not hasattr(testbed, "future_kl")
        ):
            raise ValueError(
                "baseline 'value' is the exact expected future KL(pi||ref): it needs "
                "direction='pi||ref' and a testbed with future_kl (TabularAutoregressive)"
            )
        baseline: object = self.baseline
        if self.baseline == "ema":
            baseline = BaselineEMA()
        elif self.baseline == "loo-ema":  # one state per built loss: it learns over batches
            baseline = LooScaleEMA()
        alpha: object = AlphaEMA() if self.alpha == "ema" else self.alpha

        uses_logits = "rb" in (self.value, self.grad) or self.baseline in EXACT_KL_BASELINES

        def loss(sample: Sample) -> Tensor:
            given: object = baseline
            if self.baseline == "value":
                future = testbed.future_kl(sample.x)  # type: ignore[union-attr]
                given = future[:, 0] if self.grad == "score" else future
            weights = None
            if self.weights is not None:
                weights = WEIGHT_RULES[self.weights](
                    sample.logp.detach(), sample.logp_ref, sample.mask
                )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", KLGradientWarning)  # the audit measures it
                return kl_penalty(
                    sample.logp,
                    sample.logp_ref,
                    mask=sample.mask,
                    estimator=self.value,
                    reparameterized=sample.reparameterized
                    and GRADIENT_ESTIMATORS[self.grad].samples != "sampled",
                    density=sample.density,
                    grad=self.grad,
                    baseline=given,
                    direction=direction,
                    alpha=alpha,
                    logits=sample.logits if uses_logits else None,
                    logits_ref=sample.logits_ref if uses_logits else None,
                    logp_stl=sample.logp_stl,
                    logp_behavior=sample.logp_behavior,
                    discount=self.discount,
                    power=self.power,
                    weights=weights,
                )

        return loss


@dataclass(frozen=True)
class GradAudit:
    """The outcome of :func:`audit_grad`; vectors are over all parameters, flattened.

    ``rel_bias`` is ``|mean gradient - exact| / |exact|``, which includes the Monte Carlo noise of
    the mean (~ ``sqrt(variance / n_trials)``); ``rel_bias_debiased`` subtracts that noise in
    square (``|bias|^2 - variance / n_trials``, floored at 0). ``*_z`` (see
    :func:`mean_shift_z`) are N(0, 1), tail included, when the mean gradient equals the named
    vector (the exact gradient of the target KL, of the other KL, or zero); values above
    ``z_threshold`` reject it; ``variance`` is 0 for deterministic draws. ``coef_*`` regress
    the mean gradient on the two exact gradients (None when those are nearly parallel).

    ``objective`` names a third exact gradient the mean was tested against (an objective that
    is not a KL: a weighted penalty, a variational bound), ``z_objective`` its statistic; both
    None without one.

    ``mean_grad`` (the mean of the draws), ``bias`` (``mean_grad`` minus the exact gradient of
    the claimed KL) and ``se`` (the standard error of each coordinate of ``mean_grad``,
    ``std / sqrt(n_trials)``) are detached float64 vectors over the flattened parameters; they
    are left out of the printed table and the repr, and :meth:`as_dict` gives them as lists.
    """

    estimator: str
    testbed: str
    direction: str
    batch_size: int
    n_trials: int
    exact_norm: float
    bias_norm: float
    rel_bias: float
    rel_bias_debiased: float
    variance: float
    mse: float
    z_target: float
    z_other: float
    z_zero: float
    cos_pi_ref: float
    cos_ref_pi: float
    coef_pi_ref: float | None
    coef_pi_ref_se: float | None
    coef_ref_pi: float | None
    coef_ref_pi_se: float | None
    verdict: str
    mean_grad: Tensor = field(repr=False, compare=False)
    bias: Tensor = field(repr=False, compare=False)
    se: Tensor = field(repr=False, compare=False)
    objective: str | None = None
    z_objective: float | None = None

    def as_dict(self) -> dict:
        """All fields, the vectors as lists (JSON-able)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in ("mean_grad", "bias", "se"):
            out[key] = out[key].tolist()
        return out


def _flat_grad(loss: Tensor, params: list[Tensor]) -> Tensor:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).reshape(-1).double()
            for g, p in zip(grads, params, strict=True)
        ]
    )


def gradient_draws(
    loss_fn: Callable[[Sample], Tensor],
    testbed: Testbed,
    *,
    batch_size: int,
    n_trials: int,
    seed: int = 0,
    progress: bool = False,
    label: str = "gradient",
) -> Tensor:
    """One flattened gradient of ``loss_fn`` per independent batch: ``[n_trials, n_params]``.

    Args:
      loss_fn: a function from a :class:`~klest.testbeds.Sample` to a scalar loss.
      testbed: the testbed that draws the batches; the gradient is w.r.t.
        ``testbed.parameters()``, flattened and concatenated (float64; 0 for an unused one).
      batch_size: samples per batch.
      n_trials: number of independent batches.
      seed: seed of the sampling generator.
      progress: show a progress bar.
      label: the progress bar's label.

    Returns:
      The gradient draws, ``[n_trials, n_params]`` float64.
    """
    params = testbed.parameters()
    generator = make_generator(seed)
    trials = progress_bar(range(n_trials), desc=f"audit {label}", leave=False, enabled=progress)
    return torch.stack(
        [
            _flat_grad(loss_fn(testbed.sample(batch_size, generator=generator)), params)
            for _ in trials
        ]
    )


def mean_shift_z(draws: Tensor, target: Tensor) -> float:
    r"""Normal deviate of the test "the mean of ``draws`` is ``target``", from the squared distance.

    .. math::
        R = \frac{n \|\bar g - v\|^2}{\operatorname{tr} S}, \qquad
        z = \Phi^{-1}(1 - p), \quad p = P_0(R \ge R_{\text{observed}}),

    with :math:`\bar g` the mean of the ``n`` draws, ``v`` the target and S their sample
    covariance. Under the null (Gaussian draws with covariance C, eigenvalues
    :math:`\lambda_j`) the numerator is :math:`\sum_j \lambda_j \chi^2_1`, the denominator
    :math:`\sum_j \lambda_j \chi^2_{n-1} / (n - 1)`, all independent, so
    :math:`p = P(\sum_j \lambda_j (\chi^2_{1,j} - R\, \chi^2_{n-1,j} / (n - 1)) > 0)`: a
    linear combination of chi-squares, evaluated exactly (numerical inversion of its moment
    generating function through the saddlepoint, accurate however small p is) with the
    :math:`\lambda_j` estimated by the eigenvalues of S (those of the ``n x n`` Gram matrix of
    the centred draws when there are fewer draws than coordinates). With one dominant direction
    R is an F(1, n - 1) variable, with many equal ones an F(k, k(n - 1)); the tail follows the
    largest eigenvalues, not a normal approximation. Estimating the spectrum from the same
    draws makes it look more concentrated than it is when ``n`` is not much larger than the
    number of coordinates that vary, which errs conservative (a false-alarm rate below the
    nominal). z is then N(0, 1) under the null, so a one-sided threshold keeps its normal
    meaning: ``z > 4.92`` has probability 4.3e-7.

    No matrix is inverted, so rarely visited states (near-singular covariance) do not break it;
    its power is against biases that are large in Euclidean norm next to the noise, which is
    what matters for a gradient. Draws that never vary (to rounding) are deterministic: z is 0
    when they match ``target`` to rounding, else ``inf``.

    Args:
      draws: ``[n, d]`` independent draws (n >= 2), e.g. from :func:`gradient_draws`.
      target: ``[d]``, the hypothesised mean.

    Returns:
      z, a Python float (``inf`` for a deterministic mismatch).

    Reference: Imhof, "Computing the distribution of quadratic forms in normal variables",
    Biometrika 48 (1961).
    """
    return _mean_shift_zs(draws, [target])[0]


def _check_draws(draws: Tensor, targets: list[Tensor]) -> None:
    if draws.dim() != 2 or draws.shape[0] < 2:
        raise ValueError(f"draws must be [n, d] with n >= 2, got shape {tuple(draws.shape)}")
    for target in targets:
        if target.shape != draws.shape[1:]:
            raise ValueError(
                f"target must be [d] = {tuple(draws.shape[1:])} like a draw, got shape "
                f"{tuple(target.shape)}"
            )


def _deterministic(draws: Tensor, *others: Tensor) -> tuple[bool, float]:
    """Whether ``draws`` never vary beyond rounding (their spread below 1e-9 of the scale), and
    that scale (the largest magnitude among the draws and ``others``)."""
    scale = max(float(t.abs().max()) if t.numel() else 0.0 for t in (draws, *others))
    spread = float((draws - draws.mean(0)).abs().max()) if draws.numel() else 0.0
    return spread <= 1e-9 * scale or scale == 0.0, scale


def _mean_shift_zs(draws: Tensor, targets: list[Tensor]) -> list[float]:
    """:func:`mean_shift_z` of several targets, sharing the covariance's spectrum."""
    _check_draws(draws, targets)
    draws = draws.double()
    targets = [t.double() for t in targets]
    n = draws.shape[0]
    mean = draws.mean(0)
    deterministic, scale = _deterministic(draws, *targets)
    if deterministic:
        return [
            math.inf if float((mean - t).abs().max()) > 1e-7 * max(scale, 1e-300) else 0.0
            for t in targets
        ]
    centred = draws - mean
    small = centred @ centred.T if n <= centred.shape[1] else centred.T @ centred
    eig = torch.linalg.eigvalsh(small).numpy() / (n - 1)  # the covariance's nonzero spectrum
    eig = eig[eig > 1e-13 * eig.max()]  # rounding noise of the zero eigenvalues
    trace = float(eig.sum())
    return [
        _mean_shift_deviate(eig, n, n * float(((mean - target) ** 2).sum()) / trace)
        for target in targets
    ]


def _mean_shift_deviate(eig: np.ndarray, n: int, ratio: float) -> float:
    """z of :func:`mean_shift_z` from the covariance's nonzero eigenvalues ``eig``, the number
    of draws ``n`` and the observed ``ratio`` ``n |mean - target|^2 / tr S``."""
    if ratio == 0.0:
        return -math.inf
    weights = np.concatenate([eig, -ratio * eig / (n - 1)])
    df = np.concatenate([np.ones(eig.size), np.full(eig.size, n - 1.0)])
    return normal_upper_deviate(*chi2_combination_log_tails(weights, df))


def audit_grad(
    estimator: str | Callable[[Sample], Tensor],
    testbed: Testbed,
    *,
    direction: str = "pi||ref",
    batch_size: int = 8,
    n_trials: int = 1000,
    seed: int = 0,
    z_threshold: float = 4.0,
    progress: bool = False,
    name: str | None = None,
    objective: tuple[str, Tensor] | None = None,
) -> GradAudit:
    r"""Audit a gradient estimator against the exact gradients of both KLs on ``testbed``.

    .. math::
        \text{bias} = E[\hat g] - \nabla KL, \qquad \text{MSE} = E\|\hat g - \nabla KL\|^2,
        \qquad \text{variance} = \operatorname{tr} \operatorname{Cov}(\hat g)

    and which KL the estimator descends: tests (:func:`mean_shift_z`) of
    ``E[g] = grad KL(pi||ref)``,
    ``= grad KL(ref||pi)`` and ``= 0``, cosines, and a regression of the mean gradient on the
    two exact gradients.

    Samples: ``n_trials`` independent batches of ``batch_size`` from pi (seeded); each batch gives
    one gradient of the loss w.r.t. ``testbed.parameters()``.

    Args:
      estimator: a :class:`GradSpec` string (``"k3/cumulative+loo"``) or a function from a
        :class:`~klest.testbeds.Sample` to a scalar loss.
      testbed: the exact testbed.
      direction: the KL the estimator claims to descend.
      batch_size: samples per batch (one gradient draw per batch).
      n_trials: number of independent batches.
      seed: seed of the sampling generator.
      z_threshold: a statistic above this rejects the corresponding hypothesis.
      progress: show a progress bar.
      name: label for a function estimator.
      objective: ``(label, gradient)``: a third hypothesis, the exact gradient ``[n_params]``
        (flattened over ``testbed.parameters()``) of an objective that is not a KL; the verdict
        then says whether the mean gradient follows it. None: a spec's own
        (:meth:`GradSpec.objective`), if any.

    Returns:
      A :class:`GradAudit`.

    Example:
      >>> from klest.testbeds import CategoricalTestbed
      >>> testbed = CategoricalTestbed.random(5, seed=2)
      >>> audit_grad("k3/autodiff", testbed, n_trials=600).verdict  # TRL's k3 loss
      'descends KL(ref||pi), not KL(pi||ref)'
      >>> audit_grad("k3/score", testbed, n_trials=600).verdict
      'descends KL(pi||ref)'
    """
    check_direction(direction)
    other = "ref||pi" if direction == "pi||ref" else "pi||ref"
    spec = GradSpec.parse(estimator) if isinstance(estimator, str) else None
    fn = spec.build(direction, testbed) if spec is not None else estimator
    label = spec.label() if spec is not None else (name or getattr(fn, "__name__", "estimator"))
    if objective is None and spec is not None:
        objective = spec.objective(testbed)
    draws = gradient_draws(
        fn,
        testbed,
        batch_size=batch_size,
        n_trials=n_trials,
        seed=seed,
        progress=progress,
        label=label,
    )
    exact = {
        d: torch.cat([g.reshape(-1).double() for g in testbed.exact_kl_grad(d)])
        for d in ("pi||ref", "ref||pi")
    }
    target = exact[direction]
    mean, bias, variance, mse = _grad_stats(draws, target)
    targets = [target, exact[other], torch.zeros_like(target)]
    if objective is not None:
        targets.append(objective[1].reshape(-1).double())
    zs = _mean_shift_zs(draws, targets)
    z = dict(zip(("target", "other", "zero", "objective"), zs, strict=False))
    coefs, ses = _regress_on_exact(draws, exact["pi||ref"], exact["ref||pi"])
    return GradAudit(
        estimator=label,
        testbed=testbed.name,
        direction=direction,
        batch_size=batch_size,
        n_trials=n_trials,
        exact_norm=float(target.norm()),
        bias_norm=float(bias.norm()),
        rel_bias=float(bias.norm() / target.norm().clamp(min=1e-300)),
        rel_bias_debiased=math.sqrt(max(float(bias.norm()) ** 2 - variance / n_trials, 0.0))
        / max(float(target.norm()), 1e-300),
        variance=variance,
        mse=mse,
        z_target=z["target"],
        z_other=z["other"],
        z_zero=z["zero"],
        cos_pi_ref=_cos(mean, exact["pi||ref"]),
        cos_ref_pi=_cos(mean, exact["ref||pi"]),
        coef_pi_ref=coefs[0],
        coef_pi_ref_se=ses[0],
        coef_ref_pi=coefs[1],
        coef_ref_pi_se=ses[1],
        verdict=_verdict(z, z_threshold, direction, None if objective is None else objective[0]),
        mean_grad=mean.detach(),
        bias=bias.detach(),
        se=(draws.std(0) / math.sqrt(n_trials)).detach() * (variance > 0),
        objective=None if objective is None else objective[0],
        z_objective=z.get("objective"),
    )


def _grad_stats(draws: Tensor, target: Tensor) -> tuple[Tensor, Tensor, float, float]:
    """``(mean, bias, variance, mse)`` of gradient draws ``[n_trials, n_params]`` against the
    exact ``target``: the mean draw, its difference from ``target``, the trace of one draw's
    covariance (unbiased) and ``E||g - target||^2``."""
    n_trials = draws.shape[0]
    mean = draws.mean(0)
    bias = mean - target
    centred = draws - mean
    variance = float((centred**2).sum(1).mean() * n_trials / (n_trials - 1))
    if _deterministic(draws, target)[0]:
        variance = 0.0  # rounding, not spread
    mse = float(((draws - target) ** 2).sum(1).mean())
    return mean, bias, variance, mse


def _cos(a: Tensor, b: Tensor) -> float:
    denom = float(a.norm() * b.norm())
    return float(a @ b) / denom if denom > 0 else 0.0


def _regress_on_exact(
    draws: Tensor, grad_pi_ref: Tensor, grad_ref_pi: Tensor
) -> tuple[tuple[float | None, float | None], tuple[float | None, float | None]]:
    """Least-squares coefficients of each draw on the two exact gradients, averaged over draws,
    with their standard errors: ``((coef_pi_ref, coef_ref_pi), (se_pi_ref, se_ref_pi))``; all
    None when the two gradients are nearly parallel (|cos| >= 0.99: the split is unidentified)."""
    if not abs(_cos(grad_pi_ref, grad_ref_pi)) < 0.99:
        return (None, None), (None, None)
    n_trials = draws.shape[0]
    design = torch.stack([grad_pi_ref, grad_ref_pi], 1)
    per_trial = torch.linalg.lstsq(design, draws.T).solution  # [2, n_trials]
    coefs = tuple(float(c) for c in per_trial.mean(1))
    ses = tuple(float(s) for s in per_trial.std(1) / math.sqrt(n_trials))
    return (coefs[0], coefs[1]), (ses[0], ses[1])


def _verdict(
    z: dict[str, float], threshold: float, direction: str, objective: str | None = None
) -> str:
    """Which KL the mean gradient follows, from the ``z`` statistics of "the mean gradient is the
    exact gradient of the claimed KL" (``"target"``), "... of the other KL" (``"other"``) and
    "... is zero" (``"zero"``); a statistic above ``threshold`` rejects its hypothesis. With an
    ``objective`` (``z["objective"]``: "... of that objective"), whether it follows that."""
    ok = {key: value <= threshold for key, value in z.items()}
    if objective is not None:
        kl = _verdict(z, threshold, direction)
        if ok["objective"] and ok["target"]:
            return kl  # the objective's gradient and the KL's are indistinguishable here
        if ok["objective"]:
            return f"descends {objective}, not KL({direction})"
        return f"{kl}; not {objective}"
    other = "ref||pi" if direction == "pi||ref" else "pi||ref"
    if ok["target"] and not ok["other"]:
        return f"descends KL({direction})"
    if ok["other"] and not ok["target"]:
        return f"descends KL({other}), not KL({direction})"
    if ok["target"] and ok["other"]:
        return "unbiased for both KLs (indistinguishable here)"
    if ok["zero"]:
        return "mean gradient zero"
    return "biased: neither KL"


def _objective_note(a: GradAudit) -> str:
    """The objective's statistic, after the verdict (none without an objective)."""
    if a.objective is None or a.z_objective is None:
        return ""
    return f" (z(objective) {_z_cell(a.z_objective, a.variance == 0, '.1f')})"


def format_grad_audits(audits: list[GradAudit]) -> str:
    """A markdown table of gradient audits.

    Args:
      audits: the :class:`GradAudit` results, one row each, in order.

    Returns:
      The table (header, separator, rows), ending with a newline.
    """
    head = (
        "| estimator | claims | rel. bias (noise removed) | variance | MSE | z(target) | z(other) "
        "| z(zero) "
        "| coef on ∇KL(pi‖ref) | coef on ∇KL(ref‖pi) | verdict |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def coef(c: float | None, se: float | None) -> str:
        return "—" if c is None else f"{c:+.3f} ± {se:.3f}"

    rows = [
        f"| {a.estimator} | KL({a.direction}) | {a.rel_bias_debiased:.3f} | {a.variance:.4g} | "
        f"{a.mse:.4g} | {_z_cell(a.z_target, a.variance == 0, '.1f')} | "
        f"{_z_cell(a.z_other, a.variance == 0, '.1f')} | "
        f"{_z_cell(a.z_zero, a.variance == 0, '.1f')} | "
        f"{coef(a.coef_pi_ref, a.coef_pi_ref_se)} | {coef(a.coef_ref_pi, a.coef_ref_pi_se)} | "
        f"{a.verdict}{_objective_note(a)} |"
        for a in audits
    ]
    return head + "\n".join(rows) + "\n"
