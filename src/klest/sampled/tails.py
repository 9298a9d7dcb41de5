r"""Stage 3b of the sampled-token path: the tail diagnostic of the ratios a value averages.

Several value estimators average a ratio. k3 and the control variate add
:math:`\alpha(r - 1)`, :math:`r = ref/\pi`, to k1 (its mean is 0 because :math:`E_\pi[r] = 1`);
every estimator of KL(ref||pi) from samples of pi weights them by r; off-policy, every value is
multiplied by the importance weight :math:`w = \pi/behavior` (k3 and cv then carry
:math:`w r = ref/behavior` as well); ``rb`` weights the exact KLs by the prefix weights (and,
for KL(ref||pi), the prefix ratios). Where those ratios have a heavy upper tail, the part of
their mean that lives in the tail comes from samples a batch almost never holds, so a typical
batch's value is *below* the KL, by more than its standard error shows: the estimator is
unbiased, the batch is not (for :math:`\pi = N(\mu, \sigma^2 I)` and :math:`ref = N(0, I)` in 16
dimensions, k3's batch values sit about a nat below the KL once :math:`\sigma \le 0.55`).

:func:`tail_check` measures it: the Pareto shape k-hat (:func:`klest.pareto.pareto_k`) of the
ratios the value carries, at the value's level (tokens, or sequences with ``level="sequence"``;
the valid ones only, pooled over the batch), the largest over the ratios when there are two
(off-policy k3: ``w`` and ``w r``). Above ``PARETO_K_THRESHOLD`` (0.7) the value's call gives a
``UserWarning``, once per process, that names the safer value to log: k1's (no ratio in it), the
exact KL where there is one (``torch.distributions.kl_divergence``, ``estimator="rb"`` with the
logits), or a smaller step off-policy. The k-hat goes to the details
(``diagnostics.pareto_k``): None where the value carries no ratio (k1, k2 and abs of KL(pi||ref)
on-policy, on-policy ``rb`` of KL(pi||ref)), NaN with fewer than ``MIN_SAMPLES`` (50) valid
ratios, where no tail can be fitted (and no warning is given).

Cost: nothing with ``validate=False`` and no details, and nothing once the warning has been
given unless details are asked for. Otherwise one ``topk`` of the largest ratios and a few small
reductions on the device; the comparison with 0.7 is read with the value checks' one host
synchronisation. Below about a thousand ratios one call's k-hat is noisy: for light-tailed
ratios (k near 0) it exceeds 0.7 in about 2% of batches of 64 and 0.05% of batches of 200, so
read ``diagnostics.pareto_k`` over several calls before acting on a single one.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klest._checks import ValueChecks
from klest.pareto import MIN_SAMPLES, PARETO_K_THRESHOLD, pareto_k
from klest.sampled.log_ratios import LogRatios, at_sequence_level

__all__ = ["TAIL_WARNING", "carried_log_ratios", "tail_check", "worst_pareto_k"]

TAIL_WARNING = "ratio-tail"
"""The key of the once-per-process warning of a heavy-tailed ratio."""

# The values that are a function of r = ref/pi (on-policy); the others are functions of delta.
_CARRY_R = {"pi||ref": ("k3", "cv"), "ref||pi": ("k1", "k3", "abs", "cv", "f")}


def carried_log_ratios(
    lr: LogRatios, *, estimator: str, direction: str, level: str
) -> tuple[list[Tensor], Tensor | None]:
    """The log-ratios the value of ``estimator`` averages, each ``[rows, T]`` (``[rows, 1]`` at
    the sequence level), with their validity (None: all count); no list where it carries none.

    ``estimator`` ``"f"`` stands for :func:`klest.f_divergence` (a function of r).
    """
    if estimator == "rb":  # the exact KLs' weights: W_{<t}, times R_{<t} for KL(ref||pi)
        log_weight = None if lr.log_w is None else _before(lr.log_w.detach())
        if direction == "ref||pi":
            log_ratio = _before(-lr.delta.detach())
            log_weight = log_ratio if log_weight is None else log_weight + log_ratio
        return ([] if log_weight is None else [log_weight]), lr.valid
    seq = at_sequence_level(lr) if level == "sequence" else lr
    carries_r = estimator == "f" or estimator in _CARRY_R[direction]
    log_r = -seq.delta.detach()
    if seq.log_w is None:
        return ([log_r] if carries_r else []), seq.valid
    log_w = seq.log_w.detach()
    return ([log_w, log_w + log_r] if carries_r else [log_w]), seq.valid


def _before(x: Tensor) -> Tensor:
    """The sums over the earlier tokens of each row (shifted, not ``cumsum - x``: a -inf
    log-weight would give -inf - -inf)."""
    cum = x.cumsum(-1)
    return torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], -1)


def worst_pareto_k(sets: list[Tensor], valid: Tensor | None) -> Tensor:
    """The largest k-hat over the sets of log-ratios (each ``[rows, T]``, pooled over the
    batch's valid entries), 0-dim; NaN when none can be fitted."""
    x = torch.stack([s.reshape(-1) for s in sets])
    mask = None if valid is None else valid.reshape(1, -1).expand_as(x)
    k = pareto_k(x, mask=mask)
    if len(sets) == 1:
        return k[0]
    # NaN only where every set is NaN (they share their valid entries; ties may differ).
    return (
        torch.where(torch.isnan(k), -math.inf, k).amax().nan_to_num(nan=math.nan, neginf=math.nan)
    )


def tail_check(
    lr: LogRatios,
    *,
    estimator: str,
    direction: str,
    level: str,
    checks: ValueChecks,
    details: bool,
    caller: str,
) -> Tensor | None:
    """The k-hat of the ratios ``estimator``'s value carries (0-dim), with the warning above 0.7
    queued on ``checks``; None where the value carries no ratio, or where neither the warning
    (validation off, or already given) nor ``details`` needs it (nothing is computed then).
    ``caller`` names the call in the warning (``"kl_estimate(estimator='k3')"``)."""
    warn = checks.pending(TAIL_WARNING)
    if not (warn or details):
        return None
    sets, valid = carried_log_ratios(lr, estimator=estimator, direction=direction, level=level)
    if not sets:
        return None
    k = worst_pareto_k(sets, valid)
    if warn:
        n = valid.sum() if valid is not None else torch.full((), sets[0].numel(), device=k.device)
        message = _message(caller, estimator, direction, off_policy=lr.log_w is not None)
        checks.warn_once_read(TAIL_WARNING, (k, n), _above_threshold, message)
    return k


def _above_threshold(k: float, n: float) -> bool:
    return k > PARETO_K_THRESHOLD  # NaN (too few ratios) never warns


def _message(caller: str, estimator: str, direction: str, *, off_policy: bool):
    if off_policy:
        which = "the importance weights w = pi/behavior"
        if estimator == "f" or estimator in _CARRY_R[direction]:
            which += " and w r = ref/behavior"
        advice = (
            "Take a smaller step off-policy (behavior closer to pi: fewer updates per batch of "
            "samples, a smaller learning rate) or draw fresh samples from pi"
        )
    elif estimator == "rb":
        which = "the prefix ratios ref/pi of each position's prefix"
        advice = "Use the exact KL where there is one (klest.kl_from_logits), or samples from ref"
    elif direction == "ref||pi":
        which = "r = ref/pi: every estimate of KL(ref||pi) from samples of pi weights them by r"
        advice = (
            "Prefer the exact KL (estimator='rb' with the logits, klest.kl_from_logits, or the "
            "closed form: torch.distributions.kl_divergence), or samples from ref"
        )
    else:
        which = "r = ref/pi, through r - 1"
        advice = (
            "For logging, prefer k1's value (estimator='k1': the log-ratio itself, no ratio "
            "in it) or the exact KL where there is one (a VAE's Gaussians: "
            "torch.distributions.kl_divergence, or klest.kl_penalty(q, p) with the "
            "distributions themselves; tokens: estimator='rb' with the logits). The gradients "
            "of KL(pi||ref) (grad='pathwise', 'cumulative', 'score') carry no ratio"
        )

    def text(k: float, n: float) -> str:
        return (
            f"{caller}: the ratios its value averages ({which}) have a heavy upper tail: "
            f"Pareto k-hat {k:.2f} > {PARETO_K_THRESHOLD} over {int(n)} samples (the PSIS "
            "diagnostic, klest.pareto). Beyond 0.7 the mean of such ratios lives in samples a "
            "batch almost never holds, so the value is typically below the KL by more than its "
            f"standard error shows. {advice}. return_details=True reports the k-hat of every "
            f"call in diagnostics.pareto_k (NaN below {MIN_SAMPLES} samples; one call's is "
            "noisy below about a thousand). This warning is given once per process."
        )

    return text
