"""Property tests: klest's moving-average states over drawn sequences of trainer batches, and the
public functions the other batch tests leave out.

Batches come from ``test_trainer_batches.py`` (:func:`trainer_batches`: 1 to 12 rows, an
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
terms (and exponentials of sums of 9 log-ratios), so as in ``test_trainer_batches.py`` the
difference is below ``1e3 u`` times the size of the terms (``assert_close_up_to_rounding``; u the
compute dtype's unit roundoff); where a value is a difference of larger terms (a control
variate, a target minus its baseline) the size is that of the terms (:func:`assert_close_to`).
A coefficient fitted from moments, ``alpha = -cov / var``, is compared with the error bound
propagated from its moments' (:func:`alpha_tolerance`).

Nothing here is statistical. The drawn tests run 300 (baseline states), 200 (AlphaEMA), 100
(``KLPenalty``), 300 / 200 / 200 (f-divergences and k_abs / aggregate / decouple) and 150 (exact
KLs and their modules) examples; the file takes about 13 s on one core. It found that casting a
model to bf16 rounded the float64 states to bf16 (fixed: :func:`klest._numerics.keep_float64`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import klest
from klest.nn import KLFromHidden, KLFromLogits, KLPenalty
from tests.logits.test_logits_batches import kl_rows, reduce_by_hand
from tests.sampled.test_trainer_batches import (
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
    """The score-function targets A (:mod:`klest.sampled.penalty`'s table, on-policy) with the t-th
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
    """One step's output and gradient to ``logp`` (right-padded layout) and the state after it."""

    loss: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor]


def outcome(call, step: Step) -> Outcome:
    """``call(x)`` on the step's batch in its layout; the output's sum differentiated."""
    x = inputs(step.batch, layout=step.layout)
    out = call(x)
    (g,) = torch.autograd.grad(out.sum(), x.logp, allow_unused=True)
    g = torch.zeros_like(x.logp) if g is None else g
    if out.shape == x.logp.shape:
        out = right_layout(out, step)
    return Outcome(out.detach(), right_layout(g, step), {})


def penalty_call(grad: str, direction: str):
    """``kl_penalty`` (k1 value, ``"sum"``) with a state as its baseline."""

    def bind(state):
        return lambda x: klest.kl_penalty(
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

    return bind


def snapshot(state) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.state_dict().items()}


def run_sequence(state, steps: list[Step], bind) -> list[Outcome]:
    call, out = bind(state), []
    for step in steps:
        o = outcome(call, step)
        o.state = snapshot(state)
        out.append(o)
    return out


def check_resume_and_layouts(make, steps, bind, run: list[Outcome], k: int, what: str) -> None:
    """A fresh ``make()`` loaded with the state_dict saved after batch k repeats ``run`` from
    batch k + 1 bit for bit; every batch right-padded gives ``run`` up to rounding."""
    replay = make()
    run_sequence(replay, steps[: k + 1], bind)
    resumed = make()
    resumed.load_state_dict(copy.deepcopy(replay.state_dict()))
    assert_outcomes_equal(
        run_sequence(resumed, steps[k + 1 :], bind), run[k + 1 :], f"{what} resumed after {k}"
    )
    flat = run_sequence(make(), [replace(s, layout="right") for s in steps], bind)
    for j, (a, b) in enumerate(zip(flat, run, strict=True)):
        dtype = state_dtype(steps[: j + 1])
        assert_close_up_to_rounding(a.loss, b.loss, dtype, f"{what} batch {j}: value by layout")
        assert_close_up_to_rounding(a.grad, b.grad, dtype, f"{what} batch {j}: grad by layout")
        for n in a.state:
            assert_close_up_to_rounding(a.state[n], b.state[n], dtype, f"{what} {n} by layout")


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
    bind = penalty_call(grad, direction)
    sign = 1.0 if direction == "pi||ref" else -1.0
    run = []
    for k, step in enumerate(steps):
        # The state carries the rounding of every batch so far: the coarsest compute dtype.
        dtype = state_dtype(steps[: k + 1])
        r = reference_rows(step.batch)
        a, ok = aligned_targets(r, grad, direction)
        group = step.batch.group.reshape(-1)
        b = ref.baseline(a, ok) if kind == "baseline-ema" else ref.baseline(a, ok, group)
        before = snapshot(state)
        o = outcome(bind(state), step)
        o.state = snapshot(state)
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
            ref.update(a, ok, group)
        ref.check(state, dtype, what)
    k = data.draw(st.integers(0, len(steps) - 1), label="checkpoint")
    check_resume_and_layouts(lambda: new_state(kind, decay)[0], steps, bind, run, k, kind)


