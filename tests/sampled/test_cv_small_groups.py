"""The once-per-process warning of ``kl_estimate(estimator="cv", alpha="loo",
level="sequence", group=...)`` at small groups, and where it must stay silent.

Deterministic: the warning is a function of the group sizes only. Each test resets the
process-wide record of given warnings, and restores it after.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from klest import kl_estimate
from klest._checks import _WARNED_ONCE
from klest.sampled.estimators import SMALL_GROUP


@pytest.fixture(autouse=True)
def fresh_warning_record():
    saved = set(_WARNED_ONCE)
    _WARNED_ONCE.clear()
    yield
    _WARNED_ONCE.clear()
    _WARNED_ONCE.update(saved)


def _batch(rows: int, t: int = 4):
    g = torch.Generator().manual_seed(rows)
    logp = -torch.rand(rows, t, generator=g, dtype=torch.float64) - 0.1
    logp_ref = -torch.rand(rows, t, generator=g, dtype=torch.float64) - 0.1
    return logp, logp_ref


def _call(logp, logp_ref, group, **kw):
    options = dict(estimator="cv", alpha="loo", level="sequence", group=group)
    options.update(kw)
    return kl_estimate(logp, logp_ref, **options)


def test_small_groups_warn_once_per_process():
    logp, logp_ref = _batch(2 * SMALL_GROUP + 2)
    group = torch.arange(2 * SMALL_GROUP + 2) // 2  # pairs: groups of 2
    with pytest.warns(UserWarning, match="groups of at most 10 rows .*Leave out group="):
        first = _call(logp, logp_ref, group)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        again = _call(logp, logp_ref, group)
    assert torch.equal(first, again)  # the value does not depend on the warning


def test_one_small_group_among_large_ones_warns():
    rows = 3 * (SMALL_GROUP + 1) + SMALL_GROUP
    logp, logp_ref = _batch(rows)
    group = torch.cat([torch.arange(3).repeat_interleave(SMALL_GROUP + 1),
                       torch.full((SMALL_GROUP,), 7)])  # fmt: skip
    with pytest.warns(UserWarning, match=rf"\({SMALL_GROUP} row\(s\) here\)"):
        _call(logp, logp_ref, group)


@pytest.mark.parametrize(
    ("rows_per_group", "kw"),
    [
        (SMALL_GROUP + 1, {}),  # groups large enough
        (2, {"level": "token"}),  # token level: not the measured failure
        (2, {"alpha": "crossfit"}),  # another fit
        (2, {"validate": False}),  # no validation read, no check
    ],
)
def test_no_warning_where_it_does_not_apply(rows_per_group, kw):
    logp, logp_ref = _batch(3 * rows_per_group)
    group = torch.arange(3 * rows_per_group) // rows_per_group
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call(logp, logp_ref, group, **kw)
        kl_estimate(logp, logp_ref, estimator="cv", alpha="loo", level="sequence")  # no group
    assert not _WARNED_ONCE


def test_an_error_is_raised_before_the_warning():
    logp, logp_ref = _batch(4)
    logp_ref[0, 0] = torch.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="logp_ref"):
            _call(logp, logp_ref, torch.tensor([0, 0, 1, 1]))
