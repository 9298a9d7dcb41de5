"""klest's warnings point at the caller's line, not at klest's internals: however deep the call
went inside klest (a drop-in calling ``kl_penalty``, checks read at the end of a call), the
warning's file and line are those of the code outside klest that made the call."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import klest
from klest import KLGradientWarning
from klest.integrations import openrlhf, verl

B, T = 3, 4


def _log_probs(requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    lr = -torch.rand(B, T, generator=g, dtype=torch.float64)
    return lp.requires_grad_(requires_grad), lr


def _caught(call) -> tuple[list[warnings.WarningMessage], int]:
    """The warnings ``call()`` gives, and the line of this file that made the klest call (the
    line of ``call``'s body)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    _, line = inspect.getsourcelines(call)
    return caught, line


def _assert_here(caught: list[warnings.WarningMessage], line: int, category, text: str):
    hits = [w for w in caught if issubclass(w.category, category) and text in str(w.message)]
    assert hits, [str(w.message) for w in caught]
    for w in hits:
        assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno, line)


def test_kl_penalty_warns_at_the_callers_line():
    lp, lr = _log_probs()
    caught, line = _caught(lambda: klest.kl_penalty(lp, lr, grad="token"))
    _assert_here(caught, line, KLGradientWarning, "grad='token'")


@pytest.mark.parametrize("peer", ["verl", "openrlhf"])
def test_drop_ins_warn_at_the_callers_line(peer):
    lp, lr = _log_probs(requires_grad=False)
    if peer == "verl":
        caught, line = _caught(lambda: verl.kl_penalty(lp, lr, "k3", grad="cumulative"))
        name = "logprob"
    else:
        caught, line = _caught(lambda: openrlhf.compute_approx_kl(lp, lr, grad="cumulative"))
        name = "log_probs"
    _assert_here(caught, line, KLGradientWarning, f"{name} does not require grad")


def test_kl_reward_warns_at_the_callers_line():
    lp, lr = _log_probs()
    caught, line = _caught(lambda: klest.kl_reward(lp, lr, estimator="k3"))
    _assert_here(caught, line, KLGradientWarning, "kl_reward(estimator='k3')")


def test_a_warning_read_with_the_checks_points_at_the_callers_line(monkeypatch):
    monkeypatch.setattr("klest._checks._WARNED_ONCE", set())  # once per process: give it here
    lp, lr = _log_probs()
    options = dict(estimator="cv", alpha="loo", level="sequence", group=torch.tensor([0, 0, 1]))
    caught, line = _caught(lambda: klest.kl_estimate(lp, lr, **options))
    _assert_here(caught, line, UserWarning, "fits alpha within groups")


def test_a_klest_module_warns_at_the_callers_line_not_in_torch():
    lp, lr = _log_probs()
    penalty = klest.nn.KLPenalty(grad="token")
    caught, line = _caught(lambda: penalty(lp, lr))
    _assert_here(caught, line, KLGradientWarning, "grad='token'")
