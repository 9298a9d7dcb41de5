"""Property tests: the README's trainer-batch rules on batches drawn like a trainer's.

The README ("Trainer batches: the rules every function follows") promises that no batch a
trainer produces crashes klest, and states rules that these tests check on batches drawn by
hypothesis (derandomized: ``tests/conftest.py``): 1 to 6 rows, optionally a second leading
dimension ``[B, G, T]``, 1 to 9 tokens, per-row lengths from 0 (empty rows) to T, left or right
padding, group ids of arbitrary integers (unsorted, non-contiguous, groups of one), every
dtype, log-probs gathered from real softmaxes (so they are valid), NaN / +inf / -inf / 5.0
planted under the mask, off-policy samples and logits.

For every combination of :func:`klest.kl_penalty`'s options (estimator x grad x baseline x
direction x level x reduction x on/off-policy x reparameterized), the test's own model of its
rules (:func:`refusal`, read from ``klest.sampled.penalty._check_rules`` and ``check_level``) says
whether it is accepted; a refused one must raise ``ValueError`` whatever the data. Accepted
ones must satisfy, on every batch:

1. no exception, a finite value and a finite gradient;
2. left- and right-padded layouts of the same completions give the same loss and gradient;
3. an extra empty row (garbage under its mask) changes neither the other rows' per-sequence
   values nor the reductions that count valid tokens / rows, and gets an exact 0 gradient;
4. relabelling group ids by an injective map changes nothing (bit for bit); permuting rows
   permutes the per-sequence results;
5. the loss has the compute dtype (float32 for float32 / bf16 / fp16, float64 for float64);
6. garbage under the mask reaches neither the result nor the gradient: bit for bit the result
   of the same batch with 0 there.

:func:`klest.kl_estimate` (every estimator, ``cv`` with fitted, fixed and moving-average
coefficients and groups), :func:`klest.kl_reward` and :func:`klest.kl_from_logits` with
``labels=`` (-100 at padding) feeding :func:`klest.kl_penalty` get the same properties.
Nothing here is statistical: the answers are equalities, exact or up to rounding. Each drawn
property runs ``EXAMPLES`` (400) batches per function (200 for the labels path), the sweep all
36864 combinations on three fixed batches; the file takes about 32 s on one core.

Rounding tolerance (``assert_close_up_to_rounding``): the layouts and row orders differ only in
where zeros sit and in which order sums over rows and tokens are taken. Reordering a sum of n
terms changes it by at most (n - 1) u sum|x_i| (u the unit roundoff); with n <= 9 tokens x 18
rows and the exponentials of log-ratio sums (whose relative error is |argument| u, arguments
below ~40 here), the difference is below ~1e3 u times the largest magnitude of the compared
tensor: ``1e3 * eps(compute dtype) * (1 + max|x|)`` (1.2e-4 in float32, 2.2e-13 in float64).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import klest
from klest._types import Baseline, Direction, Estimator, Grad, Reduction
from klest.testbeds import make_generator

MAX_ROWS = 12
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
GARBAGE = (math.nan, math.inf, -math.inf, 5.0)
# Every name each option takes, read from klest's ``Literal`` types (so a new one is drawn too);
# "ema" / "loo-scale-ema" stand for a BaselineEMA / LooScaleEMA object.
ESTIMATORS = get_args(Estimator)
GRADS = get_args(Grad)
BASELINES = (None, *get_args(Baseline), "ema", "loo-scale-ema")
DIRECTIONS = get_args(Direction)
REDUCTIONS = get_args(Reduction)
SEQUENCE_REDUCTIONS = ("per-sequence", "seq-mean-token-sum", "sum")
REPARAMETERIZED_GRADS = ("pathwise", "adaptive", "stl")
SCORE_GRADS = ("score", "cumulative", "rb", "token")
ALPHAS = ("loo", "crossfit", "in-sample", 0.5, "ema")


# -- batches -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One trainer batch, right-padded, with clean log-probs everywhere (``[*lead, T]``).

    ``logits*`` are float64 ``[*lead, T, V]``; ``labels`` the sampled tokens; ``lengths`` and
    ``group`` ``[*lead]``; ``junk`` ``[*lead, T]`` the garbage each masked position holds when
    garbage is planted (the same values travel with their row when the layout changes).
    """

    logits: torch.Tensor
    logits_ref: torch.Tensor
    logits_behavior: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor
    group: torch.Tensor
    junk: torch.Tensor
    dtype: torch.dtype

    @property
    def lead(self) -> torch.Size:
        return self.lengths.shape

    @property
    def t(self) -> int:
        return self.labels.shape[-1]

    def mask(self) -> torch.Tensor:
        return torch.arange(self.t) < self.lengths.unsqueeze(-1)

    def logp(self, logits: torch.Tensor) -> torch.Tensor:
        """log softmax(logits) at the labels, float64."""
        return logits.log_softmax(-1).gather(-1, self.labels.unsqueeze(-1)).squeeze(-1)


