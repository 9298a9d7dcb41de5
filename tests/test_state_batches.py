"""Property tests: klest's moving-average states over drawn sequences of trainer batches, and the
public functions the other batch tests leave out.

Batches come from ``tests/test_trainer_batches.py`` (:func:`trainer_batches`: 1 to 12 rows, an
optional ``[B, G, T]`` layout, empty rows, groups of one, arbitrary group ids, fp32 / bf16 /
fp16 / fp64, NaN / inf / 5.0 under the mask), drawn in sequences of 1 to 5 of varying shape,
some of them all-empty, each left- or right-padded (derandomized: ``tests/conftest.py``).

**States.** :class:`klest.BaselineEMA`, :class:`klest.LooScaleEMA` (per position and pooled)
and :class:`klest.AlphaEMA`, used through :func:`klest.kl_penalty` / :func:`klest.kl_estimate`
and through :class:`klest.nn.KLPenalty`, are checked after every batch against a brute force
written here from their docstrings (:class:`History`): each state is an average of earlier
batches with weights :math:`\\gamma^{k-1-j}(1-\\gamma)`, normalized (bias-corrected) by their
sum, the current batch folded in *after* its own baseline or coefficient was taken. The loss's
gradient (``reduction="sum"``, so each valid token's gradient is its coefficient) must be the
target minus the brute-force baseline of the *earlier* batches, which is what makes the
gradient unbiased (:mod:`klest.surrogates`: a baseline independent of the sample it multiplies).
Also: a ``state_dict`` saved after batch k and loaded into a fresh object gives bit for bit the
uninterrupted run's losses, gradients and states from batch k + 1 on; ``.double()`` /
``.to(torch.bfloat16)`` of a :class:`klest.nn.KLPenalty` keeps float64 state and changes no
result; left- and right-padded sequences give the same states and losses.

What the docstrings leave open, and the brute force takes from the code (reported): a batch
with no valid row at a position leaves that position's average unchanged *and does not age it*
(the weights count only the batches that saw the position); an all-empty batch leaves every
state unchanged, bit for bit (AlphaEMA's docstring does not say so).

**Functions.** :func:`klest.f_divergence`, :func:`klest.k_abs`, :func:`klest.aggregate`,
:func:`klest.decouple` and :func:`klest.categorical_kl` (and the modules
:class:`klest.nn.KLFromLogits` / :class:`klest.nn.KLFromHidden` over sequences, before and after
``.double()``) against float64 formulas written here, reduced by hand (``reduce_by_hand`` of
``tests/logits/test_logits_batches.py``), for every reduction; garbage under the mask gives bit
for bit the result of zeros there; left and right padding agree.

Tolerances: the references are float64 on the very (rounded) inputs klest gets; klest computes
in float32 for float32 / bf16 / fp16 inputs. The values compared are sums of at most 12 x 9
terms (and exponentials of sums of 9 log-ratios), so as in ``tests/test_trainer_batches.py`` the
difference is below ``1e3 u`` times the size of the terms (``assert_close_up_to_rounding``; u the
compute dtype's unit roundoff); where a value is a difference of larger terms (a control
variate, a target minus its baseline) the size is that of the terms (:func:`assert_close_to`).
A coefficient fitted from moments, ``alpha = -cov / var``, is compared with the error bound
propagated from its moments' (:func:`alpha_tolerance`).

Nothing here is statistical. Each drawn test runs ``EXAMPLES`` sequences or batches (numbers in
the decorators); the file takes about 40 s on one core.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import klest
from klest.nn import KLFromHidden, KLFromLogits, KLPenalty
from tests.logits.test_logits_batches import kl_rows, reduce_by_hand
from tests.test_trainer_batches import (
    Batch,
    Inputs,
    assert_close_up_to_rounding,
    compute_dtype,
    inputs,
    to_left,
    to_right,
    trainer_batches,
)

REDUCTIONS = ("seq-mean-token-sum", "token-mean", "seq-mean-token-mean", "sum", "per-sequence")
ALL_REDUCTIONS = (*REDUCTIONS, "none")
SEQUENCE_REDUCTIONS = ("per-sequence", "seq-mean-token-sum", "sum")
DECAYS = (0.0, 0.5, 0.9)


# -- drawn sequences ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One batch of a sequence and the layout it comes in."""

    batch: Batch
    layout: str


