"""Property tests: the exact-from-logits functions on batches drawn like a trainer's.

The README ("Trainer batches: the rules every function follows", "Exact KL from logits")
promises, for :func:`klest.kl_from_logits`, the JSD / skew-KL / TV functions of
:mod:`klest.logits.divergences`, :func:`klest.kl_from_hidden` and
:func:`klest.kl_from_logits_vocab_parallel`: the exact per-position divergence of
``softmax(logits / T)`` and ``softmax(logits_ref / T)``, 0 and no gradient at masked or
ignored positions (which are not read: they may hold anything), every reduction, outputs in
float32 (float64 for float64 inputs) and gradients in the inputs' dtypes, ``-inf`` logits
outside the support and ``+inf`` (never NaN) where one distribution has mass the other lacks.

Hypothesis (derandomized: ``tests/conftest.py``) draws batches: leading shapes ``[N]``,
``[B, T]`` and ``[B, G, T]``; vocabularies of 1 to 40 tokens (V = 1 is legal: every divergence
is 0); fp32 / bf16 / fp16 / fp64; logits of scale 0.5 to 30, ref a perturbation of pi's or
unrelated; ``-inf`` holes inside valid rows of either model; per-row lengths from 0 (empty rows)
to T with left or right padding, all-excluded batches; positions left out by ``mask``, by label
``-100``, or by both; NaN, ``+-inf`` or ``finfo.max`` garbage in the left-out rows' logits;
temperatures; chunk sizes that split the rows unevenly; the stash on or off; details or not.

Every value and gradient is compared with an independent float64 reference written here:
``torch.log_softmax`` in float64 on the very inputs klest gets (bf16 / fp16 logits upcast
unchanged) and the divergence's formula, reduced by hand, differentiated by autograd (with
``0 log 0 = 0`` kept out of the graph). Then the trainer-batch rules: garbage in left-out rows
gives bit for bit the result of zeros there; left- and right-padded layouts agree; an extra empty
row changes nothing; the Triton kernels (``TRITON_INTERPRET=1`` on the CPU) agree with the
reference and with the PyTorch engine.

Tolerances (``u`` the unit roundoff of the compute dtype, 2^-24 in float32, 2^-53 in float64):

* values: ``log_softmax`` of entries of size ``M = max|z/T| + max|z_ref/T|`` (finite entries of
  the row) carries an absolute error of a few ``u M``; the divergence sums ``V <= 40`` products
  ``q_v d_v`` whose errors are ``q_v`` times that, so ``|error| <= C u (1 + M)`` with ``C``
  covering the products, the logsumexp and a cascade sum over 40 terms: ``C = 256``. Mixture
  divergences (JSD, skew KL) carry ratios up to ``1 / min(w, 1 - w)``, which multiply ``C``.
  A reduction is a positive combination of positions, so its tolerance is the same combination
  of theirs plus ``64 u`` times the combination of ``|values|`` (float32 sums of <= 36 terms).
* gradients, per logit: ``dKL/dz_v = q_v (d_v - KL) / T`` with ``q_v``, ``d_v`` and ``KL``
  each off by ``u (1 + M)`` relative or absolute, so ``C u (1 + M) (q_v + p_v)
  (2 + |log q_v| + |log p_v| + KL's) / T`` times the upstream gradient's size (``C = 64``), plus
  the rounding of the result to the input dtype: one ulp relative (the stash rounds twice:
  the per-unit gradient, then its product with the upstream gradient) and one subnormal spacing
  absolute. TV's gradient is ``sign(q - p)``: where ``|q_v - p_v|`` is within rounding of 0 the
  sign is not determined by the arithmetic, and the tolerance adds what a flipped sign moves.
* layouts, an extra row, the two engines: the same arithmetic in another order or another
  engine, so twice the reference tolerance, or ``1e3 u max|x|`` for reordered sums.
* the fused LM head (:func:`klest.kl_from_hidden`): hidden states, weights and biases are drawn
  on a grid of halves with ``H <= 4``, so that every logit is exact in every dtype and the
  reference gets the very logits klest computes; the gradients to hidden states and weights are
  products of the logits' gradient (rounded to the input dtype before the product) with the
  weights / hidden states, so their tolerance is that product taken in absolute values.

:func:`klest.kl_from_topk` gets the same rules (garbage ids and log-probs at left-out
positions too) and, for its estimators that are well conditioned in the stored log-probs
(``unbiased``, ``truncated``, ``truncated-raw``), the float64 formula; ``tail-bucket`` and
``unbiased-cv`` read the teacher's tail mass ``1 - R``, which float32 rounding of R makes
inaccurate relative to a small tail, and get the rules only.

An infinite KL has no gradient: the tests give it upstream gradient 0 (a trainer's weight or
mask), with which klest passes 0; with a nonzero upstream gradient its gradient is NaN there.

Example counts: ``EXAMPLES`` (150) drawn batches for each of the four properties of each of the
eight logits functions, 75 for the vocab-parallel KL and each of five ``*_from_hidden`` forms,
150 for ``kl_from_topk``, ``TRITON_EXAMPLES`` (12) for each of five functions on the interpreted
kernels: about 5900 examples in 35 s on one core (the Triton ones about 9 s of it).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import get_args

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import klest
from klest._types import Reduction
from klest.testbeds import make_generator

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = get_args(Reduction)
GARBAGE = ("nan", "+inf", "-inf", "huge", "mixed")
FORMS = ("mask", "labels", "both", "none")
EXAMPLES = 150
TRITON_EXAMPLES = 12
INF = math.inf

TRITON_ON_CPU = (
    importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(compute_dtype(dtype)).eps / 2


# -- batches -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One drawn call, right-padded.

    ``z``, ``y``: float64 ``[*lead, V]`` logits already representable in ``dtype`` (so the
    reference sees what klest sees), ``-inf`` at holes; ``keep``: bool ``[*lead]``, the positions
    that count; ``by_label``: where a left-out position is marked by label ``-100`` (else by
    ``mask=False``); ``labels``: tokens sampled from pi; ``junk``: ``[2, *lead, V]`` garbage for
    ``z`` and ``y`` at left-out positions.
    """

    z: torch.Tensor
    y: torch.Tensor
    keep: torch.Tensor
    by_label: torch.Tensor
    labels: torch.Tensor
    junk: torch.Tensor
    dtype: torch.dtype
    form: str
    temperature: float
    chunk: int | None

    @property
    def lead(self) -> torch.Size:
        return self.keep.shape

    @property
    def sequences(self) -> bool:
        return self.keep.ndim >= 2

    def lengths(self) -> torch.Tensor:
        return self.keep.reshape(-1, self.lead[-1]).sum(-1)


def garbage_like(kind: str, shape: tuple[int, ...], dtype: torch.dtype, gen) -> torch.Tensor:
    """Float64 garbage of one kind (``"huge"``: the dtype's largest finite value, either sign)."""
    big = torch.finfo(dtype).max
    pool = torch.tensor([math.nan, INF, -INF, big, -big], dtype=torch.float64)
    if kind == "mixed":
        return pool[torch.randint(0, len(pool), shape, generator=gen)]
    value = {"nan": math.nan, "+inf": INF, "-inf": -INF, "huge": big}[kind]
    return torch.full(shape, value, dtype=torch.float64)


def with_holes(x: torch.Tensor, rate: float, gen) -> torch.Tensor:
    """``x`` with a fraction ``rate`` of entries ``-inf``, one random entry per row kept finite."""
    if rate == 0.0:
        return x
    hole = torch.rand(x.shape, generator=gen) < rate
    spared = torch.randint(0, x.shape[-1], x.shape[:-1], generator=gen).unsqueeze(-1)
    hole.scatter_(-1, spared, False)
    return x.masked_fill(hole, -INF)


@st.composite
def leads(draw) -> tuple[int, ...]:
    kind = draw(st.sampled_from(("N", "BT", "BGT")))
    if kind == "N":
        return (draw(st.integers(1, 10)),)
    if kind == "BT":
        return (draw(st.integers(1, 4)), draw(st.integers(1, 6)))
    return (draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 4)))