# -- AlphaEMA through kl_estimate(estimator="cv") ------------------------------------------------


@dataclass(frozen=True)
class CVTerms:
    """Float64 ``a = w k1``, ``b = w u`` (``u`` the zero-mean control variate, so ``cv = a +
    alpha b``), their rounding sizes and where they count, per token or per sequence."""

    a: torch.Tensor
    b: torch.Tensor
    size_a: torch.Tensor
    size_b: torch.Tensor
    valid: torch.Tensor


def cv_terms(r: Rows, direction: str, level: str, off_policy: bool) -> CVTerms:
    delta, valid = r.delta, r.valid
    spread_in = (r.lp.abs() + r.lq.abs()).double()  # the log-ratio's rounding, in units of u
    log_w = r.lp - r.lb if off_policy else torch.zeros_like(delta)
    w_spread = (r.lp.abs() + r.lb.abs()) if off_policy else torch.zeros_like(delta)
    if level == "sequence":
        delta, log_w = delta.sum(-1, keepdim=True), log_w.sum(-1, keepdim=True)
        spread_in, w_spread = spread_in.sum(-1, keepdim=True), w_spread.sum(-1, keepdim=True)
        valid = valid.any(-1, keepdim=True)
    ratio = torch.exp(-delta)
    if direction == "pi||ref":
        k1, dk1, u = delta, torch.ones_like(delta), torch.expm1(-delta)
    else:
        k1, dk1, u = -delta * ratio, ratio * (delta - 1), -torch.expm1(-delta)
    w = torch.exp(log_w)
    a, b = torch.where(valid, w * k1, 0.0), torch.where(valid, w * u, 0.0)
    # |d a / d delta| and |d b / d delta| times delta's rounding, plus the weight's.
    size_a = (w * dk1).abs() * spread_in + a.abs() * (1 + w_spread)
    size_b = (w * ratio).abs() * spread_in + b.abs() * (1 + w_spread)
    return CVTerms(a, b, size_a, size_b, valid)


