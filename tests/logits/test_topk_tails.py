"""kl_from_topk's tail diagnostic: the Pareto k-hat of the ratio its sampled tail averages,
against the same ratio computed from the full distributions, and its warning."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import klest
import klest._checks
from klest.logits.topk import TAIL_WARNING, kl_from_topk
from klest.pareto import PARETO_K_THRESHOLD, pareto_k
from klest.testbeds import make_generator
from tests._tolerance import assert_close_to_rounding
from tests.test_host_syncs import counted_host_reads

N, V, K = 3000, 40, 4


def _case(seed: int = 0, spread: float = 3.0):
    """N positions of a student and a teacher over V tokens (float64), the teacher's top K,
    and one token sampled from the student at each position."""
    g = make_generator(seed)
    z = spread * torch.randn(N, V, generator=g, dtype=torch.float64)
    teacher = (spread * torch.randn(N, V, generator=g, dtype=torch.float64)).log_softmax(-1)
    top_logp, idx = teacher.topk(K, dim=-1)
    y = torch.multinomial(z.softmax(-1), 1, generator=g)[:, 0]
    return z, teacher, idx, top_logp, y


def _reference_log_ratio(z, teacher, idx, y, estimator, direction):
    """The ratio the sampled tail term averages, from the full distributions, per position:
    ``w = ref_y / pi_y`` (``unbiased``, and ``unbiased-cv`` of KL(ref||pi)) or
    ``u = (ref_y / R_tail) / (pi_y / P_tail)`` (``unbiased-cv`` of KL(pi||ref)); ratio 0 where
    y is in the top K."""
    student = z.log_softmax(-1)
    log_w = teacher.gather(-1, y[:, None])[:, 0] - student.gather(-1, y[:, None])[:, 0]
    if estimator == "unbiased-cv" and direction == "pi||ref":
        p_tail = 1 - student.gather(-1, idx).exp().sum(-1)
        r_tail = 1 - teacher.gather(-1, idx).exp().sum(-1)
        log_w = log_w + p_tail.log() - r_tail.log()
    out = (idx != y[:, None]).all(-1)
    return torch.where(out, log_w, -math.inf)


def _call(z, teacher, idx, top_logp, y, **options):
    return kl_from_topk(
        z, idx, top_logp, labels=y, logp_ref_label=teacher.gather(-1, y[:, None])[:, 0], **options
    )


@pytest.mark.parametrize(
    ("estimator", "direction"),
    [("unbiased", "ref||pi"), ("unbiased-cv", "ref||pi"), ("unbiased-cv", "pi||ref")],
)
def test_the_sampled_tails_ratio_k_hat(estimator, direction, monkeypatch):
    """``diagnostics.pareto_k`` is the k-hat of the ratio the sampled term averages over the
    counted positions (0 where the token is in S): computed here from the full distributions,
    equal up to the rounding of the log-ratios (a few float64 ulps of their size, which move
    k-hat by as many of its own ulps times the 16 M of its sums: tests/test_pareto.py)."""
    monkeypatch.setattr(klest._checks, "_WARNED_ONCE", set())
    z, teacher, idx, top_logp, y = _case()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, details = _call(
            z, teacher, idx, top_logp, y, estimator=estimator, direction=direction,
            return_details=True,
        )  # fmt: skip
    log_ratio = _reference_log_ratio(z, teacher, idx, y, estimator, direction)
    want = pareto_k(log_ratio)
    m = math.ceil(min(N / 5, 3 * math.sqrt(N)))
    size = float(log_ratio[torch.isfinite(log_ratio)].abs().max())
    assert_close_to_rounding(
        torch.tensor(details.diagnostics.pareto_k), want, ulps=16 * m * (1 + size), scale=1.0
    )


@pytest.mark.parametrize(
    ("estimator", "direction"),
    [
        ("unbiased", "pi||ref"),
        ("tail-bucket", "pi||ref"),
        ("truncated", "ref||pi"),
        ("truncated-raw", "pi||ref"),
    ],
)
def test_no_ratio_no_k_hat(estimator, direction):
    """``unbiased`` of KL(pi||ref) averages a log-ratio, the others sample nothing: None."""
    z, teacher, idx, top_logp, y = _case()
    sampled = estimator == "unbiased"
    _, details = kl_from_topk(
        z,
        idx,
        top_logp,
        labels=y if sampled else None,
        logp_ref_label=teacher.gather(-1, y[:, None])[:, 0] if sampled else None,
        estimator=estimator,
        direction=direction,
        return_details=True,
    )
    assert details.diagnostics.pareto_k is None


def test_a_heavy_sampled_tail_warns_once_with_no_extra_host_read(monkeypatch):
    """Teacher and student far apart (spread 3 logits): w's k-hat is above 0.7; one warning per
    process, naming the remedies, read with the value checks: the call makes as many host
    reads as without the diagnostic (the positions' own read of the labels, and the checks')."""
    case = _case()
    with monkeypatch.context() as without:
        without.setattr(klest.logits.topk, "_tail_check", lambda *a, **k: None)
        with counted_host_reads(without) as reads_before:
            _call(*case, direction="ref||pi")
    monkeypatch.setattr(klest._checks, "_WARNED_ONCE", set())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with monkeypatch.context() as counting, counted_host_reads(counting) as reads:
            _call(*case, direction="ref||pi")
        _, details = _call(*case, direction="ref||pi", return_details=True)
    texts = [str(w.message) for w in record if "heavy upper tail" in str(w.message)]
    assert reads == reads_before, (reads, reads_before)
    assert details.diagnostics.pareto_k > PARETO_K_THRESHOLD
    (text,) = texts
    assert "a larger k" in text and "'tail-bucket'" in text and f"over {N} positions" in text
    assert TAIL_WARNING in klest._checks._WARNED_ONCE


def test_nothing_is_computed_without_validation_or_details(monkeypatch):
    calls = []
    monkeypatch.setattr(
        klest.logits.topk, "pareto_k", lambda *a, **k: calls.append(1) or pareto_k(*a, **k)
    )
    monkeypatch.setattr(klest._checks, "_WARNED_ONCE", set())
    case = _case()
    _call(*case, direction="ref||pi", validate=False)
    assert not calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, details = _call(*case, direction="ref||pi", validate=False, return_details=True)
    assert calls and details.diagnostics.pareto_k > PARETO_K_THRESHOLD