def _shift(x: torch.Tensor, lengths: torch.Tensor, t: int, sign: int) -> torch.Tensor:
    """Roll each row of ``x`` (``[*lead, T, ...]``, rows right-padded to ``lengths``) by
    ``sign * (T - length)`` columns: +1 moves the valid tokens to the end (left padding), -1
    undoes it."""
    lead = lengths.shape
    cols = (torch.arange(t) - sign * (t - lengths).unsqueeze(-1)) % t  # [*lead, T]
    index = cols.reshape(*cols.shape, *([1] * (x.ndim - len(lead) - 1))).expand_as(x)
    return x.gather(len(lead), index)


def to_left(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    return _shift(x, batch.lengths, batch.t, +1)


def to_right(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    return _shift(x, batch.lengths, batch.t, -1)


@st.composite
def trainer_batches(draw, *, min_t: int = 1) -> Batch:
    """A batch as a trainer makes it (see the module docstring)."""
    b = draw(st.integers(1, 6))
    g = draw(st.one_of(st.none(), st.integers(1, 3)))
    if g is not None and b * g > MAX_ROWS:
        g = MAX_ROWS // b
    lead = (b,) if g is None else (b, g)
    rows = math.prod(lead)
    # [B, G, 1] reads as the trailing 1 of a gather and is refused (tests/test_bad_input.py)
    t = draw(st.integers(min_t if g is None else max(min_t, 2), 9))
    v = draw(st.integers(2, 5))
    lengths = draw(st.lists(st.integers(0, t), min_size=rows, max_size=rows))
    # Arbitrary integer ids: a pool of distinct values, each row takes one (unsorted, gaps,
    # groups of one, all rows in one group).
    pool = draw(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=rows, unique=True))
    picks = draw(st.lists(st.integers(0, len(pool) - 1), min_size=rows, max_size=rows))
    dtype = draw(st.sampled_from(DTYPES))
    # pi's logits, and ref's and behavior's a perturbation of them (as in RL fine-tuning): per
    # token log-ratios of about +-2 at most, so that importance weights and sequence ratios
    # (their exponentials summed over 9 tokens) and the gradients stay inside fp16's range.
    scale = draw(st.sampled_from((0.3, 1.0, 2.0)))
    distance = draw(st.sampled_from((0.05, 0.3, 0.8)))
    garbage = draw(st.sampled_from((*GARBAGE, "mixed")))
    gen = make_generator(draw(st.integers(0, 2**31 - 1)))

    def noise(size: float) -> torch.Tensor:
        return size * torch.randn(*lead, t, v, generator=gen, dtype=torch.float64)

    z = noise(scale)
    y, w = z + noise(distance), z + noise(distance / 2)
    labels = torch.randint(0, v, (*lead, t), generator=gen)
    if garbage == "mixed":
        junk = torch.tensor(GARBAGE, dtype=torch.float64)[
            torch.randint(0, len(GARBAGE), (*lead, t), generator=gen)
        ]
    else:
        junk = torch.full((*lead, t), garbage, dtype=torch.float64)
    return Batch(
        z,
        y,
        w,
        labels,
        torch.tensor(lengths).reshape(lead),
        torch.tensor([pool[i] for i in picks], dtype=torch.int64).reshape(lead),
        junk,
        dtype,
    )


@dataclass
class Inputs:
    """The tensors one call takes, in the batch's dtype; ``logp`` (and ``logits``, and
    ``logp_ref`` when reparameterized) are leaves that require grad."""

    logp: torch.Tensor
    logp_ref: torch.Tensor
    logp_behavior: torch.Tensor
    logits: torch.Tensor
    logits_ref: torch.Tensor
    mask: torch.Tensor
    group: torch.Tensor

    def leaves(self) -> dict[str, torch.Tensor]:
        return {
            k: getattr(self, k)
            for k in ("logp", "logp_ref", "logits")
            if getattr(self, k).requires_grad
        }


def inputs(
    batch: Batch, *, layout: str = "right", garbage: bool = True, ref_grad: bool = False
) -> Inputs:
    """The batch's tensors, with ``junk`` (``garbage``) or 0 at masked positions."""
    mask = batch.mask()
    fill = batch.junk if garbage else torch.zeros_like(batch.junk)

    def tokens(logits: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, batch.logp(logits), fill)

    def full(logits: torch.Tensor) -> torch.Tensor:
        return torch.where(mask.unsqueeze(-1), logits, fill.unsqueeze(-1))

    arrange = (lambda x: x) if layout == "right" else (lambda x: to_left(x, batch))

    def leaf(x: torch.Tensor, grad: bool = True) -> torch.Tensor:
        return arrange(x).to(batch.dtype).detach().requires_grad_(grad)

    return Inputs(
        logp=leaf(tokens(batch.logits)),
        logp_ref=leaf(tokens(batch.logits_ref), ref_grad),
        logp_behavior=leaf(tokens(batch.logits_behavior), False),
        logits=leaf(full(batch.logits)),
        logits_ref=leaf(full(batch.logits_ref), False),
        mask=arrange(mask),
        group=batch.group,
    )


def with_empty_row(batch: Batch, at: int, group_id: int) -> Batch:
    """``batch`` with one more index ``at`` along the first dimension whose rows are all
    padding (garbage under the mask when planted) in group ``group_id``."""

    def insert(x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:at], row.unsqueeze(0), x[at:]])

    def like(x: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.full_like(x[0], fill)

    return replace(
        batch,
        logits=insert(batch.logits, like(batch.logits, 0.5)),
        logits_ref=insert(batch.logits_ref, like(batch.logits_ref, -0.5)),
        logits_behavior=insert(batch.logits_behavior, like(batch.logits_behavior, 0.0)),
        labels=insert(batch.labels, like(batch.labels, 0)),
        lengths=insert(batch.lengths, like(batch.lengths, 0)),
        group=insert(batch.group, like(batch.group, group_id)),
        junk=insert(batch.junk, like(batch.junk, math.nan)),
    )


def permuted(batch: Batch, order: torch.Tensor) -> Batch:
    """``batch`` with its first dimension reordered by ``order``."""
    return replace(
        batch,
        **{
            f: getattr(batch, f)[order]
            for f in (
                "logits",
                "logits_ref",
                "logits_behavior",
                "labels",
                "lengths",
                "group",
                "junk",
            )
        },
    )


# -- options and their rules ---------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """One combination of :func:`klest.kl_penalty`'s options."""

    estimator: str
    grad: str
    baseline: str | None  # "ema": a BaselineEMA, "loo-scale-ema": a LooScaleEMA
    direction: str
    level: str
    reduction: str
    off_policy: bool
    reparameterized: bool


def refusal(o: Options) -> str | None:
    """Why ``kl_penalty`` refuses ``o`` (None: it accepts it): this test's reading of
    ``klest.sampled.penalty._check_rules`` and ``klest.sampled.log_ratios.check_level``, written
    out."""
    if o.level == "sequence" and o.reduction not in SEQUENCE_REDUCTIONS:
        return "level='sequence' takes one value per sequence"
    if o.grad == "stl" and o.direction != "pi||ref":
        return "stl estimates grad KL(pi||ref) only"
    if o.grad in REPARAMETERIZED_GRADS and not o.reparameterized:
        return "pathwise gradients need reparameterized samples"
    if o.grad in SCORE_GRADS and o.reparameterized:
        return "score-function gradients refuse reparameterized samples"
    if o.grad in REPARAMETERIZED_GRADS and o.off_policy:
        return "pathwise gradients need samples from pi"
    if o.baseline is None:
        return None
    if o.baseline in ("exact-kl", "exact-kl+loo"):
        takes = o.direction == "pi||ref" and o.grad in ("cumulative", "token")
        return None if takes else "exact-KL baselines: cumulative and token, KL(pi||ref)"
    takes = o.grad in ("score", "cumulative") or (o.grad == "rb" and o.direction == "pi||ref")
    return None if takes else "baselines: score and cumulative, and rb for KL(pi||ref)"


ALL_OPTIONS = [
    Options(*combo)
    for combo in itertools.product(
        ESTIMATORS,
        GRADS,
        BASELINES,
        DIRECTIONS,
        ("token", "sequence"),
        REDUCTIONS,
        (False, True),
        (False, True),
    )
]
ACCEPTED = [o for o in ALL_OPTIONS if refusal(o) is None]
REFUSED = [o for o in ALL_OPTIONS if refusal(o) is not None]


@dataclass(frozen=True)
class Extras:
    """Options that never decide a refusal: ``cv``'s coefficient, whether to pass ``group``
    (always with a group baseline or a fitted alpha) and the logits (always where needed)."""

    alpha: float | str
    group: bool
    logits: bool


extras = st.builds(Extras, st.sampled_from(ALPHAS), st.booleans(), st.booleans())


def needs_logits(o: Options) -> bool:
    return "rb" in (o.estimator, o.grad) or o.baseline in ("exact-kl", "exact-kl+loo")


def uses_state(o: Options, e: Extras) -> bool:
    return o.baseline in ("ema", "loo-scale-ema") or (o.estimator == "cv" and e.alpha == "ema")


def order_dependent(o: Options | RewardOptions, e: Extras) -> bool:
    """Cross-fitting splits each group's rows into two folds alternating in row order
    (``klest.sampled.control_variates`` and ``klest.sampled.baselines``): permuting rows changes
    the folds."""
    return o.baseline == "loo-fitted" or (o.estimator == "cv" and e.alpha == "crossfit")


@dataclass
class Result:
    """One call's loss, per-sequence values and gradient to each input leaf (0 where unused)."""

    loss: torch.Tensor
    per_sequence: torch.Tensor | None
    grads: dict[str, torch.Tensor]


def backward(out: torch.Tensor, x: Inputs) -> dict[str, torch.Tensor]:
    leaves = x.leaves()
    if not out.requires_grad:
        return {k: torch.zeros_like(v) for k, v in leaves.items()}
    grads = torch.autograd.grad(out.sum(), list(leaves.values()), allow_unused=True)
    return {
        k: torch.zeros_like(v) if g is None else g
        for (k, v), g in zip(leaves.items(), grads, strict=True)
    }


def value_alpha(o: Options, e: Extras):
    """``cv``'s coefficient (a fresh AlphaEMA for "ema"), None for the other estimators."""
    if o.estimator != "cv":
        return None
    return klest.AlphaEMA(decay=0.5) if e.alpha == "ema" else e.alpha


def call_quietly(o: Options, e: Extras, fn):
    """``fn()`` with warnings off (biased gradients, small fitted groups and non-k1 rewards warn
    by design); twice when a baseline or alpha keeps state, so that the second call, returned,
    uses a state fitted on a batch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if uses_state(o, e):
            fn()
        return fn()


def penalty(x: Inputs, o: Options, e: Extras) -> Result:
    """``kl_penalty`` with options ``o`` on ``x`` (a stateful baseline or alpha: fresh)."""
    baseline: object = o.baseline
    if o.baseline == "ema":
        baseline = klest.BaselineEMA(decay=0.5)
    elif o.baseline == "loo-scale-ema":
        baseline = klest.LooScaleEMA(decay=0.5)
    alpha = value_alpha(o, e)
    grouped = e.group or baseline is not None or isinstance(alpha, str)
    logits = needs_logits(o) or e.logits
    loss, details = call_quietly(
        o,
        e,
        lambda: klest.kl_penalty(
            x.logp,
            x.logp_ref,
            estimator=o.estimator,
            grad=o.grad,
            direction=o.direction,
            mask=x.mask,
            reduction=o.reduction,
            baseline=baseline,
            group=x.group if grouped else None,
            reparameterized=o.reparameterized,
            level=o.level,
            alpha=alpha,
            logp_behavior=x.logp_behavior if o.off_policy else None,
            logits=x.logits if logits else None,
            logits_ref=x.logits_ref if logits else None,
            logp_stl=x.logp.detach() if o.grad == "stl" else None,
            return_details=True,
        ),
    )
    # Samples with a valid token, alone among such samples in their group (empty rows are none).
    nonempty = x.mask.reshape(-1, x.mask.shape[-1]).any(-1)
    ids = Counter(x.group.reshape(-1)[nonempty].tolist()) if grouped else {}
    singletons = sum(n == 1 for n in ids.values())
    assert details.n_singleton_samples == singletons, f"{o}: {details.n_singleton_samples} alone"
    return Result(loss.detach(), details.per_sequence, backward(loss, x))


# -- comparisons ---------------------------------------------------------------------------------


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def assert_close_up_to_rounding(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str
):
    """Equal up to the rounding of reordered sums (module docstring): ``1e3 u (1 + max|want|)``
    with u the unit roundoff of ``dtype``'s compute dtype."""
    assert got.shape == want.shape, f"{what}: shapes {tuple(got.shape)} vs {tuple(want.shape)}"
    got, want = got.double(), want.double()
    tol = (
        1e3
        * torch.finfo(compute_dtype(dtype)).eps
        * (1 + float(want.abs().amax()) if want.numel() else 1)
    )
    diff = (got - want).abs()
    worst = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0]) if diff.numel() else ()
    assert bool((diff <= tol).all()), (
        f"{what}: {int((diff > tol).sum())} of {diff.numel()} elements differ by more than "
        f"{tol:.3g}; largest {float(diff.max()):.3g} at {worst}"
    )