def moments_of(t: CVTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's mean ``(a, b, ab, bb)`` over its valid entries and their rounding sizes."""
    v = t.valid
    a, b, sa, sb = t.a[v], t.b[v], t.size_a[v], t.size_b[v]
    means = torch.stack([a.mean(), b.mean(), (a * b).mean(), (b * b).mean()])
    sizes = torch.stack(
        [sa.mean(), sb.mean(), (sa * b.abs() + sb * a.abs()).mean(), (2 * sb * b.abs()).mean()]
    )
    return means, sizes


def alpha_tolerance(m: torch.Tensor, size: torch.Tensor, dtype: torch.dtype, rtol: float):
    """``(alpha, tolerance)`` from the brute-force moments, or None where rounding of the moments
    can decide whether alpha is defined (variance within its error of 0 or of the ``rtol``
    cut): the error of ``-cov / var`` propagated from the moments' (module docstring)."""
    ea, eb, eab, ebb = (float(v) for v in m)
    ta, tb, tab, tbb = (1e3 * eps_of(dtype) * (1 + float(v)) for v in size)
    var, cov = ebb - eb * eb, eab - ea * eb
    dvar = tbb + 2 * abs(eb) * tb + tb * tb
    dcov = tab + abs(ea) * tb + abs(eb) * ta + ta * tb
    if abs(var - rtol * ebb) <= dvar + rtol * tbb or var <= 2 * dvar:
        return None if var > rtol * ebb - dvar - rtol * tbb else ("init", 0.0)
    alpha = -cov / var
    return alpha, (dcov + abs(alpha) * dvar) / (var - dvar)


@given(
    steps=sequences(),
    direction=st.sampled_from(("pi||ref", "ref||pi")),
    level=st.sampled_from(("token", "sequence")),
    off_policy=st.booleans(),
    decay=st.sampled_from(DECAYS),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_alpha_ema_follows_its_documented_rule_over_a_sequence(
    steps, direction, level, off_policy, decay, data
):
    """AlphaEMA as ``cv``'s coefficient over a drawn sequence: each batch's values are ``w (k1
    + alpha u)`` with alpha from the brute-force moments of the *earlier* batches (init before
    any, or while u has no variance), the moments after each batch are the brute force's
    (bias-corrected averages of the batches' means over valid entries), an all-empty batch
    changes nothing, a resumed state_dict repeats the run bit for bit, layouts agree."""
    init = 0.7
    make = lambda: klest.AlphaEMA(decay=decay, init=init)  # noqa: E731
    ema, history = make(), History(decay)
    reduction = "none" if level == "token" else "per-sequence"

    def bind(state):
        return lambda x: klest.kl_estimate(
            x.logp,
            x.logp_ref,
            estimator="cv",
            alpha=state,
            direction=direction,
            mask=x.mask,
            reduction=reduction,
            level=level,
            logp_behavior=x.logp_behavior if off_policy else None,
        )

    run = []
    for k, step in enumerate(steps):
        dtype = state_dtype(steps[: k + 1])
        what = f"AlphaEMA {direction} {level} off={off_policy} batch {k} ({step.batch.dtype})"
        t = cv_terms(reference_rows(step.batch), direction, level, off_policy)
        past = history.average(0)
        before = snapshot(ema)
        used = ema.alpha.clone()
        o = outcome(bind(ema), step)
        o.state = snapshot(ema)
        run.append(o)
        if past is None:
            assert float(used) == init, f"{what}: {float(used)} before any batch, not init"
        else:
            want = alpha_tolerance(past[0], past[1], dtype, rtol=1e-10)
            if want is not None and want[0] == "init":
                assert float(used) == init, f"{what}: u has no variance yet alpha {float(used)}"
            elif want is not None:
                alpha, tol = want
                assert abs(float(used) - alpha) <= tol, f"{what}: alpha {float(used)} vs {alpha}"
        coef = used.to(compute_dtype(step.batch.dtype)).double()
        value = torch.where(t.valid, t.a + coef * t.b, 0.0)
        size = t.size_a + coef.abs() * t.size_b + t.a.abs() + (coef * t.b).abs()
        got = o.loss.reshape(value.shape)
        assert_close_to(got, value, size, dtype, f"{what}: cv values")
        if bool(t.valid.any()):
            history.add(0, torch.stack(moments_of(t)))
        else:
            assert_unchanged(o.state, before, f"{what}: an all-empty batch")
        now = history.average(0)
        assert (now is None) == (float(ema.weight) == 0), f"{what}: weight {float(ema.weight)}"
        if now is not None:
            assert ema.moments.dtype == torch.float64, what
            assert_close_to(ema.moments / ema.weight, now[0], now[1], dtype, f"{what}: moments")
    k = data.draw(st.integers(0, len(steps) - 1), label="checkpoint")
    check_resume_and_layouts(make, steps, bind, run, k, "AlphaEMA")


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16, torch.float32])
def test_casting_a_model_keeps_the_states_float64_values(cast):
    """``model.to(bf16)`` must leave the float64 moving averages as they are: they were cast to
    the model's dtype and back, rounding them to 8 bits (BaselineEMA, LooScaleEMA, AlphaEMA)."""
    valid = torch.ones(2, 1, dtype=torch.bool)
    targets = torch.tensor([[0.123456789], [0.3]], dtype=torch.float64)
    baseline, fit, alpha = klest.BaselineEMA(), klest.LooScaleEMA(), klest.AlphaEMA()
    baseline(targets, valid)
    fit(targets, valid, torch.zeros(2, dtype=torch.int64))
    alpha(targets, targets.expm1(), valid)
    for state in (baseline, fit, alpha):
        before = snapshot(state)
        state.to(cast)
        assert_unchanged(snapshot(state), before, f"{type(state).__name__}.to({cast})")
        assert all(v.dtype == torch.float64 for v in state.state_dict().values())


# -- klest.nn modules over sequences -------------------------------------------------------------


