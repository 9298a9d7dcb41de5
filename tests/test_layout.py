"""Packed sequences (``cu_seqlens``) give the values and gradients of the padded batch of the
same sequences, for every function that reads a sequence structure.

The batch: 5 sequences of lengths 4, 0 (empty), 1, 3, 6 in groups (0, 0, 1, 1, 1), float64,
with a mask that drops tokens inside sequences. Both layouts compute the same sums in the same
order up to the gather, so they agree to a few float64 roundings: ``TOL`` is 1e-12 on values
of order 1-10 (exact in practice).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import klest
from klest.testbeds import make_generator

pytestmark = pytest.mark.filterwarnings("ignore::klest.KLGradientWarning")

LENGTHS = [4, 0, 1, 3, 6]
GROUP = torch.tensor([0, 0, 1, 1, 1])
T, V = max(LENGTHS), 5
TOL = 1e-12


def _padded_batch(seed: int = 0):
    g = make_generator(seed)
    z = torch.randn(len(LENGTHS), T, V, generator=g, dtype=torch.float64)
    y = torch.randn(len(LENGTHS), T, V, generator=g, dtype=torch.float64)
    w = torch.randn(len(LENGTHS), T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (len(LENGTHS), T), generator=g)

    def at_tokens(x):
        return x.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    inside = torch.arange(T) < torch.tensor(LENGTHS).unsqueeze(-1)
    mask = inside.clone()
    mask[0, 2] = False  # a hole inside a sequence
    mask[4, 0] = False  # and one at a sequence's start
    return {
        "z": z,
        "y": y,
        "logp_ref": at_tokens(y),
        "logp_behavior": at_tokens(w),
        "tokens": tokens,
        "mask": mask,
        "inside": inside,
    }


B = _padded_batch()
CU = torch.tensor([0, *itertools.accumulate(LENGTHS)])


def packed(x: torch.Tensor) -> torch.Tensor:
    """The padded ``[S, T, ...]`` tensor's tokens, one sequence after another."""
    return x[B["inside"]]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)), what
    a, b = a.detach(), b.detach()
    err = (a - b)[torch.isfinite(a)].abs().max() if a.numel() else torch.tensor(0.0)
    assert float(err) <= TOL, (what, float(err))


def _both(call, reduction: str, what: str, *, logits: bool = False) -> None:
    """``call(z, ...)`` on the padded and on the packed batch: equal values and gradients (the
    packed gradient is the padded one's tokens; padded positions get none)."""
    z_pad = B["z"].clone().requires_grad_()
    z_pack = packed(B["z"]).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            a = call(z_pad, padded=True)
        except ValueError as e:
            with pytest.raises(ValueError):
                call(z_pack, padded=False)
            return str(e)
        b = call(z_pack, padded=False)
    if reduction == "none":
        a = packed(a)
    _close(a, b, what)
    (ga,) = torch.autograd.grad(a.sum(), z_pad, allow_unused=True)
    (gb,) = torch.autograd.grad(b.sum(), z_pack, allow_unused=True)
    ga = torch.zeros_like(z_pad) if ga is None else ga
    gb = torch.zeros_like(z_pack) if gb is None else gb
    assert float(ga[~B["inside"]].abs().max()) == 0.0, what
    _close(packed(ga), gb, what + " gradient")
    return None


def logp_of(z: torch.Tensor, padded: bool) -> torch.Tensor:
    """log softmax(z) at the sampled tokens, in either layout."""
    tokens = B["tokens"] if padded else packed(B["tokens"])
    return z.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _sampled_inputs(z: torch.Tensor, padded: bool, ref_grad: bool = False):
    logp = logp_of(z, padded)
    logp_ref = B["logp_ref"] if padded else packed(B["logp_ref"])
    if ref_grad:  # reparameterized samples: the ref log-density carries the graph too
        logp_ref = logp_ref + 0.0 * z.sum(-1)
    common = (
        {"mask": B["mask"]}
        if padded
        else {"mask": packed(B["mask"]), "cu_seqlens": CU, "max_seqlen": T}
    )
    logits = (z, B["y"]) if padded else (z, packed(B["y"]))
    return logp, logp_ref, common, logits


