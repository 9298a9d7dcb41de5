"""Generalized JSD, skew KL and total variation from logits against a float64 reference.

The reference (:func:`divergences_reference`) is the textbook formula in probability space:
``softmax`` in float64, ``sum x log(x / w)`` with ``0 log 0 = 0``, the mixture formed as
``beta p + (1 - beta) q``, ``|q - p|`` summed. Nothing of klest's is used in it.

Tolerances. Values: ``VALUE_ULPS`` roundings (float64, or float32 for any other input dtype) of
the row's logit scale (:func:`tests._tolerance.logit_scale`, as for ``kl_from_logits``); bf16 /
fp16 inputs are upcast unchanged for the reference, so only arithmetic differs. Gradients:
float64 by ``gradcheck``; float32 within ``1e-5 max|ref|`` plus half an ulp of the input dtype.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

from klest.logits import (
    jsd_from_logits,
    kl_from_logits,
    skew_kl_from_logits,
    tv_from_logits,
)
from klest.logits._stats import Divergence
from klest.logits.kernels import (
    divergence_backward,
    divergence_forward,
    divergence_fused,
    triton_available,
)
from tests._reference import assert_verbose_close, reduce_reference
from tests._tolerance import assert_close_to_rounding, assert_logits_values_close

INF = math.inf
BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
HALF_ULP = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11}
HALF_ULP[torch.bfloat16] = 2.0**-8
VALUE_ULPS = 16
"""A divergence from a row's logits: the log-softmax (and the mixture's log) rounds each entry at
the row's logit scale, and the sum over V adds about sqrt(V) <= 16 roundings of terms that size.
Measured worst case over this file: 0.4."""


def _xlogx_over(x, w):
    """``sum x log(x / w)`` over the last dim, ``0 log 0 = 0`` (``+inf`` where only w is 0)."""
    terms = torch.where(x > 0, x * (torch.log(x) - torch.log(w)), torch.zeros_like(x))
    return terms.sum(-1)


def divergences_reference(z, y, *, temperature=1.0, beta=0.5, alpha=0.5):
    """Float64 per-position values ``{"jsd", "skew_pi", "skew_ref", "tv", "kl_pi_ref",
    "kl_ref_pi"}`` from the definitions, with TRL's beta = 0 / 1 ends (the KLs)."""
    q = torch.softmax(z.double() / temperature, -1)
    p = torch.softmax(y.double() / temperature, -1)
    m = beta * p + (1 - beta) * q
    jsd = beta * _xlogx_over(p, m) + (1 - beta) * _xlogx_over(q, m)
    if beta == 0:
        jsd = _xlogx_over(p, q)
    elif beta == 1:
        jsd = _xlogx_over(q, p)
    return {
        "jsd": jsd,
        "skew_pi": _xlogx_over(q, alpha * q + (1 - alpha) * p),
        "skew_ref": _xlogx_over(p, alpha * p + (1 - alpha) * q),
        "tv": 0.5 * (q - p).abs().sum(-1),
        "kl_pi_ref": _xlogx_over(q, p),
        "kl_ref_pi": _xlogx_over(p, q),
    }


def _call(name, z, y, **kw):
    """The klest function for a reference key, with the key's options."""
    beta, alpha = kw.pop("beta", 0.5), kw.pop("alpha", 0.5)
    if name == "jsd":
        return jsd_from_logits(z, y, beta=beta, **kw)
    if name == "tv":
        return tv_from_logits(z, y, **kw)
    direction = "pi||ref" if name == "skew_pi" else "ref||pi"
    return skew_kl_from_logits(z, y, alpha=alpha, direction=direction, **kw)


NAMES = ("jsd", "skew_pi", "skew_ref", "tv")