@given(
    steps=sequences(),
    baseline=st.sampled_from(("ema", "loo-ema")),
    setup=st.sampled_from(SETUPS),
    cast=st.sampled_from((torch.float64, torch.bfloat16)),
    data=st.data(),
)
@settings(max_examples=100, deadline=None)
def test_kl_penalty_module_over_a_sequence(steps, baseline, setup, cast, data):
    """``KLPenalty(estimator="cv", alpha="ema", baseline=...)`` equals ``beta * kl_penalty`` with
    states of its own, bit for bit, over the sequence; cast with ``.to(dtype)`` after a drawn
    batch it keeps float64 state and the same results; a state_dict resume repeats the run."""
    grad, direction = setup
    beta = 0.25

    def make():
        return KLPenalty(
            estimator="cv",
            alpha="ema",
            alpha_decay=0.5,
            grad=grad,
            direction=direction,
            reduction="sum",
            baseline=baseline,
            baseline_decay=0.5,
            beta=beta,
        )

    state_type = klest.BaselineEMA if baseline == "ema" else klest.LooScaleEMA
    states = (state_type(decay=0.5), klest.AlphaEMA(decay=0.5))

    def by_function(x: Inputs) -> torch.Tensor:
        return beta * klest.kl_penalty(
            x.logp,
            x.logp_ref,
            estimator="cv",
            alpha=states[1],
            grad=grad,
            direction=direction,
            mask=x.mask,
            reduction="sum",
            baseline=states[0],
            group=x.group,
        )

    def bind(module):
        return lambda x: module(x.logp, x.logp_ref, mask=x.mask, group=x.group)

    module, cast_after = make(), data.draw(st.integers(0, len(steps) - 1), label="cast after")
    run = []
    for k, step in enumerate(steps):
        o, want = outcome(bind(module), step), outcome(by_function, step)
        assert torch.equal(o.loss, want.loss), f"batch {k}: module vs function loss"
        assert torch.equal(o.grad, want.grad), f"batch {k}: module vs function gradient"
        o.state = snapshot(module)
        run.append(o)
        if k == cast_after:
            module.to(cast)
            assert all(v.dtype == torch.float64 for v in module.state_dict().values()), cast
            assert_outcomes_equal([replace(o, state=snapshot(module))], [o], f"cast to {cast}")
    k = data.draw(st.integers(0, len(steps) - 1), label="checkpoint")
    check_resume_and_layouts(make, steps, bind, run, k, f"KLPenalty {baseline}")


# -- the remaining public functions on drawn batches ---------------------------------------------

DIVERGENCES = {
    # name: (f, f'(1)); the f-divergence E_pi[f(r)] with r = ref / pi
    "kl(pi||ref)": (lambda r: -torch.log(r), -1.0),
    "kl(ref||pi)": (lambda r: torch.xlogy(r, r), 1.0),
    "chi2": (lambda r: (r - 1) ** 2, 0.0),
    "hellinger": (lambda r: (r.sqrt() - 1) ** 2, 0.0),
}


def elementwise_reference(g, r: Rows, level: str, off_policy: bool):
    """``w g(delta)`` in float64 per token (or per sequence) and its rounding size: the terms
    ``g`` returns as the second output, plus ``|g'(delta)|`` times the log-ratio's rounding and
    the weight's (autograd of the float64 formula)."""
    delta, valid = r.delta, r.valid
    spread_in = r.lp.abs() + r.lq.abs()
    log_w = r.lp - r.lb if off_policy else torch.zeros_like(delta)
    w_spread = r.lp.abs() + r.lb.abs() if off_policy else torch.zeros_like(delta)
    if level == "sequence":
        delta, log_w = delta.sum(-1, keepdim=True), log_w.sum(-1, keepdim=True)
        spread_in, w_spread = spread_in.sum(-1, keepdim=True), w_spread.sum(-1, keepdim=True)
        valid = valid.any(-1, keepdim=True)
    d = delta.clone().requires_grad_()
    value, terms = g(d)
    (slope,) = torch.autograd.grad(value.sum(), d)
    w = torch.exp(log_w)
    out = torch.where(valid, w * value.detach(), 0.0)
    size = w * (terms.detach() + slope.abs() * spread_in) + out.abs() * w_spread
    return out, torch.where(valid, size, 0.0), valid


def reduced(values: torch.Tensor, valid: torch.Tensor, lead, reduction: str) -> torch.Tensor:
    """``reduce_by_hand`` of ``[rows, T']`` values in the batch's layout (``[*lead, T']``)."""
    shape = (*lead, values.shape[-1])
    return reduce_by_hand(values.reshape(shape), valid.reshape(shape), reduction)


