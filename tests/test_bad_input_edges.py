"""Every value check fed values at its edges: just above and below each threshold in each float
dtype, +-0, +-inf, NaN, subnormals. A value the check must refuse gives a ValueError whose
message starts with (or names) the argument; an accepted one gives no error; no check ever
raises another exception (an error message built from a different comparison than the one
that failed finds no bad position and fails while being written).

Which values each check must refuse is written here from the documentation, in float64 (every
float dtype's values are float64 values): log-probs are refused when NaN, +inf, -inf where the
argument cannot be -inf, or above 0 by more than rounding (``1e-3``; ``2^-4`` for log-probs
computed in bf16 / fp16); masks hold only 0 and 1; coefficients, surrogates and exact KLs are
finite; labels lie in ``[0, V)`` or are ``ignore_index``; a temperature is finite and > 0, a
decay in ``[0, 1)``, a discount in ``(0, 1]``. Examples are drawn by hypothesis (derandomized:
``tests/conftest.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import klest
from klest.integrations import openrlhf, verl

# kl_penalty called without a graph says its gradient is not recorded: not what is tested here.
pytestmark = pytest.mark.filterwarnings("ignore::klest.KLGradientWarning")

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF = (torch.float16, torch.bfloat16)


def _above_zero_tol(dtype: torch.dtype) -> float:
    """How far above 0 a log-prob computed in ``dtype`` may be from rounding alone."""
    return 2.0**-4 if dtype in HALF else 1e-3


def _next(x: float, dtype: torch.dtype, toward: float) -> float:
    """The ``dtype`` neighbour of ``x`` (rounded to ``dtype``) toward ``toward``."""
    t = torch.tensor(x, dtype=torch.float64).to(dtype)
    return float(torch.nextafter(t, torch.tensor(toward, dtype=dtype)))


def _edge_values(dtype: torch.dtype, thresholds: tuple[float, ...]) -> list[float]:
    """+-0, +-inf, NaN, the smallest subnormals and normals, and each threshold rounded to
    ``dtype`` with its two neighbours, all as ``dtype`` values."""
    fi = torch.finfo(dtype)
    subnormal = float(
        torch.nextafter(torch.tensor(0.0, dtype=dtype), torch.tensor(1.0, dtype=dtype))
    )
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, subnormal, -subnormal, fi.tiny, -fi.tiny]
    values += [-1.0, -0.5]
    for t in thresholds:
        r = float(torch.tensor(t, dtype=torch.float64).to(dtype))
        values += [r, _next(t, dtype, math.inf), _next(t, dtype, -math.inf)]
    return values


def _tensor(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def _expect(call: Callable[[], object], bad: list[str], *, also: tuple[str, ...] = ()) -> None:
    """``call()`` raises a ValueError naming one of ``bad`` (its first word, or named in
    ``also``'s phrasing) when ``bad`` is non-empty, and nothing otherwise."""
    if not bad:
        call()
        return
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert any(message.startswith(name) for name in bad) or any(a in message for a in also), (
        bad,
        message,
    )


def _bad_log_probs(x: torch.Tensor, *, neg_inf: bool, density: bool = False, rounding=None):
    """Whether log-probs ``x`` must be refused (documented rule, in float64)."""
    tol = math.inf if density else _above_zero_tol(rounding or x.dtype)
    d = x.double()
    return bool(
        d.isnan().any()
        | (d == math.inf).any()
        | (d > tol).any()
        | ((d == -math.inf).any() & (not neg_inf))
    )


def _log_prob_edges(dtype: torch.dtype) -> list[float]:
    return _edge_values(dtype, (_above_zero_tol(dtype), 1e-3, 2.0**-4))


@st.composite
def _log_prob_pair(draw):
    dtype = draw(st.sampled_from(FLOATS))
    edges = _log_prob_edges(dtype)
    n = draw(st.integers(1, 3))
    pick = st.lists(st.sampled_from(edges), min_size=n, max_size=n)
    return dtype, _tensor(draw(pick), dtype), _tensor(draw(pick), dtype), _tensor(draw(pick), dtype)


@settings(max_examples=150, deadline=None)
@given(_log_prob_pair())
def test_sampled_path_log_prob_checks_at_the_edges(case):
    """klest's estimators, penalty and reward, and the verl / OpenRLHF drop-ins, under their
    own argument names: log-probs (and behaviour log-probs) at the edges of each rule."""
    _dtype, a, b, c = case
    bad_a = _bad_log_probs(a, neg_inf=False)
    bad_b = _bad_log_probs(b, neg_inf=True)
    bad_ab = ["logp"] * bad_a + ["logp_ref"] * bad_b
    _expect(lambda: klest.k3(a, b), bad_ab)
    _expect(lambda: klest.k1(a, b, reduction="none"), bad_ab)
    _expect(lambda: klest.kl_reward(a, b), bad_ab)
    _expect(
        lambda: verl.kl_penalty(a, b, "low_var_kl"),
        ["logprob"] * bad_a + ["ref_logprob"] * bad_b,
    )
    # kl_penalty's gradient needs logp_ref > -inf where pi sampled (KL(pi||ref) is infinite).
    bad_pen = ["logp"] * bad_a + ["logp_ref"] * _bad_log_probs(b, neg_inf=False)
    _expect(lambda: klest.kl_penalty(a.clone().requires_grad_(), b), bad_pen)
    # Off-policy: pi may give a behaviour sample probability 0; the behaviour policy may not.
    bad_off = (
        ["logp"] * _bad_log_probs(a, neg_inf=True)
        + ["logp_ref"] * bad_b
        + ["logp_behavior"] * _bad_log_probs(c, neg_inf=False)
    )
    _expect(lambda: klest.k3(a, b, logp_behavior=c), bad_off)
    _expect(
        lambda: openrlhf.compute_approx_kl(a, b, c, kl_estimator="k2"),
        ["log_probs"] * _bad_log_probs(a, neg_inf=True)
        + ["log_probs_base"] * bad_b
        + ["log_probs_old"] * _bad_log_probs(c, neg_inf=False),
    )
    # Log-densities may exceed 0: only NaN, +inf and (for logp) -inf are refused.
    bad_density = ["logp"] * _bad_log_probs(a, neg_inf=False, density=True) + [
        "logp_ref"
    ] * _bad_log_probs(b, neg_inf=True, density=True)
    _expect(lambda: klest.k1(a, b, density=True), bad_density)


def test_the_reported_edge_float32_1e_3_is_a_value_error():
    """float32(1e-3) lies above 1e-3: refused, with a message about values above 0."""
    with pytest.raises(ValueError, match=r"^logp has values above 0 .*largest 0\.001"):
        klest.k3(torch.tensor([1e-3]), torch.zeros(1))
    with pytest.raises(ValueError, match=r"^logp_ref has values above 0"):
        klest.k3(torch.zeros(1), torch.tensor([1e-3]))
    # float64's 1e-3 is the threshold itself: accepted
    klest.k3(torch.tensor([1e-3], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))


@st.composite
def _topk_case(draw):
    dtype = draw(st.sampled_from(FLOATS))
    edges = [*_log_prob_edges(dtype), math.log(0.5), math.log(0.25)]
    top = _tensor(draw(st.lists(st.sampled_from(edges), min_size=2, max_size=2)), dtype)
    label = _tensor([draw(st.sampled_from(edges))], dtype)
    return dtype, top, label


# How far above 1 the teacher's top-k mass may be from rounding (documented: "up to rounding").
_MASS_TOL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-7}