ESTIMATORS = ["k1", "k2", "k3", "abs", "cv", "rb"]
GRADS = ["pathwise", "adaptive", "stl", "score", "cumulative", "rb", "token", "autodiff"]
BASELINES = [None, "loo", "mean", "loo-fitted", "exact-kl", "exact-kl+loo", "ema", "loo-ema"]
REDUCTIONS = [
    "seq-mean-token-sum",
    "token-mean",
    "seq-mean-token-mean",
    "sum",
    "per-sequence",
    "none",
]


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
@pytest.mark.parametrize("off_policy", [False, True])
def test_kl_penalty_packed_equals_padded_for_every_option(direction, off_policy):
    """Every estimator x gradient x baseline x reduction: packed == padded, or both refused."""
    ran = 0
    for estimator, grad, baseline, reduction in itertools.product(
        ESTIMATORS, GRADS, BASELINES, REDUCTIONS
    ):
        reparameterized = grad in ("pathwise", "adaptive", "stl")

        def call(
            z,
            *,
            padded,
            estimator=estimator,
            grad=grad,
            baseline=baseline,
            reduction=reduction,
            reparameterized=reparameterized,
        ):
            logp, logp_ref, common, (zz, yy) = _sampled_inputs(z, padded, reparameterized)
            if baseline == "ema":
                baseline = klest.BaselineEMA()
            elif baseline == "loo-ema":
                baseline = klest.LooScaleEMA()
            behavior = B["logp_behavior"] if padded else packed(B["logp_behavior"])
            return klest.kl_penalty(
                logp,
                logp_ref,
                estimator=estimator,
                grad=grad,
                direction=direction,
                reduction=reduction,
                baseline=baseline,
                group=GROUP if baseline is not None else None,
                reparameterized=reparameterized,
                alpha=0.7 if estimator == "cv" else None,
                logp_behavior=behavior if off_policy else None,
                logits=zz,
                logits_ref=yy,
                logp_stl=logp.detach() if grad == "stl" else None,
                **common,
            )

        what = f"{estimator}/{grad}/{baseline}/{reduction}"
        ran += _both(call, reduction, what) is None
    assert ran > 300  # most combinations run (the refused ones are refused in both layouts)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs", "cv", "rb"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_kl_estimate_packed_equals_padded(estimator, level, reduction):
    def call(z, *, padded):
        logp, logp_ref, common, (zz, yy) = _sampled_inputs(z, padded)
        return klest.kl_estimate(
            logp,
            logp_ref,
            estimator=estimator,
            level=level,
            reduction=reduction,
            alpha="loo" if estimator == "cv" else None,
            group=GROUP if estimator == "cv" else None,
            logits=zz if estimator == "rb" else None,
            logits_ref=yy if estimator == "rb" else None,
            **common,
        )

    _both(call, reduction, f"{estimator}/{level}/{reduction}")