@st.composite
def sequences(draw, *, min_t: int = 1) -> list[Step]:
    """1 to 5 trainer batches, about one in five all-empty, each left- or right-padded."""
    steps = []
    for _ in range(draw(st.integers(1, 5), label="length")):
        batch = draw(trainer_batches(min_t=min_t))
        if draw(st.integers(0, 4), label="all-empty") == 0:
            batch = replace(batch, lengths=torch.zeros_like(batch.lengths))
        steps.append(Step(batch, draw(st.sampled_from(("left", "right")))))
    return steps


@dataclass(frozen=True)
class Rows:
    """A batch as the float64 reference sees it: ``[rows, T]`` log-probs of the rounded inputs
    (0 under the mask), in the right-padded layout, with each row's first valid column."""

    lp: torch.Tensor
    lq: torch.Tensor
    lb: torch.Tensor
    valid: torch.Tensor
    group: torch.Tensor

    @property
    def delta(self) -> torch.Tensor:
        return self.lp - self.lq

    @property
    def lengths(self) -> torch.Tensor:
        return self.valid.sum(-1)


def reference_rows(batch: Batch) -> Rows:
    x = inputs(batch, garbage=False)
    t = batch.t

    def rows(v: torch.Tensor) -> torch.Tensor:
        return v.detach().double().reshape(-1, t)

    valid = x.mask.reshape(-1, t)
    return Rows(rows(x.logp), rows(x.logp_ref), rows(x.logp_behavior), valid, x.group.reshape(-1))


def right_layout(g: torch.Tensor, step: Step) -> torch.Tensor:
    return to_right(g, step.batch) if step.layout == "left" else g


def state_dtype(steps: list[Step]) -> torch.dtype:
    """float64 if every batch so far was float64, else float32: a state (and what it feeds)
    carries the rounding of the coarsest compute dtype that went into it."""
    return torch.float64 if all(s.batch.dtype == torch.float64 for s in steps) else torch.float32


def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(compute_dtype(dtype)).eps


def assert_close_to(got, want, size, dtype: torch.dtype, what: str) -> None:
    """``|got - want| <= 1e3 u (1 + size) + u' |want|`` elementwise: ``size`` bounds the terms
    whose rounding ``got`` carries (module docstring), and ``u'`` is the unit roundoff of
    ``got``'s own dtype (a gradient is rounded to its leaf's dtype last: bf16's 2^-8)."""
    out_eps = torch.finfo(got.dtype).eps if got.dtype.is_floating_point else 0.0
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    assert got.shape == want.shape, f"{what}: shapes {tuple(got.shape)} vs {tuple(want.shape)}"
    tol = 1e3 * eps_of(dtype) * (1 + torch.as_tensor(size).double()) + out_eps * want.abs()
    diff = (got - want).abs()
    bad = ~(diff <= tol)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {diff.numel()} elements differ by more than the rounding "
        f"bound; largest {float(diff.max()):.3g} "
        f"(bound at the first: {float(tol.expand_as(diff)[bad][0]):.3g})"
    )


# -- the documented update rule, by brute force ----------------------------------------------------


