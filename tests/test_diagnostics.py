"""``details.diagnostics`` for every reduction, against a brute-force computation here.

The units (``KLDiagnostics``): valid sequences for ``"seq-mean-*"`` and ``"per-sequence"``
(their token sums, or token means for ``"seq-mean-token-mean"``), valid tokens otherwise; at
``level="sequence"`` every row holds one value, so the units are the valid sequences. ``mean``
and ``stderr`` (``std / sqrt(n_units)``, NaN below 2 units) are over the units; ``mean`` is the
returned value for the three mean reductions; ``frac_negative`` is over the valid per-token
values (per-sequence values at the sequence level); ``n_empty_rows`` counts rows without a valid
token. The values themselves come from ``tests/_reference.py``'s formulas.
"""

from __future__ import annotations

import math

import pytest
import torch

import klest
from klest.testbeds import make_generator
from tests._reference import random_log_probs, values_reference

REDUCTIONS = (
    "none",
    "per-sequence",
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "sum",
)
MEANS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
SEQUENCE_LEVEL = ("per-sequence", "seq-mean-token-sum", "sum")


def brute_force_diagnostics(values, mask, reduction, level):
    """(mean, stderr, frac_negative, n_units, n_empty_rows) by Python loops over rows.

    ``values``: per-token ``[B, T]`` / ``[N]`` (token level) or per-row ``[B]`` (sequence
    level) float64 values, 0 where masked; ``mask`` the token mask of the input.
    """
    rows_m = mask.reshape(-1, mask.shape[-1] if mask.ndim >= 2 else 1).tolist()
    if level == "sequence":
        rows_v = [[v] for v in values.reshape(-1).tolist()]
        rows_m = [[any(m)] for m in rows_m]
    else:
        rows_v = values.reshape(len(rows_m), -1).tolist()
    kept_rows = [
        [v for v, m in zip(vr, mr, strict=True) if m] for vr, mr in zip(rows_v, rows_m, strict=True)
    ]
    tokens = [v for kept in kept_rows for v in kept]
    nonempty = [kept for kept in kept_rows if kept]
    if reduction in ("seq-mean-token-sum", "per-sequence"):
        units = [sum(kept) for kept in nonempty]
    elif reduction == "seq-mean-token-mean":
        units = [sum(kept) / len(kept) for kept in nonempty]
    else:
        units = tokens
    n = len(units)
    mean = sum(units) / n if n else 0.0
    if n >= 2:
        var = sum((u - mean) ** 2 for u in units) / (n - 1)
        stderr = math.sqrt(var / n)
    else:
        stderr = math.nan
    frac_negative = sum(v < 0 for v in tokens) / max(len(tokens), 1)
    return mean, stderr, frac_negative, n, len(kept_rows) - len(nonempty)


def _inputs(shape, seed):
    g = make_generator(seed)
    logp = random_log_probs(shape, g).requires_grad_(True)
    logp_ref = random_log_probs(shape, g)
    mask = torch.rand(shape, generator=g) > 0.3
    mask[..., 0] = True
    mask[1] = False  # an empty row (a masked sample of a 1-D input)
    return logp, logp_ref, mask


CASES = [
    (reduction, level)
    for reduction in REDUCTIONS
    for level in ("token", "sequence")
    if level == "token" or reduction in SEQUENCE_LEVEL
]


@pytest.mark.parametrize("shape", [(6, 5), (9,)])
@pytest.mark.parametrize("function", ["kl_estimate", "kl_penalty"])
@pytest.mark.parametrize(("reduction", "level"), CASES)
def test_diagnostics_match_a_brute_force_computation(reduction, level, function, shape):
    logp, logp_ref, mask = _inputs(shape, seed=len(shape))
    kwargs = {"mask": mask, "reduction": reduction, "level": level, "return_details": True}
    if function == "kl_estimate":
        value, details = klest.kl_estimate(logp, logp_ref, estimator="k1", **kwargs)
    else:
        value, details = klest.kl_penalty(
            logp, logp_ref, estimator="k1", grad="cumulative", **kwargs
        )
    values = values_reference(
        logp, logp_ref, estimator="k1", direction="pi||ref", mask=mask, level=level
    )
    mean, stderr, frac_negative, n_units, n_empty = brute_force_diagnostics(
        values, mask, reduction, level
    )
    diag = details.diagnostics
    assert (diag.n_units, diag.n_empty_rows) == (n_units, n_empty)
    assert n_empty >= 1 and 0 < frac_negative < 1  # the case exercises both
    assert diag.mean == pytest.approx(mean, rel=1e-12, abs=1e-15)
    assert diag.stderr == pytest.approx(stderr, rel=1e-10)
    # A ratio of counts, divided in float32 by klest (0.6 comes out 0.6000000238).
    assert diag.frac_negative == pytest.approx(frac_negative, rel=1e-7)
    assert diag.alpha is None
    if reduction in MEANS:
        assert diag.mean == pytest.approx(float(value.detach()), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("function", ["kl_estimate", "kl_penalty"])
def test_one_unit_has_no_standard_error_and_an_empty_batch_has_none_either(function):
    logp, logp_ref, _ = _inputs((3, 4), seed=3)

    def call(*args, **kwargs):
        if function == "kl_estimate":
            return klest.kl_estimate(*args, estimator="k1", **kwargs)
        return klest.kl_penalty(*args, estimator="k1", grad="cumulative", **kwargs)

    one_row = torch.zeros(3, 4, dtype=torch.bool)
    one_row[0, :2] = True
    _, details = call(logp, logp_ref, mask=one_row, return_details=True)
    diag = details.diagnostics
    assert (diag.n_units, diag.n_empty_rows) == (1, 2) and math.isnan(diag.stderr)
    row_sum = float((logp - logp_ref).detach()[0, :2].sum())
    assert diag.mean == pytest.approx(row_sum, rel=1e-12)
    _, details = call(logp, logp_ref, mask=torch.zeros(3, 4, dtype=torch.bool), return_details=True)
    diag = details.diagnostics
    assert (diag.n_units, diag.n_empty_rows, diag.mean, diag.frac_negative) == (0, 3, 0.0, 0.0)
    assert math.isnan(diag.stderr)