@st.composite
def cases(draw, *, dtypes=DTYPES, max_v: int = 40, holes: bool = True) -> Case:
    lead = draw(leads())
    v = draw(st.integers(1, max_v))
    dtype = draw(st.sampled_from(dtypes))
    form = draw(st.sampled_from(FORMS))
    scale = draw(st.sampled_from((0.5, 3.0, 30.0)))
    distance = draw(st.sampled_from((0.0, 0.3, 3.0)))
    hole_rates = (draw(st.sampled_from((0.0, 0.0, 0.3))), draw(st.sampled_from((0.0, 0.0, 0.3))))
    if not holes:
        hole_rates = (0.0, 0.0)
    garbage = draw(st.sampled_from(GARBAGE))
    gen = make_generator(draw(st.integers(0, 2**31 - 1)))

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).double()

    z = scale * torch.randn(*lead, v, generator=gen, dtype=torch.float64)
    y = z + distance * torch.randn(*lead, v, generator=gen, dtype=torch.float64)
    if distance == 3.0:  # an unrelated ref
        y = scale * torch.randn(*lead, v, generator=gen, dtype=torch.float64)
    z = with_holes(rounded(z), hole_rates[0], gen)
    y = with_holes(rounded(y), hole_rates[1], gen)
    # Tokens sampled from pi (possible under pi; under ref they may fall in a hole).
    probs = torch.softmax(z.reshape(-1, v), -1)
    labels = torch.multinomial(probs, 1, generator=gen).reshape(lead)
    if form == "none":
        keep = torch.ones(lead, dtype=torch.bool)
    elif len(lead) == 1:
        keep = torch.tensor(draw(st.lists(st.booleans(), min_size=lead[0], max_size=lead[0])))
    else:
        rows, t = math.prod(lead[:-1]), lead[-1]
        lengths = draw(st.lists(st.integers(0, t), min_size=rows, max_size=rows))
        keep = (torch.arange(t) < torch.tensor(lengths).unsqueeze(-1)).reshape(lead)
    by_label = {
        "labels": torch.ones(lead, dtype=torch.bool),
        "mask": torch.zeros(lead, dtype=torch.bool),
        "none": torch.zeros(lead, dtype=torch.bool),
        "both": torch.rand(lead, generator=gen) < 0.5,
    }[form]
    junk = garbage_like(garbage, (2, *lead, v), dtype, gen)
    return Case(
        z,
        y,
        keep,
        by_label,
        labels,
        junk,
        dtype,
        form,
        draw(st.sampled_from((1.0, 0.7, 2.5))),
        draw(st.sampled_from((None, 1, 2, 3, 5))),
    )


# -- layouts and the arguments of a call ---------------------------------------------------------


def to_left(x: torch.Tensor, case: Case) -> torch.Tensor:
    """``x`` (``[*lead, ...]``, right-padded) with each row's valid positions moved to its end."""
    if not case.sequences:
        return x
    t = case.lead[-1]
    rows = x.reshape(-1, t, *x.shape[case.keep.ndim :])
    moved = [torch.roll(r, int(t - n), 0) for r, n in zip(rows, case.lengths(), strict=True)]
    return torch.stack(moved).reshape(x.shape)


def to_right(x: torch.Tensor, case: Case) -> torch.Tensor:
    """The inverse of :func:`to_left`."""
    if not case.sequences:
        return x
    t = case.lead[-1]
    rows = x.reshape(-1, t, *x.shape[case.keep.ndim :])
    moved = [torch.roll(r, -int(t - n), 0) for r, n in zip(rows, case.lengths(), strict=True)]
    return torch.stack(moved).reshape(x.shape)


@dataclass
class Args:
    """What one call takes: logits in the case's dtype (leaves), mask and labels (None when the
    form does not use them), and ``keep``, the positions that count, in the call's layout."""

    z: torch.Tensor
    y: torch.Tensor
    mask: torch.Tensor | None
    labels: torch.Tensor | None
    keep: torch.Tensor


def arguments(
    case: Case, *, layout: str = "right", garbage: bool = True, grad_y: bool = False
) -> Args:
    arrange = (lambda x: x) if layout == "right" else (lambda x: to_left(x, case))
    out = case.keep.unsqueeze(-1)
    fill = case.junk if garbage else torch.zeros_like(case.junk)
    z = torch.where(out, case.z, fill[0])
    y = torch.where(out, case.y, fill[1])
    left_out = ~case.keep
    mask = None if case.form in ("labels", "none") else ~(left_out & ~case.by_label)
    labels = None
    if case.form in ("labels", "both"):
        labels = torch.where(left_out & case.by_label, -100, case.labels)
    return Args(
        arrange(z).to(case.dtype).requires_grad_(),
        arrange(y).to(case.dtype).requires_grad_(grad_y),
        None if mask is None else arrange(mask),
        None if labels is None else arrange(labels),
        arrange(case.keep),
    )


# -- the functions under test and their float64 formulas -----------------------------------------