@pytest.mark.parametrize("reward_to_go", [False, True])
@pytest.mark.parametrize("discount", [1.0, 0.9])
def test_kl_reward_stops_at_sequence_ends_when_packed(reward_to_go, discount):
    if discount != 1.0 and not reward_to_go:
        return
    logp, logp_ref = logp_of(B["z"], True), B["logp_ref"]
    kw = {"reward_to_go": reward_to_go, "discount": discount}
    a = klest.kl_reward(logp, logp_ref, mask=B["mask"], **kw)
    b = klest.kl_reward(packed(logp), packed(logp_ref), mask=packed(B["mask"]), cu_seqlens=CU, **kw)
    _close(packed(a), b, "kl_reward")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_logits_functions_packed_equal_padded(reduction):
    g = make_generator(3)
    w = torch.randn(V, 4, generator=g, dtype=torch.float64)
    h = torch.randn(len(LENGTHS), T, 4, generator=g, dtype=torch.float64)
    topk_idx = torch.topk(B["y"], 2, dim=-1).indices
    topk_lp = B["y"].log_softmax(-1).gather(-1, topk_idx)
    calls = {
        "kl_from_logits": lambda z, y, **k: klest.kl_from_logits(z, y, **k),
        "jsd": lambda z, y, **k: klest.jsd_from_logits(z, y, beta=0.3, **k),
        "skew": lambda z, y, **k: klest.skew_kl_from_logits(z, y, alpha=0.2, **k),
        "tv": lambda z, y, **k: klest.tv_from_logits(z, y, **k),
    }
    for name, fn in calls.items():

        def call(z, *, padded, fn=fn):
            y = B["y"] if padded else packed(B["y"])
            common = (
                {"mask": B["mask"]} if padded else {"mask": packed(B["mask"]), "cu_seqlens": CU}
            )
            return fn(z, y, reduction=reduction, **common)

        _both(call, reduction, f"{name}/{reduction}")

    def hidden(z, *, padded):  # z stands in for the hidden states' perturbation
        hh = (h if padded else packed(h)) + z[..., :4]
        common = {"mask": B["mask"]} if padded else {"mask": packed(B["mask"]), "cu_seqlens": CU}
        return klest.kl_from_hidden(hh, w, hh.detach(), w * 0.5, reduction=reduction, **common)

    _both(hidden, reduction, f"kl_from_hidden/{reduction}")

    def topk(z, *, padded):
        common = {"mask": B["mask"]} if padded else {"mask": packed(B["mask"]), "cu_seqlens": CU}
        idx, lp = (topk_idx, topk_lp) if padded else (packed(topk_idx), packed(topk_lp))
        return klest.kl_from_topk(z, idx, lp, estimator="truncated", reduction=reduction, **common)

    _both(topk, reduction, f"kl_from_topk/{reduction}")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_aggregate_and_modules_packed_equal_padded(reduction):
    values = logp_of(B["z"], True)
    a = klest.aggregate(values, mask=B["mask"], reduction=reduction)
    b = klest.aggregate(packed(values), mask=packed(B["mask"]), reduction=reduction, cu_seqlens=CU)
    _close(packed(a) if reduction == "none" else a, b, "aggregate")
    module = klest.nn.KLPenalty(beta=0.5, baseline="loo", reduction=reduction)

    def call(z, *, padded):
        logp, logp_ref, common, _ = _sampled_inputs(z, padded)
        return module(logp, logp_ref, group=GROUP, **common)

    _both(call, reduction, "KLPenalty")
    logits_module = klest.nn.KLFromLogits(reduction=reduction)

    def call_logits(z, *, padded):
        y = B["y"] if padded else packed(B["y"])
        common = {"mask": B["mask"]} if padded else {"mask": packed(B["mask"]), "cu_seqlens": CU}
        return logits_module(z, y, **common)

    _both(call_logits, reduction, "KLFromLogits")


def test_packed_edge_cases_one_sequence_and_length_one_documents():
    """A single packed sequence, and every document of length 1 (each its own sequence)."""
    g = make_generator(5)
    lp, lr = (
        -torch.rand(7, generator=g, dtype=torch.float64),
        -torch.rand(7, generator=g, dtype=torch.float64),
    )
    one = klest.kl_penalty(lp, lr, cu_seqlens=torch.tensor([0, 7]), reduction="sum")
    _close(one, klest.kl_penalty(lp[None], lr[None], reduction="sum"), "one sequence")
    ones = torch.arange(8)
    _close(
        klest.kl_penalty(lp, lr, cu_seqlens=ones, reduction="per-sequence"),
        klest.kl_penalty(lp[:, None], lr[:, None], reduction="per-sequence"),
        "documents of length 1",
    )
    none = klest.kl_penalty(lp[:0], lr[:0], cu_seqlens=torch.tensor([0, 0, 0]), reduction="sum")
    assert float(none) == 0.0