@settings(max_examples=100, deadline=None)
@given(_topk_case())
def test_topk_teacher_checks_at_the_edges(case):
    """kl_from_topk: the teacher's top-k log-probs (finite, <= 0, mass <= 1 up to rounding)
    and its log-prob of the sampled token (finite, <= 0) at the edges."""
    dtype, top, label = case
    z = torch.zeros(1, 4)
    idx = torch.tensor([[0, 1]])
    bad_top = _bad_log_probs(top, neg_inf=False)
    mass = float(top.double().exp().sum())
    mass_tol = _MASS_TOL.get(dtype, 1e-4)
    # away from the mass threshold by more than float32's rounding of a 2-term logsumexp
    if abs(mass - (1 + mass_tol)) < 1e-6:
        return
    bad_mass = mass > 1 + mass_tol
    bad = ["topk_logp"] * (bad_top or bad_mass)
    _expect(
        lambda: klest.kl_from_topk(z, idx, top[None], estimator="tail-bucket"),
        bad,
    )
    bad_label = ["logp_ref_label"] * _bad_log_probs(label, neg_inf=False)
    _expect(
        lambda: klest.kl_from_topk(
            z, idx, top[None], labels=torch.tensor([2]), logp_ref_label=label
        ),
        bad + bad_label,
    )


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from((*FLOATS, torch.int64, torch.uint8)),
    st.lists(st.integers(0, 20), min_size=1, max_size=4),
)
def test_mask_checks_at_the_edges(dtype, picks):
    """A numeric mask holds only 0 and 1 (-0 is 0); 0.5, 1 +- an ulp, subnormals, +-inf, NaN
    and other integers are refused, naming the mask under the caller's name."""
    if dtype.is_floating_point:
        edges = _edge_values(dtype, (1.0, 0.5))
    else:
        edges = [0, 1, 2, 255 if dtype == torch.uint8 else -1]
    values = [edges[i % len(edges)] for i in picks]
    mask = torch.tensor(values, dtype=torch.float64).to(dtype)
    bad = bool(((mask.double() != 0) & (mask.double() != 1)).any())
    logp = torch.full((len(values),), -0.5)
    logp_ref = torch.full((len(values),), -0.7)
    _expect(lambda: klest.k3(logp, logp_ref, mask=mask), ["mask"] * bad)
    _expect(lambda: klest.kl_reward(logp, logp_ref, mask=mask), ["mask"] * bad)
    _expect(
        lambda: openrlhf.compute_approx_kl(logp, logp_ref, kl_estimator="k3", action_mask=mask),
        ["action_mask"] * bad,
    )
    logits = torch.zeros(len(values), 3)
    _expect(
        lambda: klest.kl_from_logits(logits, logits, mask=mask),
        ["mask"] * bad,
    )


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(FLOATS), st.lists(st.integers(0, 30), min_size=1, max_size=3))
def test_finite_checks_at_the_edges(dtype, picks):
    """Coefficients, exact per-position KLs and surrogates must be finite: only NaN and +-inf
    are refused (subnormals, +-0 and the largest finite values pass)."""
    fi = torch.finfo(dtype)
    edges = _edge_values(dtype, (fi.max, -fi.max))
    x = _tensor([edges[i % len(edges)] for i in picks], dtype)
    bad = not bool(torch.isfinite(x).all())
    n = x.numel()
    logp, logp_ref = torch.full((n,), -0.5), torch.full((n,), -0.7)
    _expect(lambda: klest.cv(logp, logp_ref, alpha=x.float()), ["alpha"] * bad)
    _expect(
        lambda: klest.kl_estimate(logp, logp_ref, estimator="rb", position_kls=x),
        ["position_kls"] * bad,
    )
    _expect(
        lambda: klest.decouple(torch.zeros(n, dtype=dtype), x),
        ["surrogate"] * bad,
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 4, 5, -1, -100, -101, 2**62, -(2**62)]), min_size=1, max_size=3)
)
def test_label_checks_at_the_edges(labels):
    """Labels lie in ``[0, V)`` (V = 5) or are ``ignore_index`` (-100)."""
    y = torch.tensor(labels)
    bad = bool((((y < 0) | (y >= 5)) & (y != -100)).any())
    z = torch.zeros(len(labels), 5)
    _expect(lambda: klest.token_log_probs(z, y), ["labels"] * bad)
    _expect(lambda: klest.kl_from_logits(z, z, labels=y), ["labels"] * bad)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FLOATS), st.integers(0, 40), st.integers(0, 2))