def kl_rows(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """``KL(softmax a || softmax b)`` per row from float64 log-probs; ``0 log 0 = 0`` out of the
    graph, ``+inf`` where the first has mass the second lacks."""
    q = la.exp()
    support = q > 0
    return (q * (torch.where(support, la, 0.0) - torch.where(support, lb, 0.0))).sum(-1)


def mixture_kl_rows(la: torch.Tensor, lb: torch.Tensor, w: float) -> torch.Tensor:
    """``KL(q || w p + (1 - w) q)`` with ``q = exp(la)``, ``p = exp(lb)``."""
    q, p = la.exp(), lb.exp()
    mix = w * p + (1 - w) * q
    log_mix = torch.where(mix > 0, mix, 1.0).log()
    support = q > 0
    return (q * (torch.where(support, la, 0.0) - torch.where(support, log_mix, 0.0))).sum(-1)


@dataclass(frozen=True)
class Spec:
    """One function under test: ``call(z, y, **options)``; ``rows(la, lb)``, its float64 formula
    per row; ``ratio``, the largest ``q / m`` of its mixture (1 for the KL and TV), which scales
    the tolerances; ``kl``: its details are differentiable (the KL; the other divergences' are
    not); ``stash``: it takes ``stash`` (the gradient in the forward pass, or recomputed)."""

    name: str
    call: Callable
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    options: tuple = ()
    ratio: float = 1.0
    kl: bool = False
    tv: bool = False
    stash: bool = False


def kl_spec(direction: str, *, call=klest.kl_from_logits, name="kl") -> Spec:
    def rows(la, lb):
        return kl_rows(la, lb) if direction == "pi||ref" else kl_rows(lb, la)

    return Spec(
        f"{name} {direction}",
        call,
        rows,
        (("direction", direction),),
        kl=True,
        stash=call is klest.kl_from_logits,
    )


def jsd_spec(beta: float) -> Spec:
    def rows(la, lb):
        return beta * mixture_kl_rows(lb, la, 1 - beta) + (1 - beta) * mixture_kl_rows(la, lb, beta)

    return Spec(
        f"jsd beta={beta}",
        klest.jsd_from_logits,
        rows,
        (("beta", beta),),
        ratio=1 / min(beta, 1 - beta),
        stash=True,
    )


def skew_spec(alpha: float, direction: str) -> Spec:
    def rows(la, lb):
        if direction == "pi||ref":
            return mixture_kl_rows(la, lb, 1 - alpha)
        return mixture_kl_rows(lb, la, 1 - alpha)

    return Spec(
        f"skew alpha={alpha} {direction}",
        klest.skew_kl_from_logits,
        rows,
        (("alpha", alpha), ("direction", direction)),
        ratio=1 / alpha,
        stash=True,
    )


def tv_rows(la: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    return 0.5 * (la.exp() - lb.exp()).abs().sum(-1)


SPECS = [
    kl_spec("pi||ref"),
    kl_spec("ref||pi"),
    jsd_spec(0.1),
    jsd_spec(0.5),
    jsd_spec(0.9),
    skew_spec(0.1, "pi||ref"),
    skew_spec(0.6, "ref||pi"),
    Spec("tv", klest.tv_from_logits, tv_rows, tv=True, stash=True),
]
KL_SPECS = SPECS[:2]
each_spec = pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)


# -- one call, and its reference -----------------------------------------------------------------


@dataclass
class Out:
    """What a call returns, reduced by ``reduction``: the value, details (or None), and the
    gradients of ``sum(weights * value)`` (plus the details' weighted sums) to the leaves."""

    value: torch.Tensor
    logp: torch.Tensor | None
    logp_ref: torch.Tensor | None
    entropy: torch.Tensor | None
    grads: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Weights:
    """Upstream gradients: of the reduced value (its shape) and of each detail (``[*lead]``),
    multiples of 1/8 (exact in every float type)."""

    value: torch.Tensor
    logp: torch.Tensor
    logp_ref: torch.Tensor
    entropy: torch.Tensor


def draw_weights(data, spec: Spec, case: Case, reduction: str, details: bool) -> Weights:
    """Upstream gradients; 0 at an infinite value (reduction ``"none"``: the trainer's weight 0
    or mask). An infinite KL has no gradient: with a nonzero upstream gradient klest's is NaN."""
    seed = data.draw(st.integers(0, 2**31 - 1), label="weights seed")
    gen = make_generator(seed)
    shape = reduced_shape(case.lead, reduction)

    def w(s) -> torch.Tensor:
        return torch.randint(-16, 17, s, generator=gen).double() / 8

    zero = torch.zeros(case.lead, dtype=torch.float64)
    value = w(shape)
    if reduction == "none":
        value = value.masked_fill(infinite_positions(spec, case), 0.0)
    if not details:
        return Weights(value, zero, zero, zero)
    return Weights(value, w(case.lead), w(case.lead), w(case.lead))


def weights_in_layout(weights: Weights, case: Case, reduction: str, layout: str) -> Weights:
    """``weights`` (drawn for the right-padded layout) for the call in ``layout``."""
    if layout == "right":
        return weights
    return Weights(
        to_left(weights.value, case) if reduction == "none" else weights.value,
        *(to_left(w, case) for w in (weights.logp, weights.logp_ref, weights.entropy)),
    )


def reduced_shape(lead: torch.Size, reduction: str) -> tuple[int, ...]:
    if reduction == "none":
        return tuple(lead)
    if reduction == "per-sequence":
        return tuple(lead[:-1]) if len(lead) >= 2 else tuple(lead)
    return ()


def run(
    spec: Spec,
    case: Case,
    x: Args,
    *,
    reduction: str,
    details: bool,
    weights: Weights | None,
    stash: bool = True,
    backend: str = "torch",
    grad: bool = True,
) -> Out:
    options = dict(spec.options)
    if spec.stash:
        options["stash"] = stash
    with torch.set_grad_enabled(grad):
        result = spec.call(
            x.z,
            x.y,
            mask=x.mask,
            labels=x.labels,
            reduction=reduction,
            temperature=case.temperature,
            chunk_size=case.chunk,
            backend=backend,
            return_details=details,
            **options,
        )
    value, d = result if details else (result, None)
    logp = None if d is None else d.logp
    logp_ref = None if d is None else d.logp_ref
    entropy = None if d is None else d.entropy
    grads = {}
    if grad and weights is not None:
        loss = (value.double() * weights.value).sum()
        if d is not None and spec.kl:
            loss = loss + (entropy.double() * weights.entropy).sum()
            for t, w in ((logp, weights.logp), (logp_ref, weights.logp_ref)):
                if t is not None:
                    loss = loss + (t.double() * w).sum()
        leaves = {"z": x.z} | ({"y": x.y} if x.y.requires_grad else {})
        if loss.requires_grad:
            got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
            grads = {
                k: torch.zeros_like(t) if g is None else g
                for (k, t), g in zip(leaves.items(), got, strict=True)
            }
        else:  # nothing kept: no graph at all is a zero gradient
            grads = {k: torch.zeros_like(t) for k, t in leaves.items()}
    return Out(
        value.detach(),
        None if logp is None else logp.detach(),
        None if logp_ref is None else logp_ref.detach(),
        None if entropy is None else entropy.detach(),
        grads,
    )


def reduce_by_hand(values: torch.Tensor, keep: torch.Tensor, reduction: str) -> torch.Tensor:
    """klest's reductions (README table) of float64 per-position ``values`` (0 where not kept)."""
    if reduction == "none":
        return values
    if reduction == "sum":
        return values.sum()
    if reduction == "token-mean":
        return values.sum() / max(int(keep.sum()), 1)
    rows = values.reshape(-1, keep.shape[-1]) if keep.ndim >= 2 else values.reshape(-1, 1)
    valid = keep.reshape(rows.shape)
    if reduction == "per-sequence":
        return rows.sum(-1).reshape(reduced_shape(keep.shape, reduction))
    counts = valid.sum(-1)
    per_row = rows.sum(-1) if reduction == "seq-mean-token-sum" else rows.sum(-1) / counts.clamp(1)
    nonempty = counts > 0
    return per_row[nonempty].sum() / max(int(nonempty.sum()), 1)


@dataclass
class Reference:
    """Float64 per-position values, details, tolerances and gradients (``[*lead]`` / ``[*lead,
    V]``), 0 at left-out positions."""

    values: torch.Tensor
    value_tol: torch.Tensor
    logp: torch.Tensor
    logp_ref: torch.Tensor
    entropy: torch.Tensor
    grads: dict[str, torch.Tensor]
    grad_tols: dict[str, torch.Tensor]


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


def reference(
    spec: Spec, case: Case, keep: torch.Tensor, z: torch.Tensor, y: torch.Tensor, weights, *,
    reduction: str, grad_y: bool, ulps: float = 1.0, backend: str = "torch",
) -> Reference:  # fmt: skip
    """The float64 answer for logits ``z``, ``y`` (float64, the call's layout) at ``keep``."""
    v = z.shape[-1]
    tau = case.temperature
    za = z[keep].reshape(-1, v).clone().requires_grad_()
    yb = y[keep].reshape(-1, v).clone().requires_grad_(grad_y)
    la, lb = torch.log_softmax(za / tau, -1), torch.log_softmax(yb / tau, -1)
    with torch.no_grad():
        values_kept = spec.rows(la, lb)
    finite = torch.isfinite(values_kept)
    labels = case.labels if case.form in ("labels", "both") else None
    lab = None if labels is None else labels_in_layout(case, keep)[keep].reshape(-1, 1)

    def spread(x: torch.Tensor) -> torch.Tensor:
        return spread_graph(keep, x.detach())

    values = spread(values_kept)
    logp = torch.zeros(0) if lab is None else la.gather(-1, lab).squeeze(-1)
    logp_ref = torch.zeros(0) if lab is None else lb.gather(-1, lab).squeeze(-1)
    q, p = la.exp(), lb.exp()
    entropy = -(q * torch.where(q > 0, la, 0.0)).sum(-1)

    # Tolerances (module docstring).
    u = unit_roundoff(case.dtype)
    a, b = za.detach() / tau, yb.detach() / tau
    m = finite_or_zero(a).abs().amax(-1) + finite_or_zero(b).abs().amax(-1)
    value_tol = spread(256 * spec.ratio * u * (1 + m))

    grads, grad_tols = {}, {}
    # The gradient: only rows with a finite value (an infinite KL's weight is 0, and its row is
    # kept out of the graph, where 0 * inf would be NaN).
    w_value = weights.value
    rows_finite = spread(finite)
    if not bool(rows_finite[keep].all()):
        assert reduction == "none", "an infinite value is only differentiated per position"
        w_value = torch.where(rows_finite, w_value, 0.0)
    kept_finite = finite.nonzero().view(-1)
    finite_values = torch.zeros(len(values_kept), dtype=torch.float64).index_copy(
        0, kept_finite, spec.rows(la[kept_finite], lb[kept_finite])
    )
    reduced = reduce_by_hand(spread_graph(keep, finite_values), keep, reduction)
    loss = (reduced * w_value).sum()
    if spec.kl:
        loss = loss + (entropy * weights.entropy[keep]).sum()
        if lab is not None:
            loss = (
                loss + (logp * weights.logp[keep]).sum() + (logp_ref * weights.logp_ref[keep]).sum()
            )
    leaves = {"z": za} | ({"y": yb} if grad_y else {})
    if loss.requires_grad:
        got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    else:
        got = [None] * len(leaves)
    # The size of each position's upstream gradient: that of its value through the reduction,
    # plus its details' (d reduced / d value at a position, by autograd on the hand reduction).
    probe = torch.zeros(keep.shape, dtype=torch.float64, requires_grad=True)
    (through,) = torch.autograd.grad(
        (reduce_by_hand(probe * keep, keep, reduction) * weights.value.abs()).sum(),
        probe,
        allow_unused=True,
    )
    size = (through if through is not None else torch.zeros_like(probe))[keep]
    size = size + (weights.entropy.abs() + weights.logp.abs() + weights.logp_ref.abs())[keep]
    size = size.unsqueeze(-1)
    qa, pb = q.detach(), p.detach()
    lq, lp = finite_or_zero(la.detach()), finite_or_zero(lb.detach())
    both_kls = finite_or_zero(kl_rows(la.detach(), lb.detach())) + finite_or_zero(
        kl_rows(lb.detach(), la.detach())
    )
    factor = 2 + lq.abs() + lp.abs() + both_kls.unsqueeze(-1)
    # q and p in the compute dtype: u relative, and one subnormal spacing absolute (the
    # smallest normal number on the Triton kernels, which flush subnormals to zero as GPUs do).
    tiny_c = torch.finfo(compute_dtype(case.dtype)).smallest_normal
    tiny_c = tiny_c if backend == "triton" else tiny_c * 2 * u
    probs = u * (1 + m).unsqueeze(-1) * (qa + pb) + tiny_c
    arith = 64 * spec.ratio * probs * factor / tau * size
    dtype = case.dtype
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    for (name, leaf), g in zip(leaves.items(), got, strict=True):
        g = torch.zeros_like(leaf) if g is None else g
        prob = qa if name == "z" else pb
        tol = arith + ulps * torch.finfo(dtype).eps * g.abs() + ulps * tiny * size.clamp(min=1)
        if spec.tv:
            tol = tol + sign_slack(qa, pb, prob, m, u, tau) * size
        grads[name], grad_tols[name] = spread_graph(keep, g), spread_graph(keep, tol)
    return Reference(
        values,
        value_tol,
        spread(logp) if lab is not None else None,
        spread(logp_ref) if lab is not None else None,
        spread(entropy),
        grads,
        grad_tols,
    )


def spread_graph(keep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Values of the kept positions ``[K, ...]`` into ``[*keep.shape, ...]``, 0 elsewhere."""
    return torch.zeros(*keep.shape, *x.shape[1:], dtype=x.dtype).index_put((keep,), x)


def sign_slack(q, p, prob, m, u, tau):
    """What a flipped ``sign(q_v - p_v)`` moves in TV's gradient ``prob (s - <prob, s>) / 2T``,
    at the entries where ``|q_v - p_v|`` is within the arithmetic's rounding of 0."""
    ambiguous = (q - p).abs() <= 64 * u * (1 + m).unsqueeze(-1) * (q + p)
    flip = 2.0 * ambiguous * prob  # s_v changes by at most 2
    return (flip + prob * flip.sum(-1, keepdim=True)) / (2 * tau)


def labels_in_layout(case: Case, keep: torch.Tensor) -> torch.Tensor:
    return case.labels if keep is case.keep else to_left(case.labels, case)


# -- comparisons ---------------------------------------------------------------------------------


def assert_within(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    """``|got - want| <= tol`` elementwise; infinities must match exactly; no NaN anywhere."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    got = got.double()
    assert not bool(got.isnan().any()), f"{what}: NaN in {got}"
    inf = torch.isinf(want)
    assert torch.equal(got[inf], want[inf]), f"{what}: {got[inf]} where the answer is {want[inf]}"
    diff = (got - want).abs()[~inf]
    tol = tol.expand(want.shape)[~inf]
    if diff.numel() and not bool((diff <= tol).all()):
        ratio = diff / tol.clamp(min=1e-300)
        i = int(ratio.argmax())
        raise AssertionError(
            f"{what}: {int((diff > tol).sum())} of {diff.numel()} elements off; worst "
            f"|{float(got[~inf][i]):.9g} - {float(want[~inf][i]):.9g}| = {float(diff[i]):.3g} "
            f"> tol {float(tol[i]):.3g}"
        )


def assert_zero_where_left_out(out: Out, keep: torch.Tensor, reduction: str, what: str) -> None:
    for name, t in (("logp", out.logp), ("logp_ref", out.logp_ref), ("entropy", out.entropy)):
        if t is not None:
            assert not bool(t[~keep].any()), f"{what}: {name} is not 0 at a left-out position"
    if reduction == "none":
        assert not bool(out.value[~keep].any()), f"{what}: a left-out position's value is not 0"
    for name, g in out.grads.items():
        assert not bool(g[~keep].any()), f"{what}: gradient to {name} is not 0 where left out"


def assert_same(a: Out, b: Out, what: str) -> None:
    """Bit for bit (NaN never: the answers are checked free of it first)."""
    for name in ("value", "logp", "logp_ref", "entropy"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), f"{what}: {name} present in one call only"
        if x is not None:
            assert torch.equal(x, y), f"{what}: {name} differs: {x} vs {y}"
    for k in a.grads:
        assert torch.equal(a.grads[k], b.grads[k]), f"{what}: gradient to {k} differs"


def reordered_tol(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reordered sums of the same terms: ``1e3 u (1 + max|x|)`` (finite entries)."""
    scale = float(finite_or_zero(want.double()).abs().amax()) if want.numel() else 0.0
    return torch.tensor(1e3 * unit_roundoff(dtype) * (1 + scale), dtype=torch.float64)


def assert_reordered(got: Out, want: Out, dtype: torch.dtype, what: str) -> None:
    """Equal up to the order of sums (and which rows share a chunk)."""
    for name in ("value", "logp", "logp_ref", "entropy"):
        x, y = getattr(got, name), getattr(want, name)
        if y is not None:
            assert_within(x, y.double(), reordered_tol(y, dtype), f"{what}: {name}")
    for k, g in want.grads.items():
        assert_within(got.grads[k], g.double(), reordered_tol(g, dtype), f"{what}: grad {k}")


# -- the properties ------------------------------------------------------------------------------


def check_against_reference(spec: Spec, case: Case, out: Out, x: Args, weights, *, reduction,
                            grad_y: bool, ulps: float, what: str, backend: str = "torch",
                            ) -> None:  # fmt: skip
    """Values (per position and reduced), details, dtypes and gradients vs the float64 answer."""
    z64, y64 = x.z.detach().double(), x.y.detach().double()
    ref = reference(
        spec, case, x.keep, z64, y64, weights, reduction=reduction, grad_y=grad_y, ulps=ulps,
        backend=backend,
    )  # fmt: skip
    cdtype = compute_dtype(case.dtype)
    assert out.value.dtype == cdtype, f"{what}: value dtype {out.value.dtype}"
    want = reduce_by_hand(ref.values, x.keep, reduction)
    finite_values = finite_or_zero(ref.values).abs()
    tol = reduce_by_hand(ref.value_tol, x.keep, reduction) + 64 * unit_roundoff(
        case.dtype
    ) * reduce_by_hand(finite_values, x.keep, reduction)
    assert_within(out.value, want, tol, f"{what}: value ({reduction})")
    assert_zero_where_left_out(out, x.keep, reduction, what)
    if out.entropy is not None:
        assert out.entropy.dtype == cdtype
        assert_within(out.entropy, ref.entropy, ref.value_tol, f"{what}: entropy")
    if ref.logp is not None and out.logp is not None:
        assert_within(out.logp, ref.logp, ref.value_tol, f"{what}: logp")
        assert_within(out.logp_ref, ref.logp_ref, ref.value_tol, f"{what}: logp_ref")
    for name, g in out.grads.items():
        assert g.dtype == case.dtype, f"{what}: gradient to {name} in {g.dtype}"
        assert_within(g, ref.grads[name], ref.grad_tols[name], f"{what}: gradient to {name}")


def infinite_positions(spec: Spec, case: Case) -> torch.Tensor:
    """Bool ``[*lead]``: the kept positions whose value is infinite (only a KL's can be)."""
    out = torch.zeros(case.lead, dtype=torch.bool)
    if not spec.kl:
        return out
    v = case.z.shape[-1]
    la = torch.log_softmax(case.z[case.keep].reshape(-1, v) / case.temperature, -1)
    lb = torch.log_softmax(case.y[case.keep].reshape(-1, v) / case.temperature, -1)
    return out.index_put((case.keep,), torch.isinf(spec.rows(la, lb)))


def any_infinite(spec: Spec, case: Case) -> bool:
    return bool(infinite_positions(spec, case).any())


@st.composite
def call_options(draw, spec: Spec, case: Case):
    """``(reduction, details, stash, grad_y)``: per position where some value is infinite."""
    reduction = "none" if any_infinite(spec, case) else draw(st.sampled_from(REDUCTIONS))
    return reduction, draw(st.booleans()), draw(st.booleans()), draw(st.booleans())


@each_spec
@given(case=cases(), data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_values_and_gradients_equal_the_float64_formula(spec, case, data):
    """Rules: exact value per position and reduced, details, output and gradient dtypes,
    gradients to both logits, 0 where left out, +inf (never NaN) where a KL is infinite."""
    reduction, details, stash, grad_y = data.draw(call_options(spec, case), label="options")
    weights = draw_weights(data, spec, case, reduction, details)
    x = arguments(case, grad_y=grad_y)
    out = run(spec, case, x, reduction=reduction, details=details, weights=weights, stash=stash)
    what = f"{spec.name} {case.dtype} {reduction} details={details} stash={stash}"
    check_against_reference(
        spec, case, out, x, weights, reduction=reduction, grad_y=grad_y, ulps=1.0, what=what
    )
    # Every other reduction's value (no graph).
    for other in REDUCTIONS:
        if other == reduction or (other != "none" and any_infinite(spec, case)):
            continue
        got = run(spec, case, x, reduction=other, details=False, weights=None, grad=False)
        zero_weights = replace(weights, value=torch.zeros(reduced_shape(case.lead, other)))
        check_against_reference(
            spec, case, got, x, zero_weights, reduction=other, grad_y=False, ulps=1.0,
            what=f"{spec.name} {case.dtype} {other}",
        )  # fmt: skip


@each_spec
@given(case=cases(), layout=st.sampled_from(("left", "right")), data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_what_is_left_out_is_never_read(spec, case, layout, data):
    """NaN / +-inf / finfo.max in the left-out rows' logits give, bit for bit, the result of
    zeros there: values, details and both gradients."""
    reduction, details, stash, grad_y = data.draw(call_options(spec, case), label="options")
    weights = draw_weights(data, spec, case, reduction, details)
    weights = weights_in_layout(weights, case, reduction, layout)
    results = []
    for garbage in (True, False):
        x = arguments(case, layout=layout, garbage=garbage, grad_y=grad_y)
        out = run(spec, case, x, reduction=reduction, details=details, weights=weights,
                  stash=stash)  # fmt: skip
        assert not bool(out.value.isnan().any()), f"{spec.name}: NaN value"
        for g in out.grads.values():
            assert not bool(g.isnan().any()), f"{spec.name}: NaN gradient"
        assert_zero_where_left_out(out, x.keep, reduction, spec.name)
        results.append(out)
    assert_same(*results, f"{spec.name} {case.dtype} {reduction} garbage vs zeros")


@each_spec
@given(case=cases(), data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_left_and_right_padding_agree(spec, case, data):
    """The same completions left- or right-padded: the same reduced values, and the same
    per-position values, details and gradients once unrolled."""
    if not case.sequences:
        return
    reduction, details, stash, grad_y = data.draw(call_options(spec, case), label="options")
    weights = draw_weights(data, spec, case, reduction, details)
    right = run(spec, case, arguments(case, grad_y=grad_y), reduction=reduction,
                details=details, weights=weights, stash=stash)  # fmt: skip
    left_weights = weights_in_layout(weights, case, reduction, "left")
    left = run(spec, case, arguments(case, layout="left", grad_y=grad_y), reduction=reduction,
               details=details, weights=left_weights, stash=stash)  # fmt: skip

    def unroll(t):
        return None if t is None else to_right(t, case)

    unrolled = Out(
        unroll(left.value) if reduction == "none" else left.value,
        unroll(left.logp),
        unroll(left.logp_ref),
        unroll(left.entropy),
        {k: to_right(g, case) for k, g in left.grads.items()},
    )
    assert_reordered(unrolled, right, case.dtype, f"{spec.name} {reduction} left vs right")


def with_empty_row(case: Case, at: int, gen) -> Case:
    """``case`` with one more index ``at`` along the first dimension, all left out (garbage)."""

    def insert(x: torch.Tensor, row: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat([x.narrow(dim, 0, at), row, x.narrow(dim, at, x.shape[dim] - at)], dim)

    one = (1, *case.lead[1:])
    v = case.z.shape[-1]
    # Left out as the form says: by label -100, by the mask, or either.
    by_label_row = torch.full(one, case.form == "labels") | (
        (torch.rand(one, generator=gen) < 0.5) & (case.form == "both")
    )
    return replace(
        case,
        z=insert(case.z, torch.zeros(*one, v, dtype=torch.float64)),
        y=insert(case.y, torch.zeros(*one, v, dtype=torch.float64)),
        keep=insert(case.keep, torch.zeros(one, dtype=torch.bool)),
        by_label=insert(case.by_label, by_label_row),
        labels=insert(case.labels, torch.zeros(one, dtype=torch.int64)),
        junk=insert(case.junk, garbage_like("mixed", (2, *one, v), case.dtype, gen), dim=1),
    )


@each_spec
@given(case=cases(), data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_an_extra_empty_row_changes_nothing(spec, case, data):
    """An empty row (garbage in its logits) leaves the other rows' values, details and
    gradients and every reduction unchanged; its own are 0."""
    reduction, details, stash, grad_y = data.draw(call_options(spec, case), label="options")
    at = data.draw(st.integers(0, case.lead[0]), label="at")
    if case.form == "none":
        case = replace(case, form="mask")  # an empty row needs a mask or labels
    bigger = with_empty_row(case, at, make_generator(at))
    weights = draw_weights(data, spec, case, reduction, details)
    keeps_rows = reduction == "none" or (reduction == "per-sequence" and case.sequences)
    keeps_rows = keeps_rows or (reduction == "per-sequence" and len(case.lead) == 1)

    def insert_zero(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w[:at], torch.zeros_like(w[:1]), w[at:]]) if w.ndim else w

    big_weights = Weights(
        insert_zero(weights.value) if keeps_rows else weights.value,
        *(insert_zero(w) for w in (weights.logp, weights.logp_ref, weights.entropy)),
    )
    base = run(spec, case, arguments(case, grad_y=grad_y), reduction=reduction,
               details=details, weights=weights, stash=stash)  # fmt: skip
    x = arguments(bigger, grad_y=grad_y)
    extended = run(spec, bigger, x, reduction=reduction, details=details, weights=big_weights,
                   stash=stash)  # fmt: skip
    assert_zero_where_left_out(extended, x.keep, reduction, spec.name)
    others = [i for i in range(case.lead[0] + 1) if i != at]

    def drop(t, rows: bool = True):
        return None if t is None else (t[others] if rows else t)

    without = Out(
        drop(extended.value, keeps_rows),
        drop(extended.logp),
        drop(extended.logp_ref),
        drop(extended.entropy),
        {k: g[others] for k, g in extended.grads.items()},
    )
    assert_reordered(without, base, case.dtype, f"{spec.name} {reduction} with an empty row")


# -- the Triton engine ---------------------------------------------------------------------------

needs_triton = pytest.mark.skipif(
    not TRITON_ON_CPU, reason="needs triton and TRITON_INTERPRET=1 (make test sets it)"
)
TRITON_SPECS = [SPECS[0], SPECS[1], SPECS[3], SPECS[5], SPECS[7]]


@needs_triton
@pytest.mark.parametrize("spec", TRITON_SPECS, ids=lambda s: s.name)
@given(case=cases(dtypes=LOW_PRECISION, max_v=12), data=st.data())
@settings(max_examples=TRITON_EXAMPLES, deadline=None)
def test_triton_kernels_equal_the_formula_and_the_torch_engine(spec, case, data):
    """The interpreted Triton kernels on small drawn batches: the float64 answer (the same
    tolerances: both engines compute in float32), garbage in left-out rows never read, and the
    PyTorch engine's result within twice the tolerance."""
    reduction, details, stash, grad_y = data.draw(call_options(spec, case), label="options")
    weights = draw_weights(data, spec, case, reduction, details)
    x = arguments(case, grad_y=grad_y)
    out = run(spec, case, x, reduction=reduction, details=details, weights=weights,
              backend="triton", stash=stash)  # fmt: skip
    what = f"triton {spec.name} {case.dtype} {reduction} stash={stash}"
    # The interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest): a whole ulp per
    # rounding, and a gradient written in the forward pass and rescaled rounds twice.
    ulps = 2.0 if case.dtype == torch.bfloat16 else 1.0
    check_against_reference(
        spec, case, out, x, weights, reduction=reduction, grad_y=grad_y, ulps=ulps, what=what,
        backend="triton",
    )  # fmt: skip
    clean = run(spec, case, arguments(case, garbage=False, grad_y=grad_y), reduction=reduction,
                details=details, weights=weights, backend="triton", stash=stash)  # fmt: skip
    assert_same(out, clean, f"{what}: garbage vs zeros")
    torch_out = run(spec, case, arguments(case, grad_y=grad_y), reduction=reduction,
                    details=details, weights=weights, stash=False)  # fmt: skip
    # The two engines against each other: each within the reference tolerance of the answer.
    check_against_reference(
        spec, case, torch_out, x, weights, reduction=reduction, grad_y=grad_y, ulps=1.0,
        what=f"torch {spec.name}",
    )  # fmt: skip


# -- one process of the vocabulary-parallel path ---------------------------------------------------


@pytest.fixture(scope="module")
def one_process_group(tmp_path_factory):
    """A gloo group of one process (the whole vocabulary is this rank's shard), for this module
    only: it is destroyed after, since other tests check the function refuses to run without."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


VOCAB_PARALLEL_SPECS = [
    kl_spec(d, call=klest.kl_from_logits_vocab_parallel, name="vocab-parallel")
    for d in ("pi||ref", "ref||pi")
]


@pytest.mark.parametrize("spec", VOCAB_PARALLEL_SPECS, ids=lambda s: s.name)
@given(case=cases(), layout=st.sampled_from(("left", "right")), data=st.data())
@settings(max_examples=EXAMPLES // 2, deadline=None)
def test_vocab_parallel_on_one_process(one_process_group, spec, case, layout, data):
    """One rank holding the whole vocabulary: the merge of one shard must give the float64
    answer (same tolerances: the merge adds an exp / log round trip of 0), and the left-out
    rows' garbage is never read."""
    reduction, details, _, grad_y = data.draw(call_options(spec, case), label="options")
    weights = weights_in_layout(
        draw_weights(data, spec, case, reduction, details), case, reduction, layout
    )
    results = []
    for garbage in (True, False):
        x = arguments(case, layout=layout, garbage=garbage, grad_y=grad_y)
        results.append(run(spec, case, x, reduction=reduction, details=details, weights=weights))
    check_against_reference(
        spec, case, results[0], x, weights, reduction=reduction, grad_y=grad_y, ulps=1.0,
        what=f"{spec.name} {case.dtype} {reduction} {layout}",
    )  # fmt: skip
    assert_same(*results, f"{spec.name}: garbage vs zeros")


# -- the fused LM head ----------------------------------------------------------------------------

HIDDEN_CALLS = {
    klest.kl_from_logits: klest.kl_from_hidden,
    klest.jsd_from_logits: klest.jsd_from_hidden,
    klest.skew_kl_from_logits: klest.skew_kl_from_hidden,
    klest.tv_from_logits: klest.tv_from_hidden,
}
HIDDEN_SPECS = [SPECS[0], SPECS[1], SPECS[3], SPECS[6], SPECS[7]]


@dataclass(frozen=True)
class Heads:
    """Float64 tensors on a grid of halves (module docstring): pi's hidden states ``[*lead, H]``,
    head ``[V, H]`` and bias, and ref's (``hidden_ref`` None: ref given by its logits)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    hidden_ref: torch.Tensor | None
    weight_ref: torch.Tensor | None
    bias_ref: torch.Tensor | None

    def logits(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        def linear(h, w, b):
            return h @ w.T + (0.0 if b is None else b)

        ref = (
            None
            if self.hidden_ref is None
            else linear(self.hidden_ref, self.weight_ref, self.bias_ref)
        )
        return linear(self.hidden, self.weight, self.bias), ref


@st.composite
def hidden_cases(draw) -> tuple[Case, Heads]:
    """A :func:`cases` batch whose logits come from hidden states and heads: every entry a
    half in [-1, 1] (biases in [-2, 2]) and H <= 4, so every logit is a quarter below 6 in size,
    exact in every dtype."""
    case = draw(cases(holes=False, max_v=24))
    lead, v = case.lead, case.z.shape[-1]
    gen = make_generator(draw(st.integers(0, 2**31 - 1), label="heads seed"))

    def halves(*shape: int, top: int = 2) -> torch.Tensor:
        return torch.randint(-top, top + 1, shape, generator=gen).double() / 2

    h, h_ref = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    biased, biased_ref, ref_hidden = (draw(st.booleans()) for _ in range(3))
    heads = Heads(
        halves(*lead, h),
        halves(v, h),
        halves(v, top=4) if biased else None,
        halves(*lead, h_ref) if ref_hidden else None,
        halves(v, h_ref) if ref_hidden else None,
        halves(v, top=4) if biased_ref and ref_hidden else None,
    )
    z, y = heads.logits()
    if y is None:  # ref's logits given directly (on the same grid, so exact too)
        y = halves(*lead, v, top=8)
    return replace(case, z=z, y=y), heads


def run_hidden(spec: Spec, case: Case, heads: Heads, *, reduction: str, details: bool,
               weights: Weights, grad_ref: bool, garbage: bool) -> Out:  # fmt: skip
    """The ``*_from_hidden`` form of ``spec`` on ``heads`` (left-out rows' hidden states and ref
    logits hold garbage), with the gradients of the weighted outputs to every leaf."""
    out_rows = ~case.keep.unsqueeze(-1)
    fill = case.junk[..., :1] if garbage else torch.zeros_like(case.junk[..., :1])

    def leaf(x, grad=True, rows=False, fill_with=None):
        if x is None:
            return None
        if rows:
            x = torch.where(out_rows, fill_with.expand_as(x), x)
        return x.to(case.dtype).requires_grad_(grad)

    leaves = {
        "hidden": leaf(heads.hidden, rows=True, fill_with=fill[0]),
        "weight": leaf(heads.weight),
        "bias": leaf(heads.bias),
        "hidden_ref": leaf(heads.hidden_ref, grad_ref, rows=True, fill_with=fill[1]),
        "weight_ref": leaf(heads.weight_ref, grad_ref),
        "bias_ref": leaf(heads.bias_ref, grad_ref),
    }
    x = arguments(case, garbage=garbage, grad_y=grad_ref)
    logits_ref = x.y if heads.hidden_ref is None else None
    options = dict(spec.options)
    result = HIDDEN_CALLS[spec.call](
        leaves["hidden"], leaves["weight"], leaves["hidden_ref"], leaves["weight_ref"],
        logits_ref=logits_ref, bias=leaves["bias"], bias_ref=leaves["bias_ref"],
        mask=x.mask, labels=x.labels, reduction=reduction, temperature=case.temperature,
        chunk_size=case.chunk, backend="torch", return_details=details, **options,
    )  # fmt: skip
    value, d = result if details else (result, None)
    loss = (value.double() * weights.value).sum()
    if d is not None and spec.kl:
        loss = loss + (d.entropy.double() * weights.entropy).sum()
        if d.logp is not None:
            loss = loss + (d.logp.double() * weights.logp).sum()
            loss = loss + (d.logp_ref.double() * weights.logp_ref).sum()
    wanted = {k: t for k, t in leaves.items() if t is not None and t.requires_grad}
    if logits_ref is not None and grad_ref:
        wanted["logits_ref"] = logits_ref
    got = torch.autograd.grad(loss, list(wanted.values()), allow_unused=True)
    grads = {
        k: torch.zeros_like(t) if g is None else g
        for (k, t), g in zip(wanted.items(), got, strict=True)
    }
    detail = (lambda t: None if t is None else t.detach()) if d is not None else (lambda t: None)
    return Out(
        value.detach(),
        detail(None if d is None else d.logp),
        detail(None if d is None else d.logp_ref),
        detail(None if d is None else d.entropy),
        grads,
    )


def through_heads(g: torch.Tensor, heads: Heads, side: str) -> dict[str, torch.Tensor]:
    """A logits-space tensor ``[*lead, V]`` taken through one side's head by the chain rule:
    ``dh = G W``, ``dW = G^T h``, ``db = sum G`` (float64; pass absolute values for bounds)."""
    h, w, b = (
        (heads.hidden, heads.weight, heads.bias)
        if side == "pi"
        else (heads.hidden_ref, heads.weight_ref, heads.bias_ref)
    )
    suffix = "" if side == "pi" else "_ref"
    v = g.shape[-1]
    flat = g.reshape(-1, v)
    out = {f"hidden{suffix}": g @ w, f"weight{suffix}": flat.T @ h.reshape(-1, h.shape[-1])}
    if b is not None:
        out[f"bias{suffix}"] = flat.sum(0)
    return out


@pytest.mark.parametrize("spec", HIDDEN_SPECS, ids=lambda s: s.name)
@given(drawn=hidden_cases(), data=st.data())
@settings(max_examples=EXAMPLES // 2, deadline=None)
def test_fused_head_equals_the_float64_formula(spec, drawn, data):
    """``*_from_hidden``: values and details as the float64 formula on the (exact) logits;
    gradients to hidden states, heads and biases of both models (or to ref's logits) those of
    the formula through the heads; garbage in left-out rows' hidden states never read."""
    case, heads = drawn
    reduction, details, _, grad_ref = data.draw(call_options(spec, case), label="options")
    weights = draw_weights(data, spec, case, reduction, details)
    out = run_hidden(spec, case, heads, reduction=reduction, details=details, weights=weights,
                     grad_ref=grad_ref, garbage=True)  # fmt: skip
    what = f"{spec.name} from hidden {case.dtype} {reduction}"
    x = arguments(case, grad_y=grad_ref)
    logits_out = Out(out.value, out.logp, out.logp_ref, out.entropy, {})
    check_against_reference(spec, case, logits_out, x, weights, reduction=reduction,
                            grad_y=grad_ref, ulps=1.0, what=what)  # fmt: skip
    ref = reference(spec, case, x.keep, case.z, case.y, weights, reduction=reduction,
                    grad_y=grad_ref)  # fmt: skip
    # Through the heads: G is rounded to the input dtype before each product (one ulp), the
    # products accumulate in float32 (64 u) and the result is rounded once more (one ulp).
    ulp = torch.finfo(case.dtype).eps
    tiny = torch.finfo(case.dtype).smallest_normal * ulp
    u = unit_roundoff(case.dtype)
    for side, key in (("pi", "z"), ("ref", "y")):
        if key not in ref.grads:
            continue
        if side == "ref" and heads.hidden_ref is None:
            want = {"logits_ref": ref.grads["y"]}
            bound = {"logits_ref": ref.grad_tols["y"]}
        else:
            g = ref.grads[key]
            want = through_heads(g, heads, side)
            sizes_of = Heads(*(None if t is None else t.abs() for t in vars(heads).values()))
            err = through_heads(ref.grad_tols[key] + ulp * g.abs(), sizes_of, side)
            sizes = through_heads(g.abs(), sizes_of, side)
            bound = {
                k: err[k] + (ulp + 64 * u) * sizes[k] + ulp * want[k].abs() + tiny for k in want
            }
        for k, w in want.items():
            assert out.grads[k].dtype == case.dtype, (
                f"{what}: gradient to {k} in {out.grads[k].dtype}"
            )
            assert_within(out.grads[k], w, bound[k], f"{what}: gradient to {k}")
    for k in ("hidden", "hidden_ref", "logits_ref"):
        if k in out.grads:
            assert not bool(out.grads[k][~case.keep].any()), (
                f"{what}: gradient to {k} where left out"
            )
    clean = run_hidden(spec, case, heads, reduction=reduction, details=details, weights=weights,
                       grad_ref=grad_ref, garbage=False)  # fmt: skip
    assert_same(out, clean, f"{what}: garbage vs zeros")


# -- a teacher known by its top-k ----------------------------------------------------------------

TOPK_ESTIMATORS = ("unbiased", "unbiased-cv", "tail-bucket", "truncated", "truncated-raw")
# The estimators whose value is well conditioned in the teacher's stored log-probs; the other two
# read the teacher's tail mass 1 - R, which rounding of R (float32: ~1e-7 absolute) makes
# arbitrarily inaccurate relative to a small tail: they get the trainer-batch rules only.
TOPK_FORMULAS = ("unbiased", "truncated", "truncated-raw")


@dataclass(frozen=True)
class TopK:
    """The teacher's stored top-k per position ``[*lead, k]`` (ids and log-probs, rounded to
    float32, float64 for float64 logits) and its log-prob of each sampled token ``[*lead]``."""

    ids: torch.Tensor
    logp: torch.Tensor
    logp_label: torch.Tensor


def topk_of(case: Case, k: int) -> TopK:
    teacher = torch.log_softmax(torch.nan_to_num(case.y, neginf=-30.0), -1)
    logp, ids = teacher.topk(k, dim=-1)
    stored = compute_dtype(case.dtype)
    label_logp = teacher.gather(-1, case.labels.unsqueeze(-1)).squeeze(-1)
    return TopK(ids, logp.to(stored), label_logp.to(stored))


def run_topk(case: Case, topk: TopK, estimator: str, direction: str, *, reduction: str,
             weights: Weights, layout: str = "right", garbage: bool = True,
             budget_rows: int | None = None) -> Out:  # fmt: skip
    """``kl_from_topk`` with garbage (ids out of range or repeated, NaN log-probs) at left-out
    positions; the gradient of ``sum(weights * value)`` to the logits."""
    x = arguments(case, layout=layout, garbage=garbage)
    arrange = (lambda t: t) if layout == "right" else (lambda t: to_left(t, case))
    out = ~case.keep
    v, k = case.z.shape[-1], topk.ids.shape[-1]
    bad_ids = torch.full_like(topk.ids, -7 if garbage else 0)
    if garbage and k > 1:
        bad_ids[..., 1] = v + 3
    ids = torch.where(out.unsqueeze(-1), bad_ids, topk.ids)
    fill = math.nan if garbage else 0.0
    logp = torch.where(out.unsqueeze(-1), fill, topk.logp)
    label_logp = torch.where(out, fill, topk.logp_label)
    labels = torch.where(out & case.by_label, -100, case.labels)
    value = klest.kl_from_topk(
        x.z, arrange(ids), arrange(logp), labels=arrange(labels),
        logp_ref_label=arrange(label_logp), estimator=estimator, direction=direction,
        mask=x.mask, reduction=reduction, temperature=case.temperature,
        memory_budget=None if budget_rows is None else 12 * v * budget_rows,
    )  # fmt: skip
    loss = (value.double() * weights.value).sum()
    (g,) = torch.autograd.grad(loss, [x.z]) if loss.requires_grad else (torch.zeros_like(x.z),)
    return Out(value.detach(), None, None, None, {"z": g})


def topk_reference(case: Case, topk: TopK, estimator: str, direction: str, keep: torch.Tensor,
                   z: torch.Tensor, weights: Weights, reduction: str):  # fmt: skip
    """Float64 per-position values, their tolerance, and the gradient with its tolerance."""
    v, tau = z.shape[-1], case.temperature
    za = z[keep].reshape(-1, v).clone().requires_grad_()
    la = torch.log_softmax(za / tau, -1)
    ids = topk.ids[keep] if keep is case.keep else to_left(topk.ids, case)[keep]
    labels = case.labels if keep is case.keep else to_left(case.labels, case)
    y = labels[keep].unsqueeze(-1)
    stored = (lambda t: t) if keep is case.keep else (lambda t: to_left(t, case))
    b = stored(topk.logp)[keep].double()
    b_y = stored(topk.logp_label)[keep].double()
    a = la.gather(-1, ids)
    a_y = la.gather(-1, y).squeeze(-1)
    supported = a > -INF
    outside = (ids != y).all(-1)

    def plogq(lp, lq, support):
        return torch.where(support, lp.exp() * (torch.where(support, lp, 0.0) - lq), 0.0)

    if estimator == "truncated":
        # A row with no student mass on S (value 0 or inf) is kept out of the graph's logsumexp.
        mass = torch.logsumexp(torch.where(supported.any(-1, keepdim=True), a, 0.0), -1, True)
        a_s = torch.where(supported, a - mass, -INF)
        b_s = b - torch.logsumexp(b, -1, keepdim=True)
        if direction == "pi||ref":
            value, g = plogq(a_s, b_s, supported).sum(-1), None
        else:
            value, g = (b_s.exp() * (b_s - a_s)).sum(-1), None
    else:
        if direction == "pi||ref":
            value = plogq(a, b, supported).sum(-1)
        else:
            value = (b.exp() * (b - a)).sum(-1)
        g = None
        if estimator == "unbiased":
            log_w = b_y - a_y
            g = torch.where(outside, -log_w if direction == "pi||ref" else log_w.exp() * log_w, 0.0)
            value = value + g
    finite = torch.isfinite(value.detach())
    surrogate = value if g is None else value + g.detach() * a_y
    per_position = torch.zeros(keep.shape, dtype=torch.float64).index_put(
        (keep,), torch.where(finite, surrogate, 0.0)
    )
    w = weights.value if reduction != "none" else torch.where(
        torch.zeros(keep.shape, dtype=torch.bool).index_put((keep,), ~finite), 0.0, weights.value
    )  # fmt: skip
    loss = (reduce_by_hand(per_position, keep, reduction) * w).sum()
    (grad,) = torch.autograd.grad(loss, [za]) if loss.requires_grad else (torch.zeros_like(za),)
    # Tolerances: the value's terms' sizes times u (1 + M), M the size of the scaled logits and
    # the stored log-probs; the gradient's, row-uniform, the same times the upstream's size / T.
    u = unit_roundoff(case.dtype)
    m = finite_or_zero(za.detach() / tau).abs().amax(-1) + b.abs().amax(-1) + b_y.abs()
    sizes = (finite_or_zero(a.detach()).abs() + b.abs()).sum(-1) + 2
    if g is not None:
        sizes = sizes + finite_or_zero(g.detach()).abs() * (1 + (b_y - a_y.detach()).abs())
    tol = 256 * u * (1 + m) * sizes

    def spread(x: torch.Tensor) -> torch.Tensor:
        return spread_graph(keep, x)

    probe = torch.zeros(keep.shape, dtype=torch.float64, requires_grad=True)
    (through,) = torch.autograd.grad(
        (reduce_by_hand(probe * keep, keep, reduction) * w.abs()).sum(), probe, allow_unused=True
    )
    size = (torch.zeros_like(probe) if through is None else through)[keep].unsqueeze(-1)
    grad_tol = 64 * u * (1 + m).unsqueeze(-1) * sizes.unsqueeze(-1) / tau * size
    ulp = torch.finfo(case.dtype).eps
    grad_tol = grad_tol + ulp * grad.abs() + torch.finfo(case.dtype).smallest_normal * size
    return spread(value.detach()), spread(tol), spread(grad), spread(grad_tol)


@st.composite
def topk_calls(draw):
    case = draw(cases(max_v=24))
    k = draw(st.integers(1, case.z.shape[-1]))
    estimator = draw(st.sampled_from(TOPK_ESTIMATORS))
    direction = draw(st.sampled_from(("pi||ref", "ref||pi")))
    return case, topk_of(case, k), estimator, direction


def topk_infinite(case: Case, topk: TopK, estimator: str, direction: str) -> torch.Tensor:
    """Kept positions whose value is infinite: ``ref||pi`` with student mass 0 on a top-k token
    (the estimators that read the tail: also on the sampled token)."""
    la = torch.log_softmax(case.z / case.temperature, -1)
    if direction == "pi||ref":
        return torch.zeros(case.lead, dtype=torch.bool)
    return (la.gather(-1, topk.ids) == -INF).any(-1) & case.keep


@given(drawn=topk_calls(), layout=st.sampled_from(("left", "right")), data=st.data())
@settings(max_examples=EXAMPLES, deadline=None)
def test_kl_from_topk_on_trainer_batches(drawn, layout, data):
    """``kl_from_topk``: the float64 formula (value and gradient; the well-conditioned
    estimators), the value's dtype, 0 value and gradient at left-out positions, garbage there
    (ids out of range or repeated, NaN log-probs and logits) never read, the two layouts agree."""
    case, topk, estimator, direction = drawn
    infinite = topk_infinite(case, topk, estimator, direction)
    reduction = "none" if bool(infinite.any()) else data.draw(st.sampled_from(REDUCTIONS))
    spec = Spec("topk", klest.kl_from_topk, kl_rows)  # weights drawn as for any function
    weights = draw_weights(data, spec, case, reduction, False)
    if reduction == "none":
        weights = replace(weights, value=weights.value.masked_fill(infinite, 0.0))
    budget_rows = data.draw(st.sampled_from((None, 1, 2, 3)), label="rows per chunk")
    what = f"topk {estimator} {direction} {case.dtype} {reduction} {layout}"
    w = weights_in_layout(weights, case, reduction, layout)

    def call(**kw):
        return run_topk(case, topk, estimator, direction, reduction=reduction, weights=w,
                        layout=layout, budget_rows=budget_rows, **kw)  # fmt: skip

    out = call()
    keep = case.keep if layout == "right" else to_left(case.keep, case)
    assert out.value.dtype == compute_dtype(case.dtype), f"{what}: dtype {out.value.dtype}"
    assert out.grads["z"].dtype == case.dtype, f"{what}: gradient dtype"
    assert_zero_where_left_out(out, keep, reduction, what)
    assert_same(out, call(garbage=False), f"{what}: garbage vs zeros")
    if estimator in TOPK_FORMULAS:
        z = arguments(case, layout=layout).z.detach().double()
        values, tol, grad, grad_tol = topk_reference(
            case, topk, estimator, direction, keep, z, w, reduction
        )
        want = reduce_by_hand(values, keep, reduction)
        bound = reduce_by_hand(tol, keep, reduction) + 64 * unit_roundoff(
            case.dtype
        ) * reduce_by_hand(finite_or_zero(values).abs(), keep, reduction)
        assert_within(out.value, want, bound, f"{what}: value")
        assert_within(out.grads["z"], grad, grad_tol, f"{what}: gradient")
    if case.sequences and layout == "left":
        right = run_topk(case, topk, estimator, direction, reduction=reduction, weights=weights,
                         budget_rows=budget_rows)  # fmt: skip
        unrolled = Out(
            to_right(out.value, case) if reduction == "none" else out.value, None, None, None,
            {"z": to_right(out.grads["z"], case)},
        )  # fmt: skip
        assert_reordered(unrolled, right, case.dtype, f"{what}: left vs right")


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_truncated_topk_with_a_zero_student_probability_in_the_set(direction):
    """Found by the property test above: with ``-inf`` in the student's logits at a top-k token,
    the renormalized student over S is ``[1, 0]`` whatever the other logits, so the truncated
    KL(pi||ref) is constant (gradient 0); its gradient counted the -inf entry as log-prob 0."""
    z = torch.tensor([[0.7705, -0.1467, -1.0894, -INF]], dtype=torch.float64, requires_grad=True)
    ids, logp = torch.tensor([[0, 3]]), torch.tensor([[-0.7748, -1.2611]], dtype=torch.float64)
    value = klest.kl_from_topk(z, ids, logp, estimator="truncated", direction=direction)
    b = logp - logp.logsumexp(-1, keepdim=True)
    if direction == "ref||pi":  # the teacher has mass where the renormalized student has none
        assert float(value) == INF
        return
    assert abs(float(value) + float(b[0, 0])) <= 1e-15
    (grad,) = torch.autograd.grad(value, z)
    assert not bool(grad.any()), grad