@pytest.mark.parametrize(
    ("cu", "shape", "kind", "match"),
    [
        (torch.tensor([0, 3, 2, 5]), (5,), ValueError, "never decrease"),
        (torch.tensor([0, 3, 4]), (5,), ValueError, "end at the number of packed tokens, 5"),
        (torch.tensor([1, 3, 5]), (5,), ValueError, "start at 0"),
        (torch.tensor([0.0, 5.0]), (5,), TypeError, "integer offsets"),
        (torch.tensor([[0, 5]]), (5,), ValueError, "1-D"),
        (torch.tensor([0, 2, 4]), (2, 2), ValueError, r"shape \[total\] or \[1, total\]"),
        ([0, 5], (5,), TypeError, "torch.Tensor"),
    ],
)
def test_bad_cu_seqlens_are_refused_by_name(cu, shape, kind, match):
    lp = -torch.rand(shape, dtype=torch.float64)
    with pytest.raises(kind, match=match):
        klest.kl_penalty(lp, lp * 0.5, cu_seqlens=cu)


def test_cu_seqlens_checked_on_the_device_with_max_seqlen():
    """With max_seqlen the offsets are not read on the host: the value checks refuse bad ones,
    and validate=False trusts them."""
    lp = -torch.rand(5, dtype=torch.float64)
    with pytest.raises(ValueError, match="max_seqlen=2"):
        klest.kl_penalty(lp, lp * 0.5, cu_seqlens=torch.tensor([0, 3, 5]), max_seqlen=2)
    with pytest.raises(ValueError, match="max_seqlen applies only with cu_seqlens"):
        klest.kl_penalty(lp, lp * 0.5, max_seqlen=2)


def test_cu_seqlens_from_position_and_sequence_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1]])
    assert klest.cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 4, 6]
    assert klest.cu_seqlens_from_sequence_ids(torch.tensor([3, 3, 1, 1, 1, 2])).tolist() == [
        0,
        2,
        5,
        6,
    ]
    with pytest.raises(ValueError, match="start each sequence at 0"):
        klest.cu_seqlens_from_position_ids(torch.tensor([1, 2, 0]))


def test_a_trailing_dimension_of_one_is_refused_with_the_fix():
    lp = -torch.rand(2, 3, 1)
    for call in (
        lambda: klest.kl_penalty(lp, lp * 0.5),
        lambda: klest.kl_estimate(lp, lp * 0.5),
        lambda: klest.kl_reward(lp, lp * 0.5),
    ):
        with pytest.raises(ValueError, match=r"trailing dimension of 1.*logp\.squeeze\(-1\)"):
            call()


def test_group_without_a_baseline_that_uses_it_warns():
    lp = -torch.rand(4, 3, dtype=torch.float64, requires_grad=True)
    group = torch.tensor([0, 0, 1, 1])
    for baseline in (None, klest.BaselineEMA(), "exact-kl"):
        with pytest.warns(UserWarning, match="group ids are ignored"):
            klest.kl_penalty(
                lp,
                lp.detach() * 0.5,
                group=group,
                baseline=baseline,
                logits=torch.zeros(4, 3, 2),
                logits_ref=torch.zeros(4, 3, 2),
            )
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        klest.kl_penalty(lp, lp.detach() * 0.5, group=group, baseline="loo")
        klest.kl_penalty(lp, lp.detach() * 0.5, group=group, estimator="cv", alpha="loo")


def test_leave_one_out_over_a_single_sequence_says_it_does_nothing(monkeypatch):
    monkeypatch.setattr("klest._checks._WARNED_ONCE", set())
    lp = -torch.rand(1, 4, dtype=torch.float64, requires_grad=True)
    with pytest.warns(UserWarning, match="batch of one sequence"):
        klest.kl_penalty(lp, lp.detach() * 0.5, baseline="loo")
    with warnings.catch_warnings():  # once per process; two rows: no warning
        warnings.simplefilter("error", UserWarning)
        klest.kl_penalty(lp, lp.detach() * 0.5, baseline="loo")
        monkeypatch.setattr("klest._checks._WARNED_ONCE", set())
        two = -torch.rand(2, 4, dtype=torch.float64, requires_grad=True)
        klest.kl_penalty(two, two.detach() * 0.5, baseline="loo")