def _logits(shape, dtype=torch.float64, scale=2.0, gen_seed=0):
    g = torch.Generator().manual_seed(gen_seed)
    z = (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    y = (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    return z, y


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 1), (2, 5, 257), (0, 9), (4, 0, 5)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_values_match_reference(name, shape, dtype):
    z, y = _logits(shape, dtype)
    for temperature, beta, alpha in ((1.0, 0.3, 0.2), (0.7, 0.5, 0.9), (2.0, 0.9, 0.5)):
        want = divergences_reference(z, y, temperature=temperature, beta=beta, alpha=alpha)[name]
        got = _call(
            name,
            z,
            y,
            beta=beta,
            alpha=alpha,
            temperature=temperature,
            reduction="none",
            chunk_size=2,
        )
        assert got.shape == shape[:-1]
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        what = f"{name} T={temperature}"
        assert_logits_values_close(
            got, want, z, y, ulps=VALUE_ULPS, temperature=temperature, what=what
        )


@pytest.mark.parametrize("beta", BETAS)
def test_jsd_ends_are_the_kls_and_symmetry(beta):
    z, y = _logits((4, 6, 33))
    ref = divergences_reference(z, y, beta=beta)
    got = jsd_from_logits(z, y, beta=beta, reduction="none")
    assert_verbose_close(got, ref["jsd"], atol=1e-12, rtol=1e-12)
    if beta in (0.0, 1.0):
        kl = ref["kl_ref_pi"] if beta == 0.0 else ref["kl_pi_ref"]
        assert_verbose_close(got, kl, atol=1e-12, rtol=1e-12, what="the KL at the end")
    else:  # JSD_beta(pi, ref) = JSD_{1-beta}(ref, pi): the two arguments swap roles
        swapped = jsd_from_logits(y, z, beta=1.0 - beta, reduction="none")
        assert_verbose_close(got, swapped, atol=1e-12, rtol=1e-12, what="symmetry")


def test_jsd_over_beta_one_minus_beta_tends_to_the_kls():
    z, y = _logits((3, 17))
    ref = divergences_reference(z, y)
    # JSD_beta = beta KL(ref||pi) + O(beta^2): relative error O(beta) at each end.
    for beta, kl in ((1e-6, ref["kl_ref_pi"]), (1 - 1e-6, ref["kl_pi_ref"])):
        got = jsd_from_logits(z, y, beta=beta, reduction="none") / (beta * (1 - beta))
        assert_verbose_close(got, kl, atol=0.0, rtol=1e-4, what=f"beta={beta}")
    # while the skew KL is continuous at alpha = 0
    small = skew_kl_from_logits(z, y, alpha=1e-9, reduction="none")
    assert_verbose_close(small, ref["kl_pi_ref"], atol=0.0, rtol=1e-6)


def test_bounds_and_disjoint_supports():
    z, y = _logits((64, 50), scale=30.0)  # nearly one-hot rows: near the upper bounds
    jsd = jsd_from_logits(z, y, beta=0.5, reduction="none")
    tv = tv_from_logits(z, y, reduction="none")
    assert bool((jsd >= 0).all() and (jsd <= math.log(2) + 1e-12).all())
    assert bool((tv >= 0).all() and (tv <= 1 + 1e-12).all())
    assert float(jsd.max()) > 0.6 and float(tv.max()) > 0.9  # the bounds are approached
    # disjoint supports: JSD_beta = h(beta) (binary entropy), TV = 1, skew KL = -log alpha
    za = torch.tensor([[0.0, 0.0, -INF, -INF]], dtype=torch.float64)
    ya = torch.tensor([[-INF, -INF, 1.0, 2.0]], dtype=torch.float64)
    for beta in (0.2, 0.5):
        h = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
        got = jsd_from_logits(za, ya, beta=beta, reduction="none")
        assert_verbose_close(got, torch.tensor([h], dtype=torch.float64), atol=1e-12)
    assert float(tv_from_logits(za, ya, reduction="none")) == pytest.approx(1.0, abs=1e-12)
    skew = skew_kl_from_logits(za, ya, alpha=0.25, direction="ref||pi", reduction="none")
    assert float(skew) == pytest.approx(-math.log(0.25), abs=1e-12)
    # identical distributions: everything 0
    assert float(jsd_from_logits(z, z, beta=0.3, reduction="sum")) == pytest.approx(0, abs=1e-12)
    assert float(tv_from_logits(z, z, reduction="sum")) == 0.0


def _masked_vocab():
    """Rows with -inf entries: shared, only in pi, only in ref, and disjoint-but-overlapping."""
    z, y = _logits((4, 6))
    z, y = z.clone(), y.clone()
    z[0, :2] = y[0, :2] = -INF
    z[1, 3] = -INF
    y[2, 0] = y[2, 5] = -INF
    z[3, :3] = -INF
    y[3, 3:] = -INF
    y[3, 2] = 0.5
    return z, y


@pytest.mark.parametrize("name", NAMES)
def test_minus_inf_logits_are_outside_the_support(name):
    z, y = _masked_vocab()
    want = divergences_reference(z, y, beta=0.3, alpha=0.2)[name]
    zz, yy = z.clone().requires_grad_(True), y.clone().requires_grad_(True)
    got = _call(name, zz, yy, beta=0.3, alpha=0.2, reduction="none")
    assert bool(torch.isfinite(got).all())
    assert_verbose_close(got, want, atol=1e-12, rtol=1e-12)
    got.sum().backward()
    for grad, logits in ((zz.grad, z), (yy.grad, y)):
        assert bool(torch.isfinite(grad).all())
        assert bool((grad[logits == -INF] == 0).all())
    # the gradient on the support: autograd of the reference with the -inf entries dropped
    for row in range(z.shape[0]):
        keep = (z[row] > -INF) | (y[row] > -INF)
        zr = z[row, keep].clone().requires_grad_(True)
        yr = y[row, keep].clone().requires_grad_(True)
        want_row = divergences_reference(zr, yr, beta=0.3, alpha=0.2)[name]
        if not torch.isfinite(want_row):
            continue
        dz, dy = torch.autograd.grad(want_row, (zr, yr))
        fz, fy = z[row, keep] > -INF, y[row, keep] > -INF
        assert_verbose_close(zz.grad[row, keep][fz], dz[fz], atol=1e-12, what=f"dz row {row}")
        assert_verbose_close(yy.grad[row, keep][fy], dy[fy], atol=1e-12, what=f"dy row {row}")


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_both_sides(name):
    z, y = _logits((2, 3, 6))
    z.requires_grad_(True)
    y.requires_grad_(True)
    mask = torch.tensor([[True, False, True], [True, True, True]])

    def f(z, y, stash=False):
        return _call(
            name, z, y, beta=0.3, alpha=0.4, temperature=1.3, mask=mask, chunk_size=2, stash=stash
        )

    assert torch.autograd.gradcheck(f, (z, y))
    # gradcheck backpropagates one graph several times, which needs the recomputing backward;
    # the gradient written in the forward pass (the default) matches it to float64 rounding
    # (8 ulps of the largest entry: the two paths round the same sums in other orders).
    got = torch.autograd.grad(f(z, y, stash=None), (z, y))
    want = torch.autograd.grad(f(z, y), (z, y))
    for a, e in zip(got, want, strict=True):
        assert_close_to_rounding(a, e, ulps=8, what=f"{name} gradient in the forward")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_gradients(name, dtype):
    z, y = _logits((5, 129), dtype)
    zz, yy = z.clone().requires_grad_(True), y.clone().requires_grad_(True)
    g = torch.linspace(-1.0, 2.0, 5, dtype=torch.float64)
    (_call(name, zz, yy, reduction="none", temperature=0.8).double() * g).sum().backward()
    z64, y64 = z.double().requires_grad_(True), y.double().requires_grad_(True)
    want = divergences_reference(z64, y64, temperature=0.8)[name]
    dz, dy = torch.autograd.grad((want * g).sum(), (z64, y64))
    for got, ref, t in ((zz.grad, dz, z), (yy.grad, dy, y)):
        assert got.dtype == t.dtype
        atol = 1e-5 * ref.abs().max() + HALF_ULP[dtype] * ref.abs()
        assert_verbose_close(got.double(), ref, atol=atol, what=f"{name} grad {dtype}")


@pytest.mark.parametrize(
    "reduction",
    ["none", "per-sequence", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "sum"],
)
def test_mask_labels_and_reductions(reduction):
    z, y = _logits((3, 5, 11))
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    labels = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    labels[2, 4] = -100  # an ignored label masks its position too
    keep = mask & (labels != -100)
    per_pos = divergences_reference(z, y, beta=0.7)["jsd"]
    z[~keep] = torch.nan  # masked positions are never read
    got = jsd_from_logits(z, y, beta=0.7, mask=mask, labels=labels, reduction=reduction)
    if reduction == "none":
        want = torch.where(keep, per_pos, 0.0)
        assert_verbose_close(got, want, atol=1e-12)
    elif reduction == "per-sequence":
        want = [reduce_reference(per_pos[i : i + 1], keep[i : i + 1], "sum") for i in range(3)]
        assert_verbose_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    else:
        want = reduce_reference(per_pos, keep, reduction)
        assert float(got) == pytest.approx(want, abs=1e-12)


def test_details_and_left_padding():
    z, y = _logits((2, 4, 9))
    labels = torch.tensor([[-100, -100, 3, 4], [1, 2, 3, -100]])
    out, details = jsd_from_logits(z, y, beta=0.4, labels=labels, return_details=True)
    logq = torch.log_softmax(z, -1)
    keep = labels != -100
    idx = labels.clamp(min=0).unsqueeze(-1)
    assert_verbose_close(details.logp[keep], logq.gather(-1, idx).squeeze(-1)[keep], atol=1e-12)
    entropy = -(logq.exp() * logq).sum(-1)
    assert_verbose_close(details.entropy[keep], entropy[keep], atol=1e-12)
    per_pos = divergences_reference(z, y, beta=0.4)["jsd"]
    assert float(out) == pytest.approx(reduce_reference(per_pos, keep, "seq-mean-token-sum"))


def _trl_jsd():
    pytest.importorskip("trl")
    with warnings.catch_warnings():  # trl.experimental warns on import
        warnings.simplefilter("ignore")
        from trl.experimental.gkd import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_equals_trl_generalized_jsd_loss(temperature):
    trl_jsd = _trl_jsd()
    z, y = _logits((2, 6, 23), torch.float32)
    labels = torch.randint(0, 23, (2, 6), generator=torch.Generator().manual_seed(2))
    labels[0, :2] = labels[1, 5] = -100
    for beta in (0.0, 0.1, 0.5, 0.75, 1.0):
        want = trl_jsd(z, y, labels=labels, beta=beta, temperature=temperature)
        got = jsd_from_logits(
            z, y, beta=beta, labels=labels, temperature=temperature, reduction="token-mean"
        )
        # two float32 computations: twice the rounding of one
        ulps, t = 2 * VALUE_ULPS, temperature
        assert_logits_values_close(got, want, z, y, ulps=ulps, temperature=t, what=f"{beta}")
        # without labels TRL's "batchmean" divides the sum by the batch size: 6 positions a row
        want = trl_jsd(z, y, beta=beta, temperature=temperature)
        got = jsd_from_logits(z, y, beta=beta, temperature=temperature)
        assert_logits_values_close(
            got, want, z, y, ulps=ulps, temperature=t, terms=6, what=f"batchmean {beta}"
        )


def test_gradient_matches_trl_autograd():
    trl_jsd = _trl_jsd()
    z, y = _logits((2, 5, 13))
    for beta in (0.2, 0.5):
        grads = []
        for fn in (trl_jsd, lambda a, b, **kw: jsd_from_logits(a, b, **kw)):
            zz, yy = z.clone().requires_grad_(True), y.clone().requires_grad_(True)
            grads.append(torch.autograd.grad(fn(zz, yy, beta=beta, temperature=1.5), (zz, yy)))
        for got, want in zip(grads[1], grads[0], strict=True):
            assert_verbose_close(got, want, atol=1e-12)


def test_float32_accuracy_at_llm_vocabulary():
    """V = 32000: relative error of the float32 path against float64, no worse than 4x that of
    ``kl_from_logits`` on the same rows (measured: JSD ~1e-6 relative, KL ~1e-6)."""
    z, y = _logits((4, 32000), torch.float32, scale=3.0)
    rel = {}
    for name, fn in (
        ("jsd", lambda a, b: jsd_from_logits(a, b, beta=0.5, reduction="none")),
        ("tv", lambda a, b: tv_from_logits(a, b, reduction="none")),
        ("kl", lambda a, b: kl_from_logits(a, b, reduction="none")),
    ):
        exact = fn(z.double(), y.double())
        rel[name] = float(((fn(z, y).double() - exact).abs() / exact).max())
    assert rel["jsd"] < max(4 * rel["kl"], 1e-6), rel
    assert rel["tv"] < max(4 * rel["kl"], 1e-6), rel


def test_gradient_to_masked_rows_is_zero_and_empty_rows_work():
    z, y = _logits((2, 3, 8))
    z.requires_grad_(True)
    mask = torch.tensor([[False, False, False], [True, False, True]])
    out = jsd_from_logits(z, y, beta=0.5, mask=mask, reduction="seq-mean-token-mean")
    out.backward()
    assert bool((z.grad[~mask] == 0).all()) and bool((z.grad[mask] != 0).any())
    empty = jsd_from_logits(z, y, beta=0.5, mask=torch.zeros(2, 3, dtype=torch.bool))
    assert float(empty.detach()) == 0.0


def test_bad_input():
    z, y = _logits((2, 5))
    for beta in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="beta"):
            jsd_from_logits(z, y, beta=beta)
    with pytest.raises(TypeError, match="beta"):
        jsd_from_logits(z, y, beta=True)
    with pytest.raises(ValueError, match="alpha"):
        skew_kl_from_logits(z, y, alpha=1.0)
    with pytest.raises(ValueError, match="backend"):
        tv_from_logits(z, y, backend="cuda")
    bad = z.clone()
    bad[1, 2] = torch.nan
    with pytest.raises(ValueError, match="logits has 1 row"):
        jsd_from_logits(bad, y, beta=0.5)
    with pytest.raises(ValueError, match="shape"):
        jsd_from_logits(z, y[:, :4], beta=0.5)
    with pytest.raises(ValueError, match="direction"):
        skew_kl_from_logits(z, y, alpha=0.5, direction="forward")


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="needs triton with CUDA or TRITON_INTERPRET=1 (make test sets it)",
)
KERNEL_DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