def test_logits_rows_without_a_distribution_at_the_edges(dtype, pick, where):
    """A row of logits has a distribution unless it holds NaN or +inf, or is all -inf; the
    largest finite logits, subnormals and a single -inf are fine."""
    fi = torch.finfo(dtype)
    edges = _edge_values(dtype, (fi.max, -fi.max))
    v = edges[pick % len(edges)]
    z = torch.zeros(3, 4, dtype=dtype)
    z[where, 1] = v
    all_minus_inf = z.clone()
    all_minus_inf[where] = -math.inf
    bad = math.isnan(v) or v == math.inf
    _expect(lambda: klest.categorical_kl(z, z.flip(0)), ["logits"] * bad)
    _expect(lambda: klest.kl_from_logits(z, z.flip(0)), ["logits"] * bad)
    _expect(lambda: klest.kl_from_logits(all_minus_inf, z), ["logits"])
    labels = torch.zeros(3, dtype=torch.long)
    _expect(lambda: klest.token_log_probs(z, labels), ["logits"] * bad)


@pytest.mark.parametrize(
    ("name", "make", "lo", "hi", "lo_open", "hi_open"),
    [
        (
            "temperature",
            lambda t: klest.kl_from_logits(torch.zeros(2, 3), torch.zeros(2, 3), temperature=t),
            1.0 / torch.finfo(torch.float32).max,
            math.inf,
            False,
            True,
        ),
        ("decay", lambda d: klest.BaselineEMA(decay=d), 0.0, 1.0, False, True),
        (
            "discount",
            lambda d: klest.kl_reward(
                torch.zeros(1, 2), torch.zeros(1, 2), discount=d, reward_to_go=True
            ),
            0.0,
            1.0,
            True,
            False,
        ),
    ],
)
def test_number_options_at_the_edges(name, make, lo, hi, lo_open, hi_open):
    """A number option at each end of its range, one float64 ulp either side, +-0, +-inf, NaN
    and the smallest subnormal: refused with a ValueError naming it exactly when outside."""
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -5e-324, 1.0, 0.5]
    for end in (lo, hi):
        if math.isfinite(end):
            values += [end, math.nextafter(end, math.inf), math.nextafter(end, -math.inf)]
    for x in values:
        inside = (lo < x if lo_open else lo <= x) and (x < hi if hi_open else x <= hi)
        if inside:
            make(x)
        else:
            with pytest.raises(ValueError, match=rf"^{name} must"):
                make(x)