def assert_finite(r: Result, what: str) -> None:
    assert bool(torch.isfinite(r.loss).all()), f"{what}: loss not finite: {r.loss}"
    for k, g in r.grads.items():
        assert bool(torch.isfinite(g).all()), f"{what}: gradient to {k} not finite"


def assert_masked_gradient_zero(r: Result, x: Inputs, what: str) -> None:
    for k, g in r.grads.items():
        masked = ~x.mask if g.ndim == x.mask.ndim else ~x.mask.unsqueeze(-1).expand_as(g)
        assert not bool(g[masked].any()), f"{what}: gradient to {k} is not 0 under the mask"


def assert_results_close(got: Result, want: Result, dtype: torch.dtype, what: str) -> None:
    assert_close_up_to_rounding(got.loss, want.loss, dtype, f"{what}: loss")
    if want.per_sequence is not None:
        assert_close_up_to_rounding(
            got.per_sequence, want.per_sequence, dtype, f"{what}: per-sequence"
        )
    for k in want.grads:
        assert_close_up_to_rounding(got.grads[k], want.grads[k], dtype, f"{what}: gradient to {k}")


def assert_results_equal(got: Result, want: Result, what: str) -> None:
    """Bit for bit (NaN nowhere: the results are checked finite first)."""
    assert torch.equal(got.loss, want.loss), f"{what}: loss {got.loss} vs {want.loss}"
    if want.per_sequence is not None:
        assert torch.equal(got.per_sequence, want.per_sequence), f"{what}: per-sequence values"
    for k in want.grads:
        assert torch.equal(got.grads[k], want.grads[k]), f"{what}: gradient to {k}"


