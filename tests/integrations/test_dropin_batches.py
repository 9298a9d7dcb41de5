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
surrogates) follow the sibling ``tests/test_trainer_batches.py``: ``1e3 u (1 + max|want|)``.

Examples: ``EXAMPLES`` (150) per drawn property, 40 for the verl actor loss; the file takes
about 60 s on one core (verl's import: 3 s).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
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

EXAMPLES = 150
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


@dataclass(frozen=True)
class PeerBatch:
    """One trainer batch: float64 logits of pi, ref and the behavior policy ``[B, T, V]``, the
    sampled tokens, row lengths, group ids, the garbage each masked position holds, the dtype."""

    logits: torch.Tensor
    logits_ref: torch.Tensor
    logits_old: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor
    group: torch.Tensor
    junk: torch.Tensor
    dtype: torch.dtype

    @property
    def mask(self) -> torch.Tensor:
        return torch.arange(self.labels.shape[1]) < self.lengths.unsqueeze(1)

    def log_probs(self, logits: torch.Tensor, *, garbage: bool) -> torch.Tensor:
        """log softmax(logits) at the labels, in the batch's dtype; the junk or 0 under the
        mask."""
        lp = logits.log_softmax(-1).gather(-1, self.labels.unsqueeze(-1)).squeeze(-1)
        fill = self.junk if garbage else torch.zeros_like(self.junk)
        return torch.where(self.mask, lp, fill).to(self.dtype)

    def full_logits(self, logits: torch.Tensor, *, garbage: bool) -> torch.Tensor:
        fill = self.junk if garbage else torch.zeros_like(self.junk)
        return torch.where(self.mask.unsqueeze(-1), logits, fill.unsqueeze(-1)).to(self.dtype)


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
    mask = batch.mask
    logits = leaf(batch.full_logits(batch.logits, garbage=garbage))
    if through_logits:
        clean = torch.where(mask.unsqueeze(-1), logits, 0.0)
        lp = clean.log_softmax(-1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
        fill = (batch.junk if garbage else torch.zeros_like(batch.junk)).to(batch.dtype)
        logp, x = torch.where(mask, lp, fill), logits
    else:
        logp = x = leaf(batch.log_probs(batch.logits, garbage=garbage))
    return Tensors(
        logp,
        batch.log_probs(batch.logits_ref, garbage=garbage),
        batch.log_probs(batch.logits_old, garbage=garbage),
        logits,
        batch.full_logits(batch.logits_ref, garbage=garbage),
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
    mask, dtype = batch.mask, batch.dtype
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


@given(batch=peer_batches(), c=calls(VERL_NAMES))
@settings(max_examples=EXAMPLES, deadline=None)
def test_verl_kl_penalty_on_drawn_batches(batch, c):
    """Properties 1, 2, 3, 5 for every name of verl's ``kl_penalty`` and every ``grad``; a
    ``"+"`` name with klest's gradient is refused (it chooses k2's gradient itself)."""
    if c.grad != "peer" and c.name.endswith("+"):
        x = tensors(batch, garbage=True, through_logits=c.grad == "rb")
        with pytest.raises(ValueError, match="chooses k2's gradient"):
            verl_dropin(batch, x, c, batch.mask)
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
@settings(max_examples=EXAMPLES, deadline=None)
def test_openrlhf_compute_approx_kl_on_drawn_batches(batch, c):
    """Properties 1, 2, 3, 5 for every estimator of OpenRLHF's ``compute_approx_kl``, with and
    without ``unbiased_gradient`` and ``log_probs_old``, and every ``grad``; float64 values
    also against this test's float64 formula (OpenRLHF itself computes in float32)."""
    if c.grad != "peer" and c.unbiased:
        x = tensors(batch, garbage=True, through_logits=c.grad == "rb")
        with pytest.raises(ValueError, match="unbiased_gradient=True chooses"):
            openrlhf_dropin(batch, x, c, batch.mask)
        return
    check_drawn_call(batch, c, openrlhf_peer())
    if batch.dtype == torch.float64:
        x = tensors(batch, garbage=True, through_logits=False)
        out = quietly(lambda: openrlhf_dropin(batch, x, c, batch.mask))
        delta = x.logp.detach() - x.logp_ref
        want = torch.where(batch.mask, openrlhf_formula(delta, c.name), 0.0)
        bound = rounding_scale(torch.where(batch.mask, delta, 0.0))
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
    mask, dtype = batch.mask, batch.dtype
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