class History:
    """Per position, the batch statistics of the batches that saw it (oldest first), and their
    average with weights ``gamma^(n-1-j) (1 - gamma)`` normalized by the weights' sum: the rule
    of the docstrings of BaselineEMA, AlphaEMA (Adam's bias correction) and LooScaleEMA."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.seen: dict[int, list[torch.Tensor]] = {}

    def add(self, position: int, stat: torch.Tensor) -> None:
        self.seen.setdefault(position, []).append(stat)

    def average(self, position: int) -> torch.Tensor | None:
        stats = self.seen.get(position)
        if not stats:
            return None
        n = len(stats)
        w = [self.decay ** (n - 1 - j) * (1 - self.decay) for j in range(n)]
        return sum(wj * s for wj, s in zip(w, stats, strict=True)) / sum(w)


def first_valid(valid: torch.Tensor) -> list[int]:
    return [int(row.nonzero()[0]) if bool(row.any()) else -1 for row in valid]


def aligned_targets(r: Rows, grad: str, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The score-function targets A (:mod:`klest.penalty`'s table, on-policy) with the t-th
    token of every completion in column t: ``score``: the sequence's log-ratio sum (KL(pi||ref))
    or ratio ``R`` (KL(ref||pi)), ``[rows, 1]``; ``cumulative``: the log-ratios to go or the
    prefix ratio ``R_{<=t}``, ``[rows, T]``. Returns ``(A, valid)``, 0 where not valid."""
    rows, t = r.valid.shape
    if grad == "score":
        s = r.delta.sum(-1, keepdim=True)
        a = s if direction == "pi||ref" else torch.exp(-s)
        ok = r.valid.any(-1, keepdim=True)
        return torch.where(ok, a, 0.0), ok
    a = torch.zeros(rows, t, dtype=torch.float64)
    ok = torch.zeros(rows, t, dtype=torch.bool)
    for i, first in enumerate(first_valid(r.valid)):
        for p in range(int(r.lengths[i])):
            col = first + p
            if direction == "pi||ref":
                a[i, p] = r.delta[i, col:].sum()
            else:
                a[i, p] = math.exp(-float(r.delta[i, : col + 1].sum()))
            ok[i, p] = True
    return a, ok


def spread(coef: torch.Tensor, r: Rows) -> torch.Tensor:
    """Aligned per-position coefficients ``[rows, P]`` back to the right-padded columns (one
    per sequence, ``P = 1``, fills the row)."""
    out = torch.zeros_like(r.delta)
    for i, first in enumerate(first_valid(r.valid)):
        for p in range(int(r.lengths[i])):
            out[i, first + p] = coef[i, 0 if coef.shape[1] == 1 else p]
    return out