def same_layout(out: torch.Tensor, step: Step, reduction: str) -> torch.Tensor:
    return right_layout(out, step) if reduction == "none" else out


@given(
    step=sequences().map(lambda s: s[0]),
    fn=st.sampled_from((*DIVERGENCES, "k_abs")),
    given_slope=st.booleans(),
    level=st.sampled_from(("token", "sequence")),
    direction=st.sampled_from(("pi||ref", "ref||pi")),
    off_policy=st.booleans(),
    data=st.data(),
)
@settings(max_examples=300, deadline=None)
def test_f_divergence_and_k_abs_match_float64_formulas(
    step, fn, given_slope, level, direction, off_policy, data
):
    """``f_divergence`` (``f(r) - f'(1)(r - 1)``, f'(1) given or by autograd) and ``k_abs``
    (``|delta|``, ``|r log r|``), weighted off-policy, every reduction: the float64 formula
    reduced by hand; garbage under the mask gives the result of zeros there, bit for bit; 0
    gradient under the mask; left and right padding agree."""
    reductions = SEQUENCE_REDUCTIONS if level == "sequence" else ALL_REDUCTIONS
    reduction = data.draw(st.sampled_from(reductions), label="reduction")
    batch = step.batch

    def call(x: Inputs) -> torch.Tensor:
        common = dict(mask=x.mask, reduction=reduction, level=level)
        behavior = x.logp_behavior if off_policy else None
        if fn == "k_abs":
            return klest.k_abs(
                x.logp, x.logp_ref, direction=direction, logp_behavior=behavior, **common
            )
        f, slope = DIVERGENCES[fn]
        return klest.f_divergence(
            x.logp,
            x.logp_ref,
            f=f,
            f_prime_at_1=slope if given_slope else None,
            logp_behavior=behavior,
            **common,
        )

    if fn == "k_abs":

        def g(d):
            v = d.abs() if direction == "pi||ref" else (d * torch.exp(-d)).abs()
            return v, v

    else:
        f, slope = DIVERGENCES[fn]

        def g(d):
            r = torch.exp(-d)
            return f(r) - slope * (r - 1), f(r).abs() + abs(slope) * (r - 1).abs()

    values, size, valid = elementwise_reference(g, reference_rows(batch), level, off_policy)
    want = reduced(values, valid, batch.lead, reduction)
    tol_size = reduced(size, valid, batch.lead, reduction)
    dtype = batch.dtype
    x = inputs(batch, layout=step.layout)
    got = call(x)
    assert got.dtype == compute_dtype(dtype), f"{fn}: dtype {got.dtype}"
    assert_close_to(same_layout(got.detach(), step, reduction), want, tol_size, dtype, fn)
    (grad,) = torch.autograd.grad(got.sum(), x.logp)
    assert bool(torch.isfinite(grad).all()) and not bool(grad[~x.mask].any()), f"{fn}: grad"
    clean = call(inputs(batch, layout=step.layout, garbage=False))
    assert torch.equal(got, clean), f"{fn}: garbage under the mask was read"
    other = "left" if step.layout == "right" else "right"
    flipped = same_layout(call(inputs(batch, layout=other)), replace(step, layout=other), reduction)
    assert_close_up_to_rounding(
        flipped.detach(), same_layout(got.detach(), step, reduction), dtype, f"{fn} by layout"
    )


@given(step=sequences().map(lambda s: s[0]), masked=st.booleans(), data=st.data())
@settings(max_examples=200, deadline=None)
def test_aggregate_matches_the_reduction_table(step, masked, data):
    """``aggregate`` of per-token values (garbage under the mask) by every reduction: the
    reductions by hand in float64, bit for bit the result of zeros under the mask, the same
    for left and right padding; without a mask every position counts."""
    reduction = data.draw(st.sampled_from(ALL_REDUCTIONS), label="reduction")
    batch, dtype = step.batch, step.batch.dtype
    x = inputs(batch, layout=step.layout, garbage=masked)
    mask = x.mask if masked else None
    got = klest.aggregate(x.logp, mask=mask, reduction=reduction)
    assert got.dtype == x.logp.dtype, f"aggregate: dtype {got.dtype} of {x.logp.dtype} values"
    keep = x.mask if masked else torch.ones_like(x.mask)
    values = torch.where(keep, x.logp.detach().double(), 0.0)
    want = reduce_by_hand(values, keep, reduction)
    size = reduce_by_hand(values.abs(), keep, reduction)
    tol_dtype = dtype if dtype == torch.float64 else torch.float32
    assert_close_to(got, want, size, tol_dtype, f"aggregate {reduction}")
    if masked:
        clean = inputs(batch, layout=step.layout, garbage=False)
        assert torch.equal(got, klest.aggregate(clean.logp, mask=clean.mask, reduction=reduction))
        other = "left" if step.layout == "right" else "right"
        y = inputs(batch, layout=other)
        flipped = klest.aggregate(y.logp, mask=y.mask, reduction=reduction)
        assert_close_up_to_rounding(
            same_layout(flipped.detach(), replace(step, layout=other), reduction),
            same_layout(got.detach(), step, reduction),
            tol_dtype,
            "aggregate by layout",
        )