def _mask_calls(mask: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Every public function that takes a 0/1 mask of shape ``[2, 3]``, called with ``mask``
    (keyed by the argument's name as the function spells it, and the function)."""
    import klest.distributed
    from klest.integrations import hf

    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 3, generator=g) - 0.1
    logp_ref = -torch.rand(2, 3, generator=g) - 0.1
    z = torch.randn(2, 3, 5, generator=g)
    y = torch.randn(2, 3, 5, generator=g)
    h, w = torch.randn(2, 3, 4, generator=g), torch.randn(5, 4, generator=g)
    idx = torch.tensor([0, 1]).expand(2, 3, 2)
    top = torch.full((2, 3, 2), math.log(0.3))
    ids = torch.tensor([[1, 2, 3], [1, 2, 4]])
    return {
        "kl_estimate mask": lambda: klest.kl_estimate(logp, logp_ref, mask=mask),
        "kl_penalty mask": lambda: klest.kl_penalty(logp, logp_ref, mask=mask),
        "penalty_targets mask": lambda: klest.penalty_targets(logp, logp_ref, mask=mask),
        "kl_reward mask": lambda: klest.kl_reward(logp, logp_ref, mask=mask),
        "aggregate mask": lambda: klest.aggregate(logp, mask=mask),
        "group_baselines mask": lambda: klest.group_baselines(
            logp, group=torch.tensor([0, 0]), mask=mask
        ),
        "global_counts mask": lambda: klest.distributed.global_counts(mask),
        "kl_from_logits mask": lambda: klest.kl_from_logits(z, y, mask=mask),
        "categorical_kl mask": lambda: klest.categorical_kl(z, y, mask=mask),
        "kl_from_hidden mask": lambda: klest.kl_from_hidden(h, w, logits_ref=y, mask=mask),
        "jsd_from_logits mask": lambda: klest.jsd_from_logits(z, y, beta=0.5, mask=mask),
        "skew_kl_from_logits mask": lambda: klest.skew_kl_from_logits(z, y, alpha=0.1, mask=mask),
        "tv_from_logits mask": lambda: klest.tv_from_logits(z, y, mask=mask),
        "jsd_from_hidden mask": lambda: klest.jsd_from_hidden(
            h, w, logits_ref=y, beta=0.5, mask=mask
        ),
        "kl_from_topk mask": lambda: klest.kl_from_topk(
            z, idx, top, estimator="tail-bucket", mask=mask
        ),
        "verl.kl_penalty mask": lambda: verl.kl_penalty(logp, logp_ref, "k3", mask=mask),
        "verl.agg_loss loss_mask": lambda: verl.agg_loss(logp, mask, "token-mean"),
        "openrlhf action_mask": lambda: openrlhf.compute_approx_kl(
            logp, logp_ref, kl_estimator="k3", action_mask=mask
        ),
        "hf.completion_batch attention_mask": lambda: hf.completion_batch(
            z, ids, attention_mask=mask, prompt_lengths=1
        ),
        "hf.group_ids_from_prompts prompt_mask": lambda: hf.group_ids_from_prompts(
            ids, prompt_mask=mask
        ),
    }


@pytest.mark.parametrize("call", list(_mask_calls(torch.ones(2, 3))))
@pytest.mark.parametrize("fraction", [0.5, 1.0 + 2.0**-23, 2.0**-149])
def test_a_fractional_mask_is_refused_by_every_function_that_takes_one(call, fraction):
    """A 0/1 mask holding a fraction (0.5, one float32 ulp above 1, the smallest subnormal) is
    a ValueError naming the mask argument; the same call with the fraction rounded to 1 runs."""
    name = call.rsplit(" ", 1)[1]
    mask = torch.ones(2, 3)
    _mask_calls(mask)[call]()
    mask[1, 2] = fraction
    with pytest.raises(ValueError, match=rf"^{name} must hold only 0 and 1"):
        _mask_calls(mask)[call]()
