r"""Measure an estimator against a testbed's exact answer: bias, spread, and significance.

An estimator is audited by drawing independent batches from a testbed with fixed seeds,
applying the estimator to each, and comparing the draws with the exact KL:

- ``mean``, ``bias = mean - exact`` and its standard error ``std / sqrt(n_draws)``;
- ``std``, the spread of one draw, and the standard error of that std (delta method with the
  fourth central moment, so heavy tails widen it honestly);
- ``z = bias / se_bias`` and ``significant = |z| > z_threshold``;
- ``expected``: the estimator's exact mean where the testbed can compute it (biased estimators
  are checked against their own exact mean, not only against the KL).

A *draw* is whatever the estimator returns per batch: a scalar (the batch estimate) or one
value per independent row (per-sample estimates; e.g. Schulman's table uses batch_size rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from klest._checks import check_choice, check_direction
from klest.estimators import ESTIMATORS, kl_estimate, per_token_values
from klest.testbeds.base import Sample, Testbed, make_generator

EstimateFn = Callable[[Sample], Tensor]


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
        check_choice("estimator", name, ESTIMATORS)
        if name != "cv":
            if arg:
                raise ValueError(f"estimator {name!r} takes no argument, got {spec!r}")
            return cls(name, None, level)
        if not arg:
            raise ValueError("estimator 'cv' needs a coefficient: 'cv:0.5', 'cv:loo', 'cv:ema'...")
        try:
            return cls(name, float(arg), level)
        except ValueError:
            check_choice("alpha", arg, ("loo", "crossfit", "in-sample", "ema"))
            return cls(name, arg, level)

    @property
    def fitted(self) -> bool:
        return isinstance(self.alpha, str)

    def label(self) -> str:
        text = self.estimator if self.alpha is None else f"{self.estimator}:{self.alpha}"
        return text if self.level == "token" else f"{text}@sequence"

    def build(self, direction: str) -> EstimateFn:
        """A function from one batch to its draws: per-row values, or the batch mean if fitted."""
        from klest.control_variates import AlphaEMA

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
        values = kl_estimate(
            sample.logp,
            sample.logp_ref,
            estimator=self.estimator,
            direction=direction,
            alpha=self.alpha if alpha is None else alpha,
            mask=sample.mask,
            level=self.level,
            reduction="none",
            group=group,
        )
        return values.sum(-1) if values.ndim >= 2 else values

    def exact_mean(self, testbed: Testbed, direction: str) -> float | None:
        """The estimator's exact expectation on ``testbed``, when computable."""
        if self.fitted:
            return None

        def per_token(delta: Tensor) -> Tensor:
            return per_token_values(delta, self.estimator, direction, alpha=self.alpha)

        try:
            if self.level == "sequence" and hasattr(testbed, "sequence_expectation"):
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
    if progress:
        from tqdm.auto import tqdm

        blocks = tqdm(blocks, desc=f"audit {spec.label()}", leave=False, disable=None)
    draws = []
    for trials in blocks:
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
        trials = range(n_trials)
        if progress:
            from tqdm.auto import tqdm

            trials = tqdm(trials, desc=f"audit {label}", leave=False, disable=None)
        with torch.no_grad():
            values = torch.cat(
                [
                    fn(testbed.sample(batch_size, generator=generator)).double().reshape(-1)
                    for _ in trials
                ]
            )
    exact = float(testbed.exact_kl(direction).detach())
    mean = float(values.mean())
    std, se_std = _std_and_se(values)
    se_bias = std / math.sqrt(values.numel())
    bias = mean - exact
    z = bias / se_bias if se_bias > 0 else (0.0 if bias == 0 else math.inf)
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


def format_value_audits(audits: list[ValueAudit]) -> str:
    """A markdown table of value audits."""
    head = (
        "| estimator | testbed | KL | exact | exact mean of estimator | mean | bias ± se | z "
        "| std | significant bias |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for a in audits:
        expected = "—" if a.expected is None else f"{a.expected:.5g}"
        rows.append(
            f"| {a.estimator} | {a.testbed} | KL({a.direction}) | {a.exact:.5g} | {expected} | "
            f"{a.mean:.5g} | {a.bias:+.3g} ± {a.se_bias:.2g} | {a.z:+.2f} | {a.std:.4g} | "
            f"{'yes' if a.significant else 'no'} |"
        )
    return head + "\n".join(rows) + "\n"