def unrolled(r: Result, batch: Batch, reduction: str) -> Result:
    """A left-padded call's result in the right-padded layout."""
    loss = to_right(r.loss, batch) if reduction == "none" else r.loss
    return Result(loss, r.per_sequence, {k: to_right(g, batch) for k, g in r.grads.items()})


# -- kl_penalty: every combination on fixed batches ------------------------------------------------


def fixed_batch(
    seed: int, lead: tuple[int, ...], t: int, lengths: list[int], group: list[int], dtype
) -> Batch:
    gen = make_generator(seed)
    logits = [torch.randn(*lead, t, 3, generator=gen, dtype=torch.float64) for _ in range(3)]
    junk = torch.tensor(GARBAGE, dtype=torch.float64)[
        torch.randint(0, 4, (*lead, t), generator=gen)
    ]
    return Batch(
        *logits,
        torch.randint(0, 3, (*lead, t), generator=gen),
        torch.tensor(lengths).reshape(lead),
        torch.tensor(group).reshape(lead),
        junk,
        dtype,
    )


FIXED_BATCHES = {
    # empty rows, a group of one, unsorted sparse ids, NaN / inf / 5.0 under the mask
    "bf16-2d": fixed_batch(0, (5,), 4, [4, 0, 2, 1, 3], [7, -3, 7, 10**12, 7], torch.bfloat16),
    "fp16-3d": fixed_batch(1, (2, 3), 3, [3, 0, 1, 2, 0, 3], [5, 5, -1, 9, 5, 9], torch.float16),
    "fp64-t1": fixed_batch(2, (3,), 1, [1, 0, 1], [2, 2, 2], torch.float64),
}