@needs_triton
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(name, dtype):
    """The Triton kernels (float32 arithmetic): values within ``VALUE_ULPS`` roundings of the
    row's logit scale of the reference, gradients within 1e-5 max|ref| plus half an ulp of the
    input dtype of the float64 PyTorch path's; -inf entries and a masked NaN row included."""
    z, y = _masked_vocab()
    z, y = torch.cat([z, 2 * z.nan_to_num(neginf=-3.0)]), torch.cat([y, y.flip(0)])
    z, y = z.to(dtype), y.to(dtype)
    mask = torch.ones(z.shape[0], dtype=torch.bool)
    mask[5] = False
    z[5, 1] = torch.nan  # never read
    kw = dict(beta=0.3, alpha=0.2, temperature=1.3)
    want = divergences_reference(z.double(), y.double(), **kw)[name]
    want = torch.where(mask, want, 0.0)
    zz, yy = z.clone().requires_grad_(True), y.clone().requires_grad_(True)
    g = torch.linspace(0.5, 2.0, z.shape[0], dtype=torch.float64)
    got = _call(name, zz, yy, mask=mask, reduction="none", backend="triton", **kw)
    assert_logits_values_close(got, want, z, y, ulps=VALUE_ULPS, temperature=1.3)
    (got.double() * g).sum().backward()
    # gradients: the PyTorch path in float64 (tested against the reference above, -inf rows
    # included), on the same inputs
    z64, y64 = z.double().requires_grad_(True), y.double().requires_grad_(True)
    ref_value = _call(name, z64, y64, mask=mask, reduction="none", backend="torch", **kw)
    dz, dy = torch.autograd.grad((ref_value * g).sum(), (z64, y64))
    # Triton's interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest): a whole ulp.
    rounding = 2 * HALF_ULP[dtype] if INTERPRET and dtype == torch.bfloat16 else HALF_ULP[dtype]
    for got_g, ref in ((zz.grad, dz), (yy.grad, dy)):
        assert bool(torch.isfinite(got_g).all())
        atol = 1e-5 * ref.abs().max() + rounding * ref.abs()
        assert_verbose_close(got_g.double(), ref, atol=atol, what=f"{name} {dtype}")


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked lanes
@pytest.mark.parametrize("div", [Divergence("mixture", w=0.3, c_q=0.3, c_p=0.7), Divergence("tv")])
def test_kernel_rows_not_kept_are_not_read_and_get_zeros(div):
    """``keep``: rows flagged False may hold anything; they get zeros, the kept rows exactly what
    they get without the flags."""
    g = torch.Generator().manual_seed(5)
    z, y = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    keep = torch.tensor([True, False, True, False, True])
    z, y, keep = (t.to(KERNEL_DEVICE) for t in (z, y, keep))
    bad_z, bad_y = z.clone(), y.clone()
    bad_z[1], bad_y[3] = torch.nan, torch.inf
    lse = z.logsumexp(-1), y.logsumexp(-1)
    full = divergence_forward(z, y, *lse, div)
    kept_lse = (torch.where(keep, t, 0.0) for t in lse)  # what kl_logits_forward gives them
    part = divergence_forward(bad_z, bad_y, *kept_lse, div, keep=keep)
    assert torch.equal(part, torch.where(keep, full, 0.0))
    grad = torch.linspace(0.5, 1.5, 5, device=KERNEL_DEVICE)
    dz, dy = divergence_backward(z, y, *lse, full[1], full[2], grad, div, need_grad_y=True)
    dz2, dy2 = divergence_backward(
        bad_z, bad_y, *lse, part[1], part[2], grad, div, need_grad_y=True, keep=keep
    )
    assert torch.equal(dz2, dz * keep[:, None]) and torch.equal(dy2, dy * keep[:, None])


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked lanes
@pytest.mark.parametrize("div", [Divergence("mixture", w=0.3, c_q=0.3, c_p=0.7), Divergence("tv")])
@pytest.mark.parametrize("block_v", [None, 64], ids=["one-block", "blocks"])
def test_fused_kernel_matches_reference(div, block_v):
    """``divergence_fused`` (values and gradients in one launch, the gradient written over ``z``,
    rows over 2 programs; a row of 157 read once, or in blocks of 64 three times) against the
    float64 definition (``c_q KL(q||m) + c_p KL(p||m)``, ``m = w p + (1 - w) q``; TV
    ``sum |q - p| / 2``). Values: ``VALUE_ULPS`` roundings of the row's logit scale. Gradients
    ``g/tau x (G - S)`` cancel at the size of their terms, ``|g|/tau (q + p)(1 + |log q| +
    |log p|)`` per entry: 64 float32 roundings of that (a sum over V = 157 in another order,
    about sqrt(V) = 13, times 5), plus half an ulp of the result."""
    g = torch.Generator().manual_seed(8)
    z, y = torch.randn(5, 157, generator=g) * 3, torch.randn(5, 157, generator=g) * 3
    grad = torch.linspace(-1.0, 2.0, 5)
    tau = 0.8
    zc, y_dev, grad_dev = (t.to(KERNEL_DEVICE) for t in (z.clone(), y, grad))
    _, mix, dz, dy = divergence_fused(
        zc, y_dev, grad_dev, div, temperature=tau, need_grad_y=True, dz=zc, block_v=block_v,
        programs=2,
    )  # fmt: skip
    mix, dz, dy = mix.cpu(), dz.cpu(), dy.cpu()
    assert dz is zc
    z64, y64 = z.double().requires_grad_(True), y.double().requires_grad_(True)
    q, p = torch.softmax(z64 / tau, -1), torch.softmax(y64 / tau, -1)
    if div.kind == "tv":
        want = 0.5 * (q - p).abs().sum(-1)
    else:
        m = div.w * p + (1 - div.w) * q
        want = div.c_q * _xlogx_over(q, m) + div.c_p * _xlogx_over(p, m)
    assert_logits_values_close(mix[0], want, z, y, ulps=VALUE_ULPS, temperature=tau)
    rz, ry = torch.autograd.grad((want * grad.double()).sum(), (z64, y64))
    q, p = q.detach(), p.detach()
    terms = (q + p) * (1 + q.log().abs() + p.log().abs()) * grad.double().abs()[:, None] / tau
    for got_g, ref in ((dz, rz), (dy, ry)):
        atol = 64 * 2.0**-24 * terms + HALF_ULP[torch.float32] * ref.abs()
        assert_verbose_close(got_g.double(), ref, atol=atol, what=f"{div.kind} {block_v}")