class ReferenceBaselineEMA:
    """BaselineEMA's docstring: per position, the average of earlier batches' mean targets."""

    def __init__(self, decay: float) -> None:
        self.history = History(decay)

    def baseline(self, a: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(a)
        for p in range(a.shape[1]):
            mean = self.history.average(p)
            out[:, p] = 0.0 if mean is None else mean
        return out

    def update(self, a: torch.Tensor, ok: torch.Tensor) -> None:
        for p in range(a.shape[1]):
            if bool(ok[:, p].any()):
                self.history.add(p, a[ok[:, p], p].mean())

    def check(self, ema: klest.BaselineEMA, dtype: torch.dtype, what: str) -> None:
        positions = max(self.history.seen, default=-1) + 1
        assert ema.sums.dtype == torch.float64 and ema.sums.numel() >= positions, what
        got = torch.where(ema.weights > 0, ema.sums / ema.weights.clamp(min=1e-300), 0.0)
        for p in range(ema.sums.numel()):
            mean = self.history.average(p)
            assert (mean is None) == (float(ema.weights[p]) == 0), f"{what}: position {p} seen"
            if mean is not None:
                assert_close_up_to_rounding(got[p], mean, dtype, f"{what}: average at {p}")


def leave_one_out(a: torch.Tensor, ok: torch.Tensor, group: torch.Tensor):
    """``B``: the mean of the other rows of the group valid at the same aligned position, and
    whether there is one (``[rows, P]`` each)."""
    b = torch.zeros_like(a)
    mate = torch.zeros_like(ok)
    for i in range(a.shape[0]):
        for p in range(a.shape[1]):
            others = [j for j in range(a.shape[0]) if j != i and group[j] == group[i] and ok[j, p]]
            if ok[i, p] and others:
                b[i, p] = a[others, p].mean()
                mate[i, p] = True
    return b, mate


class ReferenceLooScaleEMA:
    """LooScaleEMA's docstring: ``lambda_t = clip(sum_j g^(k-1-j) sum_i A B / sum_j g^(k-1-j)
    sum_i B^2, 0, 1)`` over earlier batches, times the leave-one-out mean B. A batch with no
    pair at t adds 0 to both sums; whether it also ages them (the formula) or is skipped (the
    code, as BaselineEMA's rule says) changes the ratio only at decay 0, where the formula is
    0 / 0: the brute force skips it (reported)."""

    def __init__(self, decay: float, per_position: bool) -> None:
        self.history = History(decay)
        self.per_position = per_position
        self.batches = 0

    def scale(self, p: int) -> float:
        cross = self.history.average(p if self.per_position else 0)
        if cross is None or float(cross[1]) <= 0:
            return 0.0
        return min(max(float(cross[0] / cross[1]), 0.0), 1.0)

    def baseline(self, a, ok, group) -> torch.Tensor:
        b, _ = leave_one_out(a, ok, group)
        scales = torch.tensor([self.scale(p) for p in range(a.shape[1])], dtype=torch.float64)
        return scales * b

    def update(self, a, ok, group) -> None:
        b, mate = leave_one_out(a, ok, group)
        cross = torch.where(mate, a * b, 0.0).sum(0)
        square = torch.where(mate, b * b, 0.0).sum(0)
        if not self.per_position:
            cross, square = cross.sum(0, True), square.sum(0, True)
        for p in range(cross.numel()):
            if float(square[p]) > 0:
                self.history.add(p, torch.stack([cross[p], square[p]]))

    def check(self, fit: klest.LooScaleEMA, dtype: torch.dtype, what: str) -> None:
        positions = max(self.history.seen, default=-1) + 1
        got = fit.scales(max(positions, 1))
        for p in range(positions):
            want = self.scale(p)
            # A scale is a ratio of sums: compared within rounding of the larger of it and 1.
            assert_close_up_to_rounding(
                got[p], torch.tensor(want, dtype=torch.float64), dtype, f"{what}: scale {p}"
            )


# -- the states through kl_penalty ---------------------------------------------------------------

STATE_KINDS = ("baseline-ema", "loo-scale-ema", "loo-scale-ema-pooled")
SETUPS = (
    ("score", "pi||ref"),
    ("score", "ref||pi"),
    ("cumulative", "pi||ref"),
    ("cumulative", "ref||pi"),
)


def new_state(kind: str, decay: float):
    if kind == "baseline-ema":
        return klest.BaselineEMA(decay=decay), ReferenceBaselineEMA(decay)
    per_position = kind == "loo-scale-ema"
    return (
        klest.LooScaleEMA(decay=decay, per_position=per_position),
        ReferenceLooScaleEMA(decay, per_position),
    )


@dataclass
class Outcome:
    """One step's loss and gradient to ``logp`` (right-padded layout) and the state after it."""

    loss: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]


def penalty_step(penalty, step: Step, grad: str, direction: str) -> Outcome:
    """``penalty`` (``kl_penalty`` with its state bound, or a module) on one batch, ``"sum"``."""
    x = inputs(step.batch, layout=step.layout)
    loss = penalty(x, grad, direction)
    (g,) = torch.autograd.grad(loss, x.logp, allow_unused=True)
    g = torch.zeros_like(x.logp) if g is None else g
    return Outcome(loss.detach(), right_layout(g, step), {})


def with_state(state):
    def call(x: Inputs, grad: str, direction: str) -> torch.Tensor:
        return klest.kl_penalty(
            x.logp,
            x.logp_ref,
            estimator="k1",
            grad=grad,
            direction=direction,
            mask=x.mask,
            reduction="sum",
            baseline=state,
            group=x.group,
        )

    return call


def run_sequence(state, steps: list[Step], grad: str, direction: str) -> list[Outcome]:
    out = []
    for step in steps:
        o = penalty_step(with_state(state), step, grad, direction)
        o.state = {k: v.clone() for k, v in state.state_dict().items()}
        out.append(o)
    return out


def assert_unchanged(state: dict, before: dict, what: str) -> None:
    """``state`` is ``before`` bit for bit, except that a buffer may have grown with zeros (a
    position not seen yet: BaselineEMA's and LooScaleEMA's buffers grow with the longest
    sequence)."""
    assert state.keys() == before.keys(), what
    for name, old in before.items():
        new = state[name]
        grown = new.ndim == 1 and new.numel() > old.numel()
        kept = new[: old.numel()] if grown else new
        assert torch.equal(kept, old), f"{what} changed {name}"
        assert not grown or not bool(new[old.numel() :].any()), f"{what} wrote into {name}"