@pytest.mark.parametrize("name", list(FIXED_BATCHES))
def test_every_option_combination_runs_or_is_refused_by_the_options_alone(name):
    """All 36864 combinations on three nasty batches, left-padded: the accepted ones give a
    finite loss and gradient, 0 under the mask, in the compute dtype; the refused ones raise
    ValueError, on every batch alike (the rules are read from the options, not the data)."""
    batch = FIXED_BATCHES[name]
    e = Extras("loo", True, False)
    xs = {grad: inputs(batch, layout="left", ref_grad=grad) for grad in (False, True)}
    for o in ALL_OPTIONS:
        x = xs[o.reparameterized]
        if refusal(o) is not None:
            with pytest.raises(ValueError), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                penalty(x, o, e)
            continue
        r = penalty(x, o, e)
        assert_finite(r, f"{o}")
        assert_masked_gradient_zero(r, x, f"{o}")
        assert r.loss.dtype == compute_dtype(batch.dtype), f"{o}: loss dtype {r.loss.dtype}"


# -- kl_penalty: drawn batches ---------------------------------------------------------------------


@dataclass(frozen=True)
class RewardOptions:
    """One combination of :func:`klest.kl_reward`'s options (per token: ``reduction="none"``)."""

    estimator: str
    reward_to_go: bool
    discount: float
    baseline: None = None
    reduction: str = "none"
    reparameterized: bool = False