@given(step=sequences().map(lambda s: s[0]))
@settings(max_examples=200, deadline=None)
def test_decouple_gives_the_value_forward_and_the_surrogate_gradient_backward(step):
    """``decouple(value, logp * c)``: forward exactly ``value`` (whatever it holds, NaN
    included), gradient to ``logp`` exactly ``c``, none to ``value``; a non-finite surrogate
    (garbage under a mask it has no notion of) is a ValueError naming the surrogate."""
    x = inputs(step.batch, layout=step.layout)
    value = x.logp_ref.detach().clone().requires_grad_()
    coef = torch.where(x.mask, x.logp_behavior.detach(), 0.5)
    clean = inputs(step.batch, layout=step.layout, garbage=False).logp.detach().requires_grad_()
    out = klest.decouple(value, clean * coef)
    assert torch.equal(out.isnan(), value.isnan()), "decouple: NaN pattern of the value"
    same = torch.where(value.isnan(), 0.0, value.detach())
    assert torch.equal(torch.where(out.isnan(), 0.0, out.detach()), same), "decouple: value"
    g_logp, g_value = torch.autograd.grad(out.sum(), (clean, value), allow_unused=True)
    assert torch.equal(g_logp, coef), "decouple: gradient is not the surrogate's"
    assert g_value is None or not bool(g_value.any()), "decouple: the value passed a gradient"
    surrogate = x.logp * coef
    if bool(torch.isfinite(surrogate).all()):
        klest.decouple(value, surrogate, validate=True)
    else:
        with pytest.raises(ValueError, match="surrogate"):
            klest.decouple(value, surrogate, validate=True)


def exact_kl_reference(z: torch.Tensor, y: torch.Tensor, keep: torch.Tensor, direction: str):
    """Per-position float64 KL of the rounded logits and its rounding size ``(1 + M) C`` with
    ``M = max|z| + max|y|`` over the position's vocabulary (``tests/logits/test_logits_batches``:
    the log-softmax's absolute error is a few u M; ``C = 1`` here, the ``1e3`` covers it)."""
    lz = torch.where(keep.unsqueeze(-1), z.double(), 0.0).log_softmax(-1)
    ly = torch.where(keep.unsqueeze(-1), y.double(), 0.0).log_softmax(-1)
    kl = kl_rows(lz, ly) if direction == "pi||ref" else kl_rows(ly, lz)
    big = z.double().abs().amax(-1) + y.double().abs().amax(-1)
    return torch.where(keep, kl, 0.0), torch.where(keep, 1 + big + kl.abs(), 0.0)