def assert_outcomes_equal(got: list[Outcome], want: list[Outcome], what: str) -> None:
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.loss, b.loss), f"{what}: loss at batch {k}"
        assert torch.equal(a.grad, b.grad), f"{what}: gradient at batch {k}"
        assert a.state.keys() == b.state.keys(), what
        for name in a.state:
            assert torch.equal(a.state[name], b.state[name]), f"{what}: {name} at batch {k}"


@given(
    steps=sequences(),
    kind=st.sampled_from(STATE_KINDS),
    setup=st.sampled_from(SETUPS),
    decay=st.sampled_from(DECAYS),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_baseline_states_follow_their_documented_rule_over_a_sequence(
    steps, kind, setup, decay, data
):
    """BaselineEMA / LooScaleEMA as ``kl_penalty``'s baseline over a drawn sequence: after each
    batch the state is the brute force's; each valid token's gradient is its target minus the
    baseline of the earlier batches only; an all-empty batch leaves the state unchanged bit for
    bit; a state_dict resumed after batch k repeats the run bit for bit; the drawn layouts and
    all-right-padded give the same losses, gradients and states."""
    grad, direction = setup
    state, ref = new_state(kind, decay)
    sign = 1.0 if direction == "pi||ref" else -1.0
    run = []
    for k, step in enumerate(steps):
        # The state carries the rounding of every batch so far: the coarsest compute dtype.
        dtype = state_dtype(steps[: k + 1])
        r = reference_rows(step.batch)
        a, ok = aligned_targets(r, grad, direction)
        if kind == "baseline-ema":
            b = ref.baseline(a, ok)
        else:
            b = ref.baseline(a, ok, step.batch.group.reshape(-1))
        before = copy.deepcopy(state.state_dict())
        o = penalty_step(with_state(state), step, grad, direction)
        o.state = {n: v.clone() for n, v in state.state_dict().items()}
        run.append(o)
        what = f"{kind} {grad} {direction} batch {k} ({step.layout}, {step.batch.dtype})"
        want = spread(torch.where(ok, sign * (a - b), 0.0), r)
        size = spread(torch.where(ok, a.abs() + b.abs(), 0.0), r)
        assert_close_to(o.grad.reshape(want.shape), want, size, dtype, f"{what}: gradient")
        k1 = r.delta if direction == "pi||ref" else -r.delta * torch.exp(-r.delta)
        assert_close_up_to_rounding(o.loss, k1.sum(), dtype, f"{what}: k1 sum")
        if not bool(r.valid.any()):
            assert_unchanged(o.state, before, f"{what}: an all-empty batch")
        if kind == "baseline-ema":
            ref.update(a, ok)
        else:
            ref.update(a, ok, step.batch.group.reshape(-1))
        ref.check(state, dtype, what)

    # Resumed from a checkpoint after batch k: bit for bit the uninterrupted run.
    k = data.draw(st.integers(0, len(steps) - 1), label="checkpoint")
    replay, _ = new_state(kind, decay)
    run_sequence(replay, steps[: k + 1], grad, direction)
    resumed, _ = new_state(kind, decay)
    resumed.load_state_dict(copy.deepcopy(replay.state_dict()))
    tail = run_sequence(resumed, steps[k + 1 :], grad, direction)
    assert_outcomes_equal(tail, run[k + 1 :], f"{kind} resumed after batch {k}")

    # Every batch right-padded: the same losses, gradients and states up to rounding.
    right, _ = new_state(kind, decay)
    flat = run_sequence(right, [replace(s, layout="right") for s in steps], grad, direction)
    for j, (a, b) in enumerate(zip(flat, run, strict=True)):
        dtype = state_dtype(steps[: j + 1])
        assert_close_up_to_rounding(a.loss, b.loss, dtype, f"{kind} batch {j}: loss by layout")
        assert_close_up_to_rounding(a.grad, b.grad, dtype, f"{kind} batch {j}: grad by layout")
        for n in a.state:
            assert_close_up_to_rounding(a.state[n], b.state[n], dtype, f"{kind} {n} by layout")