ESTIMATE_OPTIONS = [
    Options(estimator, "autodiff", None, direction, level, reduction, off_policy, False)
    for estimator, direction, level, reduction, off_policy in itertools.product(
        ESTIMATORS, DIRECTIONS, ("token", "sequence"), REDUCTIONS, (False, True)
    )
    if level == "token" or reduction in SEQUENCE_REDUCTIONS
]
REWARD_OPTIONS = [
    RewardOptions(estimator, reward_to_go, discount)
    for estimator, reward_to_go, discount in itertools.product(
        ("k1", "k2", "k3", "abs"), (False, True), (1.0, 0.8)
    )
    if reward_to_go or discount == 1.0
]


def estimate(x: Inputs, o: Options, e: Extras) -> Result:
    """``kl_estimate`` with the value options of ``o`` (its gradient: autodiff of the value)."""
    alpha = value_alpha(o, e)
    rb = o.estimator == "rb"
    out = call_quietly(
        o,
        e,
        lambda: klest.kl_estimate(
            x.logp,
            x.logp_ref,
            estimator=o.estimator,
            direction=o.direction,
            mask=x.mask,
            reduction=o.reduction,
            level=o.level,
            alpha=alpha,
            group=x.group if isinstance(alpha, str) else None,
            logp_behavior=x.logp_behavior if o.off_policy else None,
            logits=x.logits if rb else None,
            logits_ref=x.logits_ref if rb else None,
        ),
    )
    return Result(out.detach(), None, backward(out, x))


def reward(x: Inputs, o: RewardOptions, e: Extras) -> Result:
    """``kl_reward`` (no graph: no gradient to check)."""
    out = call_quietly(
        o,
        e,
        lambda: klest.kl_reward(
            x.logp,
            x.logp_ref,
            mask=x.mask,
            estimator=o.estimator,
            discount=o.discount,
            reward_to_go=o.reward_to_go,
        ),
    )
    assert not out.requires_grad
    return Result(out, None, {})


CALLS = {
    "kl_penalty": (penalty, st.sampled_from(ACCEPTED)),
    "kl_estimate": (estimate, st.sampled_from(ESTIMATE_OPTIONS)),
    "kl_reward": (reward, st.sampled_from(REWARD_OPTIONS)),
}
EXAMPLES = 400
each_call = pytest.mark.parametrize("call", list(CALLS))


def assert_sound(r: Result, x: Inputs, dtype: torch.dtype, reduction: str, what: str) -> None:
    """Rules 1 and 5, and the gradient half of rule 6: finite, 0 gradient under the mask (and
    0 values there under ``"none"``), the loss and per-sequence values in the compute dtype."""
    assert_finite(r, what)
    assert_masked_gradient_zero(r, x, what)
    if reduction == "none":
        assert not bool(r.loss[~x.mask].any()), f"{what}: a masked position's value is not 0"
    assert r.loss.dtype == compute_dtype(dtype), f"{what}: loss dtype {r.loss.dtype}"
    if r.per_sequence is not None:
        assert r.per_sequence.dtype == compute_dtype(dtype), f"{what}: per-sequence dtype"


def rows_except(r: Result, at: int, rows: int, reduction: str) -> Result:
    """``r`` without index ``at`` of the first dimension (the reductions that keep it)."""
    keep = [i for i in range(rows) if i != at]
    loss = r.loss[keep] if reduction in ("none", "per-sequence") else r.loss
    per_sequence = None if r.per_sequence is None else r.per_sequence[keep]
    return Result(loss, per_sequence, {k: g[keep] for k, g in r.grads.items()})


def relabelled(batch: Batch, new_ids: list[int]) -> Batch:
    """``batch`` with its group ids mapped injectively onto ``new_ids`` (in order of value)."""
    ids = torch.unique(batch.group)
    mapped = torch.tensor(new_ids[: len(ids)], dtype=torch.int64)
    return replace(batch, group=mapped[torch.searchsorted(ids, batch.group)])