@given(
    steps=sequences(),
    which=st.sampled_from(("categorical_kl", "KLFromLogits", "KLFromHidden")),
    direction=st.sampled_from(("pi||ref", "ref||pi")),
    data=st.data(),
)
@settings(max_examples=150, deadline=None)
def test_exact_kls_and_their_modules_over_a_sequence(steps, which, direction, data):
    """``categorical_kl``, ``KLFromLogits`` and ``KLFromHidden`` (one module over the whole
    sequence, ``.double()`` after a drawn batch): the float64 KL of the softmaxes reduced by
    hand, for every reduction; garbage in masked positions' logits (or hidden states) gives bit
    for bit the result of zeros there; 0 gradient there; left and right padding agree."""
    reduction = data.draw(st.sampled_from(ALL_REDUCTIONS), label="reduction")
    cast_after = data.draw(st.integers(0, len(steps) - 1), label="cast after")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    vocab = {s.batch.logits.shape[-1] for s in steps}
    # Heads and hidden states on a grid of halves, H = 3: every logit is exact in every dtype.
    heads = {v: torch.nn.Linear(3, v).double().requires_grad_(False) for v in vocab}
    for head in heads.values():
        head.weight.copy_(torch.randint(-3, 4, head.weight.shape, generator=gen) / 2)
        head.bias.copy_(torch.randint(-3, 4, head.bias.shape, generator=gen) / 2)
    modules = {
        "KLFromLogits": KLFromLogits(direction=direction, reduction=reduction),
        "KLFromHidden": {
            v: KLFromHidden(h, direction=direction, reduction=reduction) for v, h in heads.items()
        },
    }
    for k, step in enumerate(steps):
        batch, dtype = step.batch, step.batch.dtype
        v = batch.logits.shape[-1]
        hidden = torch.randint(-3, 4, (*batch.lead, batch.t, 3), generator=gen) / 2

        def call(
            x: Inputs, garbage: bool = True, *, step=step, batch=batch, v=v, hidden=hidden
        ) -> torch.Tensor:
            dtype = batch.dtype
            if which == "categorical_kl":
                return klest.categorical_kl(
                    x.logits, x.logits_ref, direction=direction, mask=x.mask, reduction=reduction
                )
            if which == "KLFromLogits":
                return modules[which](x.logits, x.logits_ref, mask=x.mask)
            h = hidden if step.layout == "right" else to_left(hidden, batch)
            h = torch.where(x.mask.unsqueeze(-1), h, math.nan if garbage else 0.0)
            heads[v].to(dtype)
            return modules[which][v](h.to(dtype), logits_ref=x.logits_ref, mask=x.mask)

        x = inputs(batch, layout=step.layout)
        z = x.logits
        if which == "KLFromHidden":
            h = hidden if step.layout == "right" else to_left(hidden, batch)
            z = (h.double() @ heads[v].weight.T.double() + heads[v].bias.double()).to(dtype)
        kl, size = exact_kl_reference(z, x.logits_ref, x.mask, direction)
        want = reduce_by_hand(kl, x.mask, reduction)
        got = call(x)
        what = f"{which} {direction} {reduction} batch {k} ({dtype}, {step.layout})"
        assert got.dtype == compute_dtype(dtype), f"{what}: dtype {got.dtype}"
        assert_close_to(got.detach(), want, reduce_by_hand(size, x.mask, reduction), dtype, what)
        if which != "KLFromHidden":
            (grad,) = torch.autograd.grad(got.sum(), x.logits)
            assert not bool(grad[~x.mask].any()), f"{what}: gradient under the mask"
        clean = call(inputs(batch, layout=step.layout, garbage=False), garbage=False)
        assert torch.equal(got, clean), f"{what}: garbage under the mask was read"
        other = replace(step, layout="left" if step.layout == "right" else "right")
        y = inputs(batch, layout=other.layout)
        flipped = call(y) if which != "KLFromHidden" else None
        if flipped is not None:
            assert_close_up_to_rounding(
                same_layout(flipped.detach(), other, reduction),
                same_layout(got.detach(), step, reduction),
                dtype,
                f"{what}: by layout",
            )
        if k == cast_after and which != "categorical_kl":
            module = modules[which] if which == "KLFromLogits" else modules[which][v]
            module.double()
            assert torch.equal(call(x), got), f"{what}: .double() changed the module's result"


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float64])
def test_casting_a_state_returns_the_module_itself(cast):
    """``state = state.to(dtype)`` (nn.Module's contract: ``to`` returns the module) keeps the
    moving averages, not None."""
    for state in (klest.BaselineEMA(), klest.LooScaleEMA(), klest.AlphaEMA()):
        assert state.to(cast) is state, type(state).__name__
        assert state.half() is state and state.cpu() is state, type(state).__name__


def test_a_cast_that_also_moves_the_state_moves_it_and_keeps_float64():
    """``to(device, dtype)`` moves the float64 state to the device (the meta device here, which
    needs no accelerator) and keeps its dtype."""
    for state in (klest.BaselineEMA(), klest.LooScaleEMA(), klest.AlphaEMA()):
        state.to(torch.device("meta"), torch.bfloat16)
        for name, v in state.state_dict().items():
            assert v.device.type == "meta" and v.dtype == torch.float64, (type(state), name)
