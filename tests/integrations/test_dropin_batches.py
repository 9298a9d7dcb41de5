"""Property tests: the trainer drop-ins against the real verl and OpenRLHF, on drawn batches.

Batches are drawn by hypothesis (derandomized: ``tests/conftest.py``) as verl and OpenRLHF
make them: response log-probs ``[B, T]`` (1 to 8 rows, 1 to 8 tokens) right-padded, each row
0 (empty) to T tokens long (one-token rows and all-empty batches included), the padding holding
0 (the peers' convention) or garbage (NaN, +-inf, 5.0) under a mask; bf16, float32 or float64;
group ids as GRPO's ``uid``s (n samples per prompt, or groups of 1 to 4 samples, groups of one
included, in any order); with or without old (behavior) log-probs; pi's and ref's logits along
the samples for ``grad="rb"`` and ``"full"``. The log-probs are gathered from real softmaxes;
ref's logits are a perturbation of pi's of size up to 6, so k3's clips (log-ratio at 20, value
at 10) and OpenRLHF's (value at 10, log-ratio at -10, weight at 10) are reached.

Checked, for every estimator name of each drop-in and every ``grad``:

1. ``grad="peer"``: value and gradient equal the real peer's function (verl 0.9.1's
   ``kl_penalty``, OpenRLHF 0.11.2's ``compute_approx_kl``) on the same batch, zero-padded; the
   real one is run in float64 on the same values (tight) and in the batch's own dtype (the
   peer's rounding). verl's ``"full"`` raises ``NotImplementedError``: its value is this test's
   float64 KL from the logits.
2. klest's gradients (``"cumulative"``, ``"score"``, ``"rb"``; baselines none / loo / mean over
   the groups; on- and off-policy): the value is the peer's, the gradient that of
   ``klest.kl_penalty(..., reduction="none")`` aggregated the same way (a drawn ``agg_loss``
   mode), and, where ``tests/integrations/_peer_reference.py`` has one (no baseline or loo
   on-policy, no baseline off-policy, rb on-policy), that of its float64 loop surrogate.
3. Garbage under the mask gives, bit for bit, the value and gradient of zeros there; the
   gradient under the mask is exactly 0; zero padding without a mask (the peers' call) gives
   the masked values.
4. ``agg_loss`` in every mode, with local or global (data-parallel) counts, equals the real
   verl's; on a batch with no valid token verl's modes that divide by a local count give NaN
   and klest's 0 with a zero gradient (the documented difference), ``"token-sum"`` 0 in both.
5. Nothing crashes, and every value and gradient is finite.
6. ``install()``: verl's real actor loss (``ppo_loss``) then gives verl's value and the gradient
   of ``kl_penalty(..., grad=...)`` through verl's own aggregation; uninstalled, verl's own.
   OpenRLHF's actor imports vLLM, so its ``install()`` is run on a stand-in of the actor module
   holding the real ``compute_approx_kl``, called as the actor calls it.

The ``hf`` helpers get batches drawn like ``generate``'s output (left-padded prompts, G samples
per prompt, pad = eos or not, eos sampled inside completions, pad sampled inside completions,
several eos ids): :func:`generated_attention_mask`, :func:`completion_batch` (left and right
layouts, garbage in the logits nothing reads), :func:`group_ids` and
:func:`group_ids_from_prompts` against slow per-row loops written here.

Nothing here is statistical: every comparison is an equality, exact or up to rounding. The
rounding bounds (:func:`rounding_scale`): the drop-ins compute in float32 (float64 for float64
inputs), the float64 references nearly exactly; a per-token value or gradient computed from
log-ratio ``d`` at unit roundoff ``u`` is off by at most a few ``u (1 + |d|) (1 + |d| + e^x)``
(``x = -d`` clipped, k3's exponential; ``e^x`` capped at 20, past which both sides clip k3 to
10 exactly), and OpenRLHF's straight-through ``v + s - s`` with ``s = w d^2 / 2`` adds
``u 10 d^2``; ``8 u`` times that is the tolerance. Sums of up to 64 terms (aggregation,
surrogates) follow the sibling ``tests/sampled/test_trainer_batches.py``: ``1e3 u (1 + max|want|)``.

Examples: ``EXAMPLES`` (600) per drawn property (each drop-in's three edge batches, every
``grad``, as explicit examples besides), 200 for verl's ``"full"``, 150 for each
``install()``; the file takes about 15 s on one core (verl's import: 3 s of it).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import get_args

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import klest
from klest.integrations import hf, openrlhf, verl
from klest.integrations._peer_gradient import PeerGrad
from klest.testbeds import make_generator
from tests.integrations._peer_reference import (
    rb_surrogate_reference,
    real_function,
    real_module,
    stand_in_module,
    surrogate_reference,
)
from tests.integrations.test_openrlhf import openrlhf_formula
from tests.integrations.test_verl import _real_ppo_loss_and_gradient
from tests.sampled.test_trainer_batches import Batch

EXAMPLES = 600
MAX_ROWS = 8
MAX_T = 8
DTYPES = (torch.bfloat16, torch.float32, torch.float64)
GARBAGE = (math.nan, math.inf, -math.inf, 5.0)
GRADS = get_args(PeerGrad)
KLEST_GRADS = tuple(g for g in GRADS if g != "peer")
VERL_NAMES = tuple(n for n in get_args(verl.KLPenaltyName) if not n.startswith("full"))
OPENRLHF_NAMES = get_args(openrlhf.KLEstimatorName)
AGG_MODES = get_args(verl.LossAggMode)
BASELINES = (None, "loo", "mean")


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- batches -----------------------------------------------------------------------------------


PeerBatch = Batch
"""A trainer batch (``tests/sampled/test_trainer_batches.py``'s, ``[B, T]`` here): float64 logits of
pi, ref and the behavior policy, the sampled tokens, row lengths, group ids, the garbage each
masked position holds, the dtype."""


def log_probs(batch: PeerBatch, logits: torch.Tensor, *, garbage: bool) -> torch.Tensor:
    """log softmax(logits) at the labels, in the batch's dtype; the junk or 0 under the mask."""
    lp = batch.logp(logits)
    fill = batch.junk if garbage else torch.zeros_like(batch.junk)
    return torch.where(batch.mask(), lp, fill).to(batch.dtype)


def full_logits(batch: PeerBatch, logits: torch.Tensor, *, garbage: bool) -> torch.Tensor:
    fill = batch.junk if garbage else torch.zeros_like(batch.junk)
    return torch.where(batch.mask().unsqueeze(-1), logits, fill.unsqueeze(-1)).to(batch.dtype)


@st.composite
def group_ids(draw, rows_max: int) -> list[int]:
    """GRPO's uids: n samples per prompt, or groups of 1 to 4; arbitrary distinct ids."""
    if draw(st.booleans()):
        n = draw(st.sampled_from((4, 1, 2, 3)))
        sizes = [n] * draw(st.sampled_from(range(rows_max // n, 0, -1)))
    else:
        sizes = draw(st.lists(st.integers(1, 4), min_size=2, max_size=rows_max))
    ids = draw(st.lists(st.integers(-(2**40), 2**40), min_size=len(sizes), max_size=len(sizes),
                        unique=True))  # fmt: skip
    rows = [i for i, size in zip(ids, sizes, strict=True) for _ in range(size)][:rows_max]
    return draw(st.permutations(rows)) if draw(st.booleans()) else rows


@st.composite
def peer_batches(draw, *, min_length: int = 0) -> PeerBatch:
    """A batch as verl / OpenRLHF make it (module docstring)."""
    group = draw(group_ids(MAX_ROWS))
    b = len(group)
    # sampled_from draws its first items most often (and shrinks to them): full-width batches
    t = draw(st.sampled_from((MAX_T, 1, 4, 2, 3, 5, 6, 7)))
    v = draw(st.integers(2, 5))
    lengths = draw(st.lists(st.integers(min_length, t), min_size=b, max_size=b))
    if min_length == 0 and draw(st.sampled_from([False] * 9 + [True])):
        lengths = [0] * b  # a batch with no valid token
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from((0.3, 1.0, 3.0)))
    distance = draw(st.sampled_from((0.05, 0.5, 2.0, 6.0)))
    old_distance = draw(st.sampled_from((0.05, 0.5, 3.0)))
    garbage = draw(st.sampled_from((*GARBAGE, "mixed")))
    gen = make_generator(draw(st.integers(0, 2**31 - 1)))

    def noise(size: float) -> torch.Tensor:
        return size * torch.randn(b, t, v, generator=gen, dtype=torch.float64)

    z = noise(scale)
    # ref and the behavior policy far from pi at times (the clips)
    y, w = z + noise(distance), z + noise(old_distance)
    labels = torch.randint(0, v, (b, t), generator=gen)
    if garbage == "mixed":
        index = torch.randint(0, len(GARBAGE), (b, t), generator=gen)
        junk = torch.tensor(GARBAGE, dtype=torch.float64)[index]
    else:
        junk = torch.full((b, t), garbage, dtype=torch.float64)
    return PeerBatch(z, y, w, labels, torch.tensor(lengths), torch.tensor(group), junk, dtype)


def fixed_batch(lengths: list[int], t: int, dtype: torch.dtype, *, seed: int = 0) -> PeerBatch:
    """A batch of given row lengths (one group per row, NaN under the mask), for the edge
    cases each drawn test also runs as an explicit example."""
    gen = make_generator(seed)
    b = len(lengths)
    z, y, w = (torch.randn(b, t, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    labels = torch.randint(0, 3, (b, t), generator=gen)
    junk = torch.full((b, t), math.nan, dtype=torch.float64)
    return PeerBatch(z, y, w, labels, torch.tensor(lengths), torch.arange(b), junk, dtype)


# -- comparisons -------------------------------------------------------------------------------


def rounding_scale(delta: torch.Tensor, *, straight_through: bool = False) -> torch.Tensor:
    """The per-token scale of the rounding bound (module docstring), float64."""
    d = delta.double().abs()
    e = torch.exp((-delta.double()).clamp(-20, 20)).clamp(max=20)
    scale = (1 + d) * (1 + d + e)
    return scale + 10 * d * d if straight_through else scale


def assert_close(got, want, tol, what: str) -> None:
    """``|got - want| <= tol`` elementwise (``tol`` a number or a tensor), no NaN anywhere."""
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{what}: shapes {tuple(got.shape)} vs {tuple(want.shape)}"
    assert not bool(torch.isnan(got).any() or torch.isnan(want).any()), f"{what}: NaN"
    diff = (got - want).abs()
    bad = diff > torch.as_tensor(tol, dtype=torch.float64)
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} of {diff.numel()} entries off; largest |diff| "
        f"{float(diff.max()):.3g}: got {got[bad][:4].tolist()}, want {want[bad][:4].tolist()}"
    )


def assert_sums_close(got, want, dtype: torch.dtype, what: str) -> None:
    """Up to the rounding of reordered sums: ``1e3 u (1 + max|want|)``."""
    scale = 1 + (float(want.detach().abs().max()) if want.numel() else 0.0)
    assert_close(got, want, 1e3 * eps(dtype) * scale, what)


def assert_finite(*tensors: torch.Tensor, what: str) -> None:
    for x in tensors:
        assert bool(torch.isfinite(x).all()), f"{what}: not finite: {x}"


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if not loss.requires_grad:
        return torch.zeros_like(x)
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def quietly(fn):
    """``fn()`` with warnings off (klest warns about biased gradients and small groups)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


@dataclass(frozen=True)
class Call:
    """One drop-in call's options: the estimator name, ``grad``, the baseline, off-policy (old
    log-probs passed), OpenRLHF's ``unbiased_gradient``, and the ``agg_loss`` mode that
    aggregates the per-token values for the gradient."""

    name: str
    grad: str
    baseline: str | None
    off_policy: bool
    unbiased: bool
    agg: str


def calls(names, *, unbiased: bool = False) -> st.SearchStrategy[Call]:
    return st.builds(
        Call,
        st.sampled_from(names),
        st.sampled_from(GRADS),
        st.sampled_from(BASELINES),
        st.booleans(),
        st.booleans() if unbiased else st.just(False),
        st.sampled_from(AGG_MODES),
    )


@dataclass
class Tensors:
    """A batch's tensors for one call: ``leaf`` requires grad and is ``logp`` itself, or (for
    ``"rb"``) the logits ``logp`` is the log-softmax of at the labels."""

    logp: torch.Tensor
    logp_ref: torch.Tensor
    logp_old: torch.Tensor
    logits: torch.Tensor
    logits_ref: torch.Tensor
    leaf: torch.Tensor


def tensors(batch: PeerBatch, *, garbage: bool, through_logits: bool) -> Tensors:
    """``through_logits``: ``logp`` computed from the leaf ``logits`` (masked positions set to
    0 before the softmax, as a trainer's padding is), so that ``"rb"``'s two gradient paths,
    through the sampled tokens' log-probs and through the logits, meet in one leaf."""
    mask = batch.mask()
    logits = leaf(full_logits(batch, batch.logits, garbage=garbage))
    if through_logits:
        clean = torch.where(mask.unsqueeze(-1), logits, 0.0)
        lp = clean.log_softmax(-1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
        fill = (batch.junk if garbage else torch.zeros_like(batch.junk)).to(batch.dtype)
        logp, x = torch.where(mask, lp, fill), logits
    else:
        logp = x = leaf(log_probs(batch, batch.logits, garbage=garbage))
    return Tensors(
        logp,
        log_probs(batch, batch.logits_ref, garbage=garbage),
        log_probs(batch, batch.logits_behavior, garbage=garbage),
        logits,
        full_logits(batch, batch.logits_ref, garbage=garbage),
        x,
    )


# klest's estimator of the same value as each peer name (the gradient does not depend on it)
KLEST_ESTIMATOR = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2",
                   "low_var_kl": "k3", "k3": "k3"}  # fmt: skip


def klest_options(batch: PeerBatch, x: Tensors, c: Call) -> dict:
    """The options of klest's gradients that a drop-in passes on to ``klest.kl_penalty``."""
    rb = c.grad == "rb"
    return dict(
        baseline=c.baseline,
        group=batch.group if c.baseline else None,
        logp_behavior=x.logp_old if c.off_policy else None,
        logits=x.logits if rb else None,
        logits_ref=x.logits_ref if rb else None,
    )


@dataclass(frozen=True)
class Peer:
    """A drop-in and the real peer function it stands for.

    ``dropin(batch, x, c, mask)``: the drop-in (mask None: zero padding, the peer's call);
    ``real(lp, lr, lo, c)``: the real peer's value at zero-padded log-probs, with graph;
    ``precision``: the dtype the real peer computes in for an input dtype; ``straight``: the
    value may be a straight-through ``v + s - s`` (its rounding, module docstring)."""

    dropin: object
    real: object
    precision: object
    straight: object


def check_drawn_call(batch: PeerBatch, c: Call, peer: Peer) -> None:
    """Properties 1, 2, 3, 5 of one drawn call of a drop-in (module docstring)."""
    mask, dtype = batch.mask(), batch.dtype
    through_logits = c.grad == "rb"

    def run(x: Tensors, m) -> tuple[torch.Tensor, torch.Tensor]:
        out = quietly(lambda: peer.dropin(batch, x, c, m))
        return out, grad_of(verl.agg_loss(out, mask, c.agg), x.leaf)

    x = tensors(batch, garbage=True, through_logits=through_logits)
    out, g = run(x, mask)
    what = f"{c} {dtype}"
    assert out.dtype == compute_dtype(dtype), f"{what}: value dtype {out.dtype}"
    assert_finite(out, g, what=what)
    assert not bool(out[~mask].any()), f"{what}: a masked value is not 0"
    under_mask = ~mask.unsqueeze(-1).expand_as(g) if g.ndim == 3 else ~mask
    assert not bool(g[under_mask].any()), f"{what}: a gradient under the mask is not 0"

    # 3: garbage under the mask is never read, bit for bit
    clean = tensors(batch, garbage=False, through_logits=through_logits)
    out_clean, g_clean = run(clean, mask)
    assert torch.equal(out, out_clean), f"{what}: garbage under the mask changed the value"
    assert torch.equal(g, g_clean), f"{what}: garbage under the mask changed the gradient"

    # 1 and 2, values: the real peer's on zero padding, run in float64 on the same values and
    # in the batch's own dtype
    lp, lr, lo = (t.detach() for t in (clean.logp, clean.logp_ref, clean.logp_old))
    bound = rounding_scale(lp.double() - lr.double(), straight_through=peer.straight(c))
    u64 = max(eps(compute_dtype(dtype)), eps(peer.precision(torch.float64)))
    want = peer.real(lp.double(), lr.double(), lo.double(), c).detach()
    assert_close(out, want, 8 * u64 * bound, f"{what}: value vs the peer's in float64")
    own = peer.real(lp, lr, lo, c).detach()
    u_own = max(eps(compute_dtype(dtype)), eps(peer.precision(dtype)))
    assert_close(out, own, 8 * u_own * bound, f"{what}: value vs the peer's in {dtype}")
    if not through_logits:  # the peer's call: zero padding, no mask
        bare = tensors(batch, garbage=False, through_logits=False)
        out_bare = quietly(lambda: peer.dropin(batch, bare, c, None))
        assert torch.equal(out_bare, out), f"{what}: zero padding without a mask"

    if c.grad == "peer":  # 1, gradient: the real peer's, by autodiff in float64
        x64 = leaf(lp.double())
        value64 = torch.where(mask, peer.real(x64, lr.double(), lo.double(), c), 0.0)
        g64 = grad_of(verl.agg_loss(value64, mask, c.agg), x64)
        # the aggregation's factors are at most 1: the per-token bound holds
        assert_close(g, g64, 8 * max(u64, eps(dtype)) * bound, f"{what}: peer gradient")
        return

    # 2, gradient: klest.kl_penalty's (per token, klest's estimator of the same value),
    # aggregated the same way ...
    k = tensors(batch, garbage=True, through_logits=through_logits)
    estimator = KLEST_ESTIMATOR.get(c.name.removesuffix("+"), "k3")
    per_token = quietly(
        lambda: klest.kl_penalty(k.logp, k.logp_ref, estimator=estimator, grad=c.grad,
                                 mask=mask, reduction="none", **klest_options(batch, k, c))
    )  # fmt: skip
    g_klest = grad_of(verl.agg_loss(per_token, mask, c.agg), k.leaf)
    assert_sums_close(g, g_klest, dtype, f"{what}: gradient vs klest.kl_penalty's")
    # ... and the float64 loop surrogates where they apply (summed over tokens)
    clean = tensors(batch, garbage=False, through_logits=through_logits)  # a fresh graph
    total = quietly(lambda: peer.dropin(batch, clean, c, mask)).sum()
    got = grad_of(total, clean.leaf)
    if through_logits and not c.off_policy and c.baseline is None:
        z64 = leaf(clean.logits.detach().double())
        ref = rb_surrogate_reference(z64, clean.logits_ref.double(), batch.labels, mask)
        assert_sums_close(got, grad_of(ref.sum(), z64), dtype, f"{what}: vs the rb loop")
    elif not through_logits and c.baseline in (None, "loo") and not (c.baseline and c.off_policy):
        lp64 = leaf(lp.double())
        ref = surrogate_reference(
            lp64,
            lr.double(),
            mask,
            c.grad,
            logp_behavior=lo.double() if c.off_policy else None,
            loo_group=batch.group.tolist() if c.baseline else None,
        )
        assert_sums_close(got, grad_of(ref.sum(), lp64), dtype, f"{what}: vs the loop surrogate")


# -- verl's kl_penalty -------------------------------------------------------------------------


def verl_dropin(batch: PeerBatch, x: Tensors, c: Call, mask) -> torch.Tensor:
    options = {} if c.grad == "peer" else klest_options(batch, x, c)
    return verl.kl_penalty(x.logp, x.logp_ref, c.name, grad=c.grad, mask=mask, **options)


def verl_peer() -> Peer:
    real = real_function("verl.trainer.ppo.core_algos", "kl_penalty")
    return Peer(
        dropin=verl_dropin,
        real=lambda lp, lr, lo, c: real(lp, lr, c.name),
        precision=lambda dtype: dtype,  # verl computes in the inputs' dtype
        straight=lambda c: False,  # verl's "+": b - b is exactly 0
    )


EDGE_BATCHES = [  # no valid token; one token alone in its group; empty and one-token rows
    fixed_batch([0, 0, 0], 2, torch.bfloat16),
    fixed_batch([1], 1, torch.float32),
    fixed_batch([1, 0, 2, 1], 3, torch.float64),
]


def edge_examples(names):
    """Every edge batch with every ``grad`` (loo baseline, off-policy) as explicit examples."""

    def decorate(test):
        for batch in EDGE_BATCHES:
            for grad in GRADS:
                c = Call(names[-1], grad, None if grad == "peer" else "loo", True, False,
                         "seq-mean-token-sum")  # fmt: skip
                test = example(batch=batch, c=c)(test)
        return test

    return decorate


@given(batch=peer_batches(), c=calls(VERL_NAMES))
@edge_examples(VERL_NAMES)
@settings(max_examples=EXAMPLES, deadline=None)
def test_verl_kl_penalty_on_drawn_batches(batch, c):
    """Properties 1, 2, 3, 5 for every name of verl's ``kl_penalty`` and every ``grad``; a
    ``"+"`` name with klest's gradient is refused (it chooses k2's gradient itself)."""
    if c.grad != "peer" and c.name.endswith("+"):
        x = tensors(batch, garbage=True, through_logits=c.grad == "rb")
        with pytest.raises(ValueError, match="chooses k2's gradient"):
            verl_dropin(batch, x, c, batch.mask())
        return
    check_drawn_call(batch, c, verl_peer())


# -- OpenRLHF's compute_approx_kl --------------------------------------------------------------


def openrlhf_dropin(batch: PeerBatch, x: Tensors, c: Call, mask) -> torch.Tensor:
    old = x.logp_old if c.off_policy else None
    options = {} if c.grad == "peer" else klest_options(batch, x, c)
    options.pop("logp_behavior", None)  # OpenRLHF's log_probs_old is the behavior policy
    return openrlhf.compute_approx_kl(
        x.logp, x.logp_ref, old, c.name, c.unbiased, action_mask=mask, grad=c.grad, **options
    )


def openrlhf_peer() -> Peer:
    real = real_function("openrlhf.models.utils", "compute_approx_kl", file_only=True)

    def value(lp, lr, lo, c):
        old = lo if c.off_policy else None
        return real(lp, lr, old, kl_estimator=c.name, unbiased_gradient=c.unbiased)

    return Peer(
        dropin=openrlhf_dropin,
        real=value,
        precision=lambda dtype: torch.float32,  # OpenRLHF computes in float32 (``.float()``)
        straight=lambda c: c.unbiased,
    )


@given(batch=peer_batches(), c=calls(OPENRLHF_NAMES, unbiased=True))
@edge_examples(OPENRLHF_NAMES)
@settings(max_examples=EXAMPLES, deadline=None)
def test_openrlhf_compute_approx_kl_on_drawn_batches(batch, c):
    """Properties 1, 2, 3, 5 for every estimator of OpenRLHF's ``compute_approx_kl``, with and
    without ``unbiased_gradient`` and ``log_probs_old``, and every ``grad``; float64 values
    also against this test's float64 formula (OpenRLHF itself computes in float32)."""
    if c.grad != "peer" and c.unbiased:
        x = tensors(batch, garbage=True, through_logits=c.grad == "rb")
        with pytest.raises(ValueError, match="unbiased_gradient=True chooses"):
            openrlhf_dropin(batch, x, c, batch.mask())
        return
    check_drawn_call(batch, c, openrlhf_peer())
    if batch.dtype == torch.float64:
        x = tensors(batch, garbage=True, through_logits=False)
        out = quietly(lambda: openrlhf_dropin(batch, x, c, batch.mask()))
        delta = x.logp.detach() - x.logp_ref
        want = torch.where(batch.mask(), openrlhf_formula(delta, c.name), 0.0)
        bound = rounding_scale(torch.where(batch.mask(), delta, 0.0))
        assert_close(out, want, 8 * eps(torch.float64) * bound, f"{c}: vs the float64 formula")


# -- verl's "full" -----------------------------------------------------------------------------


@given(batch=peer_batches(), c=calls(["full"]))
@settings(max_examples=EXAMPLES // 3, deadline=None)
def test_verl_full_on_drawn_batches(batch, c):
    """verl 0.9.1 names ``"full"`` and raises ``NotImplementedError``; klest's value is the
    exact per-position KL(pi_t||ref_t) (this test's float64 one from the logits), 0 where
    masked or where the label is -100; ``"peer"``'s gradient its autodiff, klest's gradients
    those of ``klest.kl_penalty(estimator="rb", ...)`` on the labels' log-probs."""
    real = real_function("verl.trainer.ppo.core_algos", "kl_penalty")
    mask, dtype = batch.mask(), batch.dtype
    with pytest.raises(NotImplementedError):
        real(batch.logits, batch.logits_ref, "full")
    x = tensors(batch, garbage=True, through_logits=False)
    clean = tensors(batch, garbage=False, through_logits=False)
    labels = torch.where(mask, batch.labels, -100)

    def run(t: Tensors, m, lab):
        options = {}
        if c.grad != "peer":
            options = klest_options(batch, t, c)
            options.update(logits=None, logits_ref=None, labels=lab)
        out = quietly(lambda: verl.kl_penalty(t.logits, t.logits_ref, "full", grad=c.grad,
                                              mask=m, **options))  # fmt: skip
        return out, grad_of(verl.agg_loss(out, mask, c.agg), t.logits)

    out, g = run(x, mask, batch.labels)
    what = f"{c} {dtype}"
    assert_finite(out, g, what=what)
    out_clean, g_clean = run(clean, mask, batch.labels)
    assert torch.equal(out, out_clean) and torch.equal(g, g_clean), f"{what}: garbage read"
    if c.grad != "peer":  # labels -100 at padding, no mask: the same
        out_labels, g_labels = run(x, None, labels)
        assert torch.equal(out_labels, out) and torch.equal(g_labels, g), f"{what}: labels"
    z64 = leaf(clean.logits.detach().double())
    la, lb = z64.log_softmax(-1), clean.logits_ref.double().log_softmax(-1)
    kl = torch.where(mask, (la.exp() * (la - lb)).sum(-1), 0.0)
    scale = 1 + float(kl.detach().abs().max()) if kl.numel() else 1.0
    assert_close(out, kl, 64 * eps(compute_dtype(dtype)) * scale, f"{what}: value")
    assert not bool(g[~mask.unsqueeze(-1).expand_as(g)].any()), f"{what}: gradient under mask"
    if c.grad == "peer":
        g64 = grad_of(verl.agg_loss(kl, mask, c.agg), z64)
        assert_sums_close(g, g64, dtype, f"{what}: peer gradient")
        return
    k = tensors(batch, garbage=False, through_logits=True)
    options = klest_options(batch, k, c)
    options.update(logits=k.logits, logits_ref=k.logits_ref)
    per_token = quietly(
        lambda: klest.kl_penalty(k.logp, k.logp_ref, estimator="rb", grad=c.grad, mask=mask,
                                 reduction="none", **options)
    )  # fmt: skip
    g_klest = grad_of(verl.agg_loss(per_token, mask, c.agg), k.leaf)
    assert_sums_close(g, g_klest, dtype, f"{what}: gradient vs klest.kl_penalty's")


# -- verl's agg_loss ---------------------------------------------------------------------------


@st.composite
def aggregations(draw) -> dict:
    """``agg_loss``'s options: a mode, and local counts or data parallelism's global counts (at
    least the local ones; 0 where the whole global batch has no valid token)."""
    mode = draw(st.sampled_from(AGG_MODES))
    options: dict = {"loss_agg_mode": mode}
    if draw(st.booleans()):
        options["dp_size"] = draw(st.sampled_from((2, 4)))
        options["extra"] = draw(st.sampled_from((0, 1, 7)))
        options["as_tensor"] = draw(st.booleans())
    if mode.endswith("-norm") and draw(st.booleans()):
        options["loss_scale_factor"] = draw(st.sampled_from((1, 3, 64)))
    return options


def agg_arguments(options: dict, mask: torch.Tensor) -> dict:
    """``agg_loss``'s keyword arguments for ``options`` on a batch of mask ``mask``."""
    kwargs = {k: v for k, v in options.items() if k not in ("extra", "as_tensor")}
    if "dp_size" in options:
        tokens = int(mask.sum()) + options["extra"]
        rows = int(mask.any(-1).sum()) + options["extra"]
        convert = torch.tensor if options["as_tensor"] else int
        kwargs.update(batch_num_tokens=convert(tokens), global_batch_size=convert(rows))
    return kwargs


@given(
    batch=peer_batches(),
    options=aggregations(),
    mask_dtype=st.sampled_from((torch.bool, torch.int64, torch.float32)),
)
@example(  # no valid token in the global batch: counts of 0
    batch=fixed_batch([0, 0], 3, torch.float32),
    options={"loss_agg_mode": "token-mean", "dp_size": 2, "extra": 0, "as_tensor": True},
    mask_dtype=torch.bool,
)
@example(
    batch=fixed_batch([0], 1, torch.float64),
    options={"loss_agg_mode": "seq-mean-token-mean", "dp_size": 4, "extra": 0,
             "as_tensor": False},
    mask_dtype=torch.int64,
)  # fmt: skip
@settings(max_examples=EXAMPLES, deadline=None)
def test_agg_loss_equals_the_real_verls(batch, options, mask_dtype):
    """Property 4: every mode, local or global counts, bool / int / float masks; garbage under
    the mask read by neither value nor gradient; where the real verl gives NaN, the documented
    case (no valid token, a count of 0, a mode that divides by it) and klest's 0 with a zero
    gradient."""
    real = real_function("verl.trainer.ppo.core_algos", "agg_loss")
    mask, dtype = batch.mask(), batch.dtype
    m = mask.to(mask_dtype)
    kwargs = agg_arguments(options, mask)
    values = batch.logits[..., 0] * 10  # per-token losses of either sign
    mode = options["loss_agg_mode"]
    what = f"{options} {dtype} {mask_dtype}"

    def ours(fill: torch.Tensor):
        x = leaf(torch.where(mask, values, fill).to(dtype))
        loss = verl.agg_loss(x, m, **kwargs)
        return loss, grad_of(loss, x)

    loss, g = ours(batch.junk)
    loss_zero, g_zero = ours(torch.zeros_like(values))
    assert torch.equal(loss, loss_zero) and torch.equal(g, g_zero), f"{what}: garbage read"
    assert loss.dtype == dtype and loss.shape == (), f"{what}: {loss.dtype} {loss.shape}"
    assert_finite(loss, g, what=what)
    assert not bool(g[~mask].any()), f"{what}: gradient under the mask"

    x = leaf(torch.where(mask, values, 0.0).to(dtype))
    want = real(x, m, **kwargs)
    if bool(torch.isnan(want)):  # verl's 0 / 0
        count = kwargs.get("batch_num_tokens" if mode == "token-mean" else "global_batch_size")
        count = int(mask.sum() if mode == "token-mean" else mask.any(-1).sum()) if count is None \
            else int(count)  # fmt: skip
        assert mode != "token-sum" and count == 0 and not bool(mask.any()), f"{what}: NaN"
        assert float(loss.detach()) == 0.0 and not bool(g.any()), f"{what}: klest's is not 0"
        return
    g_want = grad_of(want, x)
    scale = float(real(x.detach().abs().double(), m, **kwargs))
    # verl divides "seq-mean-token-mean"'s rows by n + 1e-8, klest by n
    tol = (8 * eps(dtype) + 2e-8) * (1 + scale)
    assert_close(loss, want, tol, f"{what}: value")
    g_scale = 1 + float(g_want.abs().max()) if g_want.numel() else 1.0
    assert_close(g, g_want, (8 * eps(dtype) + 2e-8) * g_scale, f"{what}: gradient")


# -- install() ---------------------------------------------------------------------------------


@given(
    batch=peer_batches(min_length=1),
    c=calls(VERL_NAMES).filter(lambda c: c.grad in ("cumulative", "score")),
)
@settings(max_examples=EXAMPLES // 4, deadline=None)
def test_install_into_the_real_verls_actor_loss(batch, c):
    """Property 6: with ``install(grad=..., baseline=...)`` verl's real ``ppo_loss`` (KL loss
    ``kl_loss_type`` = the drawn name, ``loss_agg_mode`` the drawn mode, verl's layout: every
    row has a token, zero padding) gives verl's value and the gradient of klest's drop-in (no
    mask, as installed: with a baseline the padding counts in its means, as ``install``'s
    docstring says) through verl's real ``agg_loss``; a ``"+"`` name is refused; after
    ``uninstall()`` it is verl's own again."""
    losses = real_module("verl.workers.utils.losses")
    real_kl = real_function("verl.trainer.ppo.core_algos", "kl_penalty")
    real_agg = real_function("verl.trainer.ppo.core_algos", "agg_loss")
    mask, dtype = batch.mask(), batch.dtype
    lp = log_probs(batch, batch.logits, garbage=False)
    lr = log_probs(batch, batch.logits_ref, garbage=False)
    original = losses.kl_penalty

    def ppo_loss():
        x = leaf(lp)
        return _real_ppo_loss_and_gradient(
            losses, x, lr, mask, kl_loss_type=c.name, loss_agg_mode=c.agg
        )

    def through_verls_agg(kl_of) -> tuple[torch.Tensor, torch.Tensor]:
        x = leaf(lp)
        loss = real_agg(kl_of(x), mask, c.agg)
        return loss.detach(), torch.where(mask, grad_of(loss, x), 0.0)

    what = f"{c} {dtype}"
    with verl.install(grad=c.grad, baseline=c.baseline) as installed:
        assert losses.kl_penalty is installed.replacement
        if c.name.endswith("+"):
            with pytest.raises(ValueError, match="chooses k2's gradient"):
                ppo_loss()
            return
        value, g = quietly(ppo_loss)
    assert losses.kl_penalty is original, f"{what}: not restored"
    want, _ = through_verls_agg(lambda x: real_kl(x.double(), lr.double(), c.name))
    bound = float(rounding_scale(lp.double() - lr.double()).max())
    # ppo_loss adds the KL loss into the policy loss, of the log-probs' dtype: one rounding
    tol = 8 * eps(compute_dtype(dtype)) * bound + eps(dtype) * float(want.abs())
    assert_close(value, want, tol, f"{what}: value")
    _, g_want = through_verls_agg(
        lambda x: quietly(lambda: verl.kl_penalty(x, lr, c.name, grad=c.grad, baseline=c.baseline))
    )
    assert_sums_close(g, g_want, dtype, f"{what}: installed gradient")
    _, g_verl = ppo_loss()
    _, g_verl_want = through_verls_agg(lambda x: real_kl(x, lr, c.name))
    assert_sums_close(g_verl, g_verl_want, dtype, f"{what}: verl's gradient after uninstall")


@given(
    batch=peer_batches(),
    c=calls(OPENRLHF_NAMES).filter(lambda c: c.grad in ("cumulative", "score")),
)
@settings(max_examples=EXAMPLES // 4, deadline=None)
def test_install_into_openrlhfs_actor_module(batch, c):
    """Property 6 for OpenRLHF: its actor module imports vLLM, so ``install()`` rebinds
    ``compute_approx_kl`` in a stand-in of that module holding the real function, called as the
    actor calls it (``test_openrlhf.py`` reads the real actor's calls): OpenRLHF's value,
    klest's gradient (``log_probs_old`` the sampling policy, zero padding, no mask), OpenRLHF's
    ``unbiased_gradient`` refused; after ``uninstall()`` the real function is back."""
    real = real_function("openrlhf.models.utils", "compute_approx_kl", file_only=True)
    with pytest.MonkeyPatch.context() as patch:
        actor = stand_in_module(patch, "openrlhf.trainer.ray.ppo_actor", compute_approx_kl=real)
        check_openrlhf_install(batch, c, actor, real)


def check_openrlhf_install(batch: PeerBatch, c: Call, actor, real) -> None:
    mask, dtype = batch.mask(), batch.dtype
    lp = log_probs(batch, batch.logits, garbage=False)
    lr = log_probs(batch, batch.logits_ref, garbage=False)
    lo = log_probs(batch, batch.logits_behavior, garbage=False) if c.off_policy else None
    what = f"{c} {dtype}"

    def actor_kl(x, unbiased=False):  # as OpenRLHF 0.11.2's actor calls it
        return actor.compute_approx_kl(
            x, lr, log_probs_old=lo, kl_estimator=c.name, unbiased_gradient=unbiased
        )

    def token_mean(kl_of):  # OpenRLHF's default aggregation: the mean over valid tokens
        x = leaf(lp)
        loss = verl.agg_loss(kl_of(x), mask, "token-mean")
        return kl_of(x.detach()), grad_of(loss, x)

    with openrlhf.install(grad=c.grad, baseline=c.baseline) as installed:
        assert actor.compute_approx_kl is installed.replacement
        with pytest.raises(ValueError, match="unbiased_gradient=True chooses"):
            actor_kl(leaf(lp), unbiased=True)
        value, g = quietly(lambda: token_mean(actor_kl))
    assert actor.compute_approx_kl is real, f"{what}: not restored"
    bound = rounding_scale(lp.double() - lr.double())
    assert_close(value, real(lp, lr, lo, c.name), 8 * eps(torch.float32) * bound, what)
    _, g_want = token_mean(
        lambda x: quietly(lambda: klest.kl_penalty(x, lr, estimator="k1", grad=c.grad,
                                                   baseline=c.baseline, logp_behavior=lo,
                                                   reduction="none"))
    )  # fmt: skip
    assert_sums_close(g, g_want, dtype, f"{what}: installed gradient")


# -- the hf helpers on generate-like outputs ---------------------------------------------------


@dataclass(frozen=True)
class Generated:
    """``generate``'s output for prompts left-padded to width P, G samples per prompt
    (consecutive rows), ``eos`` ids (the first is the one generate appends), ``pad`` id."""

    sequences: torch.Tensor
    prompt_mask: torch.Tensor  # [prompts, P]
    samples: int
    eos: tuple[int, ...]
    pad: int


@st.composite
def generated(draw) -> Generated:
    v = draw(st.integers(4, 8))
    eos = (1, 2) if draw(st.booleans()) else (1,)
    pad = 1 if draw(st.booleans()) else 0  # pad = eos (GPT-2's tokenizers), or its own id
    p = draw(st.integers(1, 5))
    c = draw(st.sampled_from((6, 0, 1, 2, 3, 4, 5)))
    g = draw(st.integers(1, 3))
    pool = draw(st.lists(st.lists(st.integers(0, v - 1), min_size=1, max_size=p), min_size=1,
                         max_size=3))  # fmt: skip
    prompts = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))  # duplicates
    sampled = [t for t in range(v) if t not in eos]  # pad among them when pad is not eos
    rows, prompt_mask = [], []
    for prompt in prompts:
        prompt_mask.append([0] * (p - len(prompt)) + [1] * len(prompt))
        for _ in range(g):
            k = draw(st.integers(0, c))
            body = draw(st.lists(st.sampled_from(sampled), min_size=k, max_size=k))
            if k < c:  # finished: eos, then padding
                body = body + [draw(st.sampled_from(eos))] + [pad] * (c - k - 1)
            rows.append([pad] * (p - len(prompt)) + prompt + body)
    return Generated(torch.tensor(rows), torch.tensor(prompt_mask), g, eos, pad)


def completion_lengths(gen: Generated) -> list[int]:
    """Per row, by a loop: the completion tokens up to and including the first eos."""
    p = gen.prompt_mask.shape[1]
    out = []
    for row in gen.sequences.tolist():
        n = 0
        for token in row[p:]:
            n += 1
            if token in gen.eos:
                break
        out.append(n)
    return out


@given(
    gen=generated(),
    per_prompt_mask=st.booleans(),
    dtype=st.sampled_from((torch.float32, torch.float64)),
    temperature=st.sampled_from((1.0, 0.7)),
    offset=st.integers(0, 5),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=EXAMPLES, deadline=None)
def test_hf_helpers_on_generate_outputs(gen, per_prompt_mask, dtype, temperature, offset, seed):
    """``generated_attention_mask`` is the prompt mask then each completion through its first
    eos (pad = eos or not, pad sampled inside a completion); ``completion_batch`` on it, in
    generate's left layout and re-laid right-padded, gives the tokens and
    ``log_softmax(logits[c - 1] / tau)`` of a per-row loop, never reading the logits no
    completion token was sampled from (NaN there); ``group_ids`` and ``group_ids_from_prompts``
    give the loop's groups."""
    seqs, p = gen.sequences, gen.prompt_mask.shape[1]
    b, width = seqs.shape
    full_prompt_mask = gen.prompt_mask.repeat_interleave(gen.samples, 0)
    mask = hf.generated_attention_mask(
        seqs,
        prompt_mask=gen.prompt_mask if per_prompt_mask else full_prompt_mask,
        eos_token_id=list(gen.eos) if len(gen.eos) > 1 else gen.eos[0],
    )
    lengths = completion_lengths(gen)
    want_mask = [
        full_prompt_mask[i].tolist() + [1] * n + [0] * (width - p - n)
        for i, n in enumerate(lengths)
    ]
    assert mask.tolist() == want_mask

    # logits: NaN at every column that predicts no completion token
    g = make_generator(seed)
    logits = torch.randn(b, width, seqs.max().item() + 3, generator=g, dtype=torch.float64)
    used = torch.zeros(b, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        used[i, p - 1 : p - 1 + n] = True
    logits = torch.where(used.unsqueeze(-1), logits, math.nan).to(dtype)
    t = max(lengths, default=0)
    want_tokens = [seqs[i, p : p + n].tolist() + [-100] * (t - n) for i, n in enumerate(lengths)]
    want_lp = torch.zeros(b, t, dtype=torch.float64)
    for i, n in enumerate(lengths):
        for j in range(n):
            z = logits[i, p - 1 + j].double() / temperature
            want_lp[i, j] = z.log_softmax(-1)[seqs[i, p + j]]
    want_m = [[True] * n + [False] * (t - n) for n in lengths]

    def check(batch: hf.CompletionBatch, what: str) -> None:
        assert batch.tokens.tolist() == want_tokens, what
        assert batch.mask.tolist() == want_m, what
        assert_sums_close(batch.log_probs, want_lp, dtype, what)

    left = hf.completion_batch(logits, seqs, attention_mask=mask, prompt_lengths=p,
                               temperature=temperature)  # fmt: skip
    check(left, "left (generate's layout)")
    # right-padded: each row's attended tokens first, the logits moved with their columns
    right_ids = torch.full_like(seqs, gen.pad)
    right_logits = torch.full_like(logits, math.nan)
    for i in range(b):
        cols = mask[i].nonzero().squeeze(1)
        right_ids[i, : len(cols)] = seqs[i, cols]
        right_logits[i, : len(cols)] = logits[i, cols]
    right_mask = torch.arange(width) < mask.sum(1, keepdim=True)
    right = hf.completion_batch(
        right_logits,
        right_ids,
        attention_mask=right_mask,
        prompt_lengths=full_prompt_mask.sum(1),
        temperature=temperature,
    )
    check(right, "right-padded")  # fmt: skip

    assert hf.group_ids(b, num_generations=gen.samples, offset=offset).tolist() == [
        (offset + i) // gen.samples for i in range(b)
    ]
    seen: dict[tuple[int, ...], int] = {}
    want_groups = []
    for i in range(b):
        key = tuple(seqs[i, :p][full_prompt_mask[i].bool()].tolist())
        want_groups.append(seen.setdefault(key, len(seen)))
    got = hf.group_ids_from_prompts(seqs[:, :p], prompt_mask=full_prompt_mask)
    assert got.tolist() == want_groups