@each_call
@given(batch=trainer_batches(), e=extras, data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_left_and_right_padding_agree(call, batch, e, data):
    """Rules 1, 2, 5: the same completions, left- or right-padded (garbage under the mask)."""
    fn, options = CALLS[call]
    o = data.draw(options, label="options")
    right_x = inputs(batch, ref_grad=o.reparameterized)
    left_x = inputs(batch, layout="left", ref_grad=o.reparameterized)
    right, left = fn(right_x, o, e), fn(left_x, o, e)
    assert_sound(right, right_x, batch.dtype, o.reduction, f"{o} right-padded")
    assert_sound(left, left_x, batch.dtype, o.reduction, f"{o} left-padded")
    assert_results_close(unrolled(left, batch, o.reduction), right, batch.dtype, f"{o}")


@each_call
@given(batch=trainer_batches(), e=extras, layout=st.sampled_from(("left", "right")), data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_what_the_mask_hides_is_never_read(call, batch, e, layout, data):
    """Rule 6: NaN / inf / 5.0 under the mask give, bit for bit, the result of zeros there."""
    fn, options = CALLS[call]
    o = data.draw(options, label="options")
    x = inputs(batch, layout=layout, ref_grad=o.reparameterized)
    with_garbage = fn(x, o, e)
    assert_sound(with_garbage, x, batch.dtype, o.reduction, f"{o}")
    clean = fn(inputs(batch, layout=layout, garbage=False, ref_grad=o.reparameterized), o, e)
    assert_results_equal(with_garbage, clean, f"{o}")


@each_call
@given(batch=trainer_batches(), e=extras, data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_an_extra_empty_row_changes_nothing(call, batch, e, data):
    """Rule 3: an empty row (in a group of its own or another's, garbage under its mask) leaves
    the other rows' values and gradients and the reductions unchanged; its gradient is 0."""
    fn, options = CALLS[call]
    o = data.draw(options, label="options")
    at = data.draw(st.integers(0, batch.lead[0]), label="at")
    old_ids = batch.group.reshape(-1).tolist()
    group_id = data.draw(st.sampled_from(old_ids) | st.integers(-(2**40), 2**40), label="id")
    base = fn(inputs(batch, ref_grad=o.reparameterized), o, e)
    x = inputs(with_empty_row(batch, at, group_id), ref_grad=o.reparameterized)
    extended = fn(x, o, e)
    assert_sound(extended, x, batch.dtype, o.reduction, f"{o}")
    for k, g in extended.grads.items():
        assert not bool(g[at].any()), f"{o}: the empty row's gradient to {k} is not 0"
    if extended.per_sequence is not None:
        assert not bool(extended.per_sequence[at].any()), f"{o}: the empty row's value is not 0"
    if o.reduction in ("none", "per-sequence"):
        assert not bool(extended.loss[at].any()), f"{o}: the empty row's loss is not 0"
    others = rows_except(extended, at, batch.lead[0] + 1, o.reduction)
    assert_results_close(others, base, batch.dtype, f"{o}")


@each_call
@given(batch=trainer_batches(), e=extras, data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_group_ids_are_labels_and_rows_have_no_order(call, batch, e, data):
    """Rule 4: group ids mapped injectively change nothing, bit for bit; permuting the rows
    permutes the per-sequence values, losses and gradients (except under cross-fitting, whose
    folds alternate in row order)."""
    fn, options = CALLS[call]
    o = data.draw(options, label="options")
    x = inputs(batch, ref_grad=o.reparameterized)
    base = fn(x, o, e)
    assert_sound(base, x, batch.dtype, o.reduction, f"{o}")
    new_ids = data.draw(
        st.lists(st.integers(-(2**62), 2**62), min_size=MAX_ROWS, max_size=MAX_ROWS, unique=True),
        label="new ids",
    )
    renamed = fn(inputs(relabelled(batch, new_ids), ref_grad=o.reparameterized), o, e)
    assert_results_equal(renamed, base, f"{o} relabelled")
    if order_dependent(o, e):
        return
    order = torch.tensor(data.draw(st.permutations(range(batch.lead[0])), label="order"))
    moved = fn(inputs(permuted(batch, order), ref_grad=o.reparameterized), o, e)
    loss = base.loss[order] if o.reduction in ("none", "per-sequence") else base.loss
    per_sequence = None if base.per_sequence is None else base.per_sequence[order]
    grads = {k: g[order] for k, g in base.grads.items()}
    assert_results_close(moved, Result(loss, per_sequence, grads), batch.dtype, f"{o}")


@given(batch=trainer_batches(), o=st.sampled_from(REFUSED), e=extras)
@settings(max_examples=EXAMPLES, deadline=None)
def test_kl_penalty_refuses_by_the_options_whatever_the_batch(batch, o, e):
    x = inputs(batch, ref_grad=o.reparameterized)
    with pytest.raises(ValueError):
        penalty(x, o, e)


@pytest.mark.parametrize("fit", ["cv-crossfit", "loo-fitted"])
def test_cross_fitting_folds_skip_empty_rows(fit):
    """Cross-fitting alternates each group's rows between two folds; an empty row inserted
    into a group must not move the rows after it to the other fold (it did: the cross-fitted
    alpha changed the other rows' values, the cross-fitted baseline scale their gradients)."""
    g = make_generator(0)
    logp = -torch.rand(4, 3, generator=g, dtype=torch.float64) - 0.1
    logp_ref = -torch.rand(4, 3, generator=g, dtype=torch.float64) - 0.1
    mask, group = torch.ones(4, 3, dtype=torch.bool), torch.zeros(4, dtype=torch.int64)

    def call(lp, lr, m, gr):
        x = lp.clone().requires_grad_()
        if fit == "cv-crossfit":
            out = klest.kl_estimate(
                x, lr, mask=m, estimator="cv", alpha="crossfit", group=gr, reduction="per-sequence"
            )
            return out.detach(), torch.autograd.grad(out.sum(), x)[0]
        out = klest.kl_penalty(x, lr, mask=m, grad="score", baseline="loo-fitted", group=gr)
        return out.detach(), torch.autograd.grad(out, x)[0]

    def with_empty(x, fill):  # an empty row at index 1, garbage under its mask
        return torch.cat([x[:1], torch.full_like(x[:1], fill), x[1:]])

    value, grad = call(logp, logp_ref, mask, group)
    value2, grad2 = call(
        with_empty(logp, math.nan),
        with_empty(logp_ref, 5.0),
        with_empty(mask, False),
        with_empty(group, 0),
    )
    others = [0, 2, 3, 4]
    torch.testing.assert_close(value2[others] if value.ndim else value2, value, rtol=1e-14, atol=0)
    torch.testing.assert_close(grad2[others], grad, rtol=1e-14, atol=0)
    assert not grad2[1].any()


# -- kl_from_logits(labels=...) feeding kl_penalty -------------------------------------------------

SAMPLED_TOKEN_OPTIONS = [o for o in ACCEPTED if not o.reparameterized]


def from_labels(batch: Batch, o: Options, e: Extras, *, layout: str, garbage: bool = True):
    """The trainer's path: log-probs of the sampled tokens from ``kl_from_logits(labels=...)``
    (-100 at padding, garbage in the logits there), then ``kl_penalty`` on them with the mask
    ``labels != -100``. Returns the per-position KLs, the details, the penalty's Result (its
    gradient to ``d.logp`` and, through both paths, to the logits) and the inputs."""
    x = inputs(batch, layout=layout, garbage=garbage)
    arrange = (lambda t: t) if layout == "right" else (lambda t: to_left(t, batch))
    labels = arrange(torch.where(batch.mask(), batch.labels, -100))
    kl, d = klest.kl_from_logits(
        x.logits,
        x.logits_ref,
        labels=labels,
        direction=o.direction,
        reduction="none",
        return_details=True,
    )
    x = replace(x, logp=d.logp, logp_ref=d.logp_ref, mask=labels != -100)
    return kl.detach(), d, penalty(x, o, e), x


@given(
    batch=trainer_batches(),
    o=st.sampled_from(SAMPLED_TOKEN_OPTIONS),
    e=extras,
    layout=st.sampled_from(("left", "right")),
)
@settings(max_examples=EXAMPLES // 2, deadline=None)
def test_kl_from_logits_labels_feed_kl_penalty(batch, o, e, layout):
    """``labels`` with -100 at padding: the label log-probs and per-position KLs are the float64
    softmax's (written here) at the kept positions and 0 at the ignored ones; the penalty on them
    is sound (rules 1, 5, 6), agrees between layouts (rule 2) and with zeros in the ignored
    logits, bit for bit (rule 6)."""
    kl, d, r, x = from_labels(batch, o, e, layout=layout)
    assert_sound(r, x, batch.dtype, o.reduction, f"{o}")
    arrange = (lambda t: t) if layout == "right" else (lambda t: to_left(t, batch))
    rounded = [arrange(t).to(batch.dtype).double() for t in (batch.logits, batch.logits_ref)]
    lp, lq = (t.log_softmax(-1) for t in rounded)
    label = arrange(batch.labels).unsqueeze(-1)
    want_kl = (
        (lp.exp() * (lp - lq)).sum(-1)
        if o.direction == "pi||ref"
        else (lq.exp() * (lq - lp)).sum(-1)
    )
    for got, want, what in (
        (d.logp, lp.gather(-1, label).squeeze(-1), "logp"),
        (d.logp_ref, lq.gather(-1, label).squeeze(-1), "logp_ref"),
        (kl, want_kl, "per-position KL"),
    ):
        assert not bool(got.detach()[~x.mask].any()), f"{what} is not 0 at ignored labels"
        assert_close_up_to_rounding(
            got.detach()[x.mask], want[x.mask], batch.dtype, f"{what} vs float64 log_softmax"
        )
    other = "right" if layout == "left" else "left"
    *_, r_other, _ = from_labels(batch, o, e, layout=other)
    left, right = (r, r_other) if layout == "left" else (r_other, r)
    assert_results_close(unrolled(left, batch, o.reduction), right, batch.dtype, f"{o}")
    *_, clean, _ = from_labels(batch, o, e, layout=layout, garbage=False)
    assert_results_equal(r, clean, f"{o}")
