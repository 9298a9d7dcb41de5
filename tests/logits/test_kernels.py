"""Triton KL-from-logits kernels against a float64 PyTorch reference (forward and backward).

Without a GPU the kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set below when CUDA
is absent, and by CI): same kernel code, CPU tensors, so sizes are kept small. A separate test
compiles both kernels for sm_90 to catch what the interpreter accepts but the GPU compiler does not.

Tolerances. The reference gets the very same (already rounded) bf16/fp16 inputs, upcast to
float64, so input rounding is not an error; what remains is
  * float32 arithmetic in the kernel: forward values (a row's log-sum-exps, its KLs, entropy and
    label log-probs) round at the size of what the row combines, its logits over the temperature
    and its log-sum-exps: :func:`tests._tolerance.logit_scale`. A few roundings at that scale
    and about sqrt(V) <= 16 in the sums over V: within ``FWD_ULPS = 16`` float32 roundings of it
    (measured worst case over this file: 1.9);
  * for gradients, float32 arithmetic, which for terms like ``q (log q - log p - KL)`` is relative
    to the size of the row's gradient rather than to each entry (measured <= 1.8e-6 of
    ``max |grad|``, hence ``1e-5 max |ref|``), plus the rounding of the result to the output
    dtype: half an ulp on a GPU (2^-24, 2^-11, 2^-8 relative for fp32 / fp16 / bf16), but a whole
    ulp for bf16 under the interpreter, which truncates float32 -> bfloat16 (measured 7.45e-3
    relative against a 2^-7 = 7.8e-3 bound). So ``|d - ref| <= rtol(dtype) |ref| + 1e-5 max|ref|``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON and not torch.cuda.is_available():
    # Must happen before the kernels are decorated (they are imported lazily, on first use).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import klest  # noqa: E402
from klest.logits.kernels import (  # noqa: E402
    KLRowStats,
    kl_logits_backward,
    kl_logits_forward,
    kl_logits_fused,
    triton_available,
)
from tests._reference import assert_verbose_close as assert_close  # noqa: E402
from tests._reference import logits_reference as reference  # noqa: E402
from tests._reference import reference_grads  # noqa: E402
from tests._tolerance import logit_scale, rounding_tolerance  # noqa: E402

needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton)"
)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
INF = math.inf

FWD_ULPS = 16
# Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest): a full ulp there.
BF16_ROUNDING = 2.0**-7 if INTERPRET else 2.0**-8
GRAD_RTOL = {
    torch.float32: 1e-5,
    torch.float16: 2.0**-11 + 1e-5,
    torch.bfloat16: BF16_ROUNDING + 1e-5,
}
GRAD_ATOL_FRAC = 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FIELDS = KLRowStats._fields
GRAD_NAMES = (
    "grad_kl_pi_ref",
    "grad_kl_ref_pi",
    "grad_entropy",
    "grad_logp_label",
    "grad_logp_ref_label",
)

# The interpreter evaluates the kernels' masked lanes too (e.g. -inf - -inf, or a coefficient times
# the float32 maximum standing in for +inf), all selected away afterwards; numpy warns.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


# ----------------------------------------------------------------------------- helpers
# The float64 reference and the verbose assert are tests/_reference.py's.


def logits(n, v, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    y = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    return z, y


def to_dev(*ts):
    return tuple(None if t is None else t.to(DEV) for t in ts)


def forward_tol(z, y, tau=1.0, ulps=FWD_ULPS):
    """``ulps`` float32 roundings of each row's :func:`logit_scale`."""
    return rounding_tolerance(
        z, ulps=ulps, dtype=torch.float32, scale=logit_scale(z, y, temperature=tau)
    )


def check_forward(stats, ref, tol, what=""):
    for name in FIELDS:
        got = getattr(stats, name)
        assert got.dtype == torch.float32 and got.shape == ref[name].shape, name
        assert_close(got, ref[name], atol=tol, what=f"{what} {name}")


def check_grad(got, want, dtype, what):
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    scale = float(want.abs().max())
    assert_close(got, want, atol=GRAD_ATOL_FRAC * scale, rtol=GRAD_RTOL[dtype], what=what)


# ----------------------------------------------------------------------------- availability


def test_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import klest.logits.kernels as k\n"
        "assert not k.triton_available()\n"
        "import torch\n"
        "try:\n"
        "    k.kl_logits_forward(torch.zeros(1, 2), torch.zeros(1, 2))\n"
        "except RuntimeError as e:\n"
        "    assert 'needs triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error without triton')\n"
        # No rows: nothing to launch, so no triton needed (the empty results, at once).
        "from klest.logits._stats import Divergence\n"
        "e, r = torch.zeros(0, 5), torch.zeros(0)\n"
        "assert k.kl_logits_forward(e, e).lse_z.shape == (0,)\n"
        "assert k.divergence_forward(e, e, r, r, Divergence('tv')).shape == (3, 0)\n"
        "dz, dy = k.divergence_backward(e, e, r, r, r, r, r, Divergence('tv'), need_grad_y=True)\n"
        "assert dz.shape == dy.shape == (0, 5)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = os.path.join(os.path.dirname(klest.__file__), os.pardir)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@needs_triton
def test_triton_available():
    assert triton_available()


# ----------------------------------------------------------------------------- forward

SHAPES = [(1, 1), (1, 64), (3, 37), (2, 64), (4, 200), (5, 129)]  # with BLOCK_V = 64


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tau", [1.0, 0.7, 2.0])
def test_forward_matches_reference(shape, dtype, tau):
    n, v = shape
    z, y = logits(n, v, dtype, seed=n * 1000 + v)
    labels = torch.arange(n) * 7 % v
    stats = kl_logits_forward(*to_dev(z, y), temperature=tau, labels=labels.to(DEV), block_v=64)
    tol = forward_tol(z, y, tau)
    check_forward(stats, reference(z, y, tau, labels), tol, f"{shape} {dtype} tau={tau}")


@needs_triton
@pytest.mark.parametrize("block_v", [16, 32, None])
def test_forward_block_sizes_and_mixed_dtypes(block_v):
    z, y = logits(3, 101, torch.float32, seed=7)
    z = z.to(torch.bfloat16)  # z and y in different dtypes
    stats = kl_logits_forward(*to_dev(z, y), temperature=0.7, block_v=block_v)
    check_forward(stats, reference(z, y, 0.7), forward_tol(z, y, 0.7), f"block_v={block_v}")


@needs_triton
def test_forward_agrees_with_categorical_kl():
    z, y = logits(3, 150, torch.float32, seed=3)
    stats = kl_logits_forward(*to_dev(z, y), block_v=64)
    for got, direction in ((stats.kl_pi_ref, "pi||ref"), (stats.kl_ref_pi, "ref||pi")):
        want = klest.categorical_kl(z.double(), y.double(), direction=direction, reduction="none")
        assert_close(got, want, atol=forward_tol(z, y), what=direction)


@needs_triton
def test_forward_strided_rows():
    big_z, big_y = logits(4, 300, torch.float32, seed=11)
    z, y = big_z[::2, 10:210], big_y[1::2, 50:250]  # row strides 600 and 600, offsets
    assert not z.is_contiguous()
    stats = kl_logits_forward(*to_dev(z, y), block_v=64)
    check_forward(stats, reference(z, y), forward_tol(z, y), "strided")
    zt = big_z[:, :200].t().contiguous().t()  # column-major: made contiguous internally
    stats = kl_logits_forward(*to_dev(zt, big_y[:, :200]), block_v=64)
    ref = reference(zt, big_y[:, :200])
    check_forward(stats, ref, forward_tol(zt, big_y[:, :200]), "column-major")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_identical_inputs_give_exactly_zero(dtype):
    z, _ = logits(4, 200, dtype, seed=5)
    z[1, 3:150] = -INF
    stats = kl_logits_forward(*to_dev(z, z.clone()), temperature=0.7, block_v=64)
    assert (stats.kl_pi_ref == 0).all() and (stats.kl_ref_pi == 0).all()
    # The same values in another dtype are the same float32 numbers after the upcast.
    stats = kl_logits_forward(*to_dev(z, z.float()), block_v=64)
    assert (stats.kl_pi_ref == 0).all() and (stats.kl_ref_pi == 0).all()


@needs_triton
def test_invariant_to_a_per_row_shift():
    z, y = logits(3, 200, torch.float32, seed=9)
    shift = torch.tensor([[-50.0], [0.5], [80.0]])
    s0 = kl_logits_forward(*to_dev(z, y), block_v=64)
    s1 = kl_logits_forward(*to_dev(z + shift, y - shift), block_v=64)
    for name in ("kl_pi_ref", "kl_ref_pi", "entropy"):
        # |shift| <= 80: the shifted logits carry float32 rounding at their scale (the shifted
        # rows' logit scale); two computations, twice the rounding of one.
        tol = forward_tol(z + shift, y - shift, ulps=2 * FWD_ULPS)
        assert_close(getattr(s1, name), getattr(s0, name), atol=tol, what=name)


@needs_triton
def test_large_logit_ranges_do_not_overflow():
    # |logits| up to ~1e4 and a maximum that grows block after block, so
    # the running sums are rescaled by factors that underflow to 0.
    z, y = logits(3, 256, torch.float32, seed=13, scale=2000.0)
    z[0] = torch.linspace(-1e4, 1e4, 256)
    y[1] = torch.linspace(1e4, -1e4, 256)
    z[2, :128], y[2, :128] = z[2, :128] / 1000, y[2, :128] / 1000
    stats = kl_logits_forward(*to_dev(z, y), temperature=0.7, block_v=64)
    check_forward(stats, reference(z, y, 0.7), forward_tol(z, y, 0.7), "large logits")


@needs_triton
@pytest.mark.parametrize("jump", [0.0, 20.0, 60.0, 85.0, 90.0, 300.0])
def test_maximum_far_above_the_first_block(jump):
    """The fast loop's offset is the first block's maximum: a later maximum up to ~87 nats above it
    keeps the fast loop (terms up to 2^126); more overflows and the row is redone carefully. Both
    must give the reference, for pi's and ref's logits, in the main loop and the partial block."""
    z, y = logits(4, 200, torch.float32, seed=19)
    z[0, 100] += jump  # a full block after the first
    y[1, 70] += jump
    z[2, 199] += jump  # the partial last block
    y[2, 198] += jump
    z[3, 64:] += jump  # everything after the first block
    stats = kl_logits_forward(*to_dev(z, y), block_v=64)
    # The offset can sit up to ~126 log2 units below the maximum; the sums' float32 logs then
    # carry ~126 * 2^-24 ~ 1e-5 of rounding (scaled by ln 2): within the tolerance at the
    # rows' logit scale (>= 20).
    check_forward(stats, reference(z, y), forward_tol(z, y), f"jump {jump}")


@needs_triton
@pytest.mark.parametrize(("ab", "ba"), [(True, False), (False, True), (True, True)])
def test_which_rows_leave_the_fast_loop(ab, ba):
    """The fast loop must hold for ordinary rows; its clamped re-read for a -inf mask shared by both
    logits (a masked vocabulary) or on the side whose KL is not wanted; the careful loop must take
    the rest: one side's -inf against the other's finite logit where that makes a wanted KL +inf,
    NaN / +inf entries, a first block of only -inf, a maximum beyond the exp2 range. Results
    equal the reference either way."""
    z, y = logits(9, 200, torch.float32, seed=29)
    z[1, 5:190:3] = y[1, 5:190:3] = -INF  # shared mask
    z[2, 150] = -INF  # pi forbids a token ref allows: KL(ref||pi) = +inf, KL(pi||ref) finite
    y[3, 70] = -INF  # ref forbids a token pi allows: KL(pi||ref) = +inf
    z[4, 100] = math.nan
    y[5, 199] = INF
    z[6, :64] = y[6, :64] = -INF  # the first block, shared
    z[7, 120] = 200.0  # 2^(200 log2 e) overflows float32
    y[8, 64:] = y[8, 64:] + 30.0  # a late maximum well inside the range
    careful = torch.full((9,), -1, dtype=torch.int32, device=DEV)
    stats = kl_logits_forward(
        *to_dev(z, y), want_kl_pi_ref=ab, want_kl_ref_pi=ba, block_v=64, careful_rows=careful
    )
    # 0: fast loop; 1: fast loop with -inf clamped (a second read); 2: careful loop (a third).
    expected = [0, 1, 1 + int(ba), 1 + int(ab), 2, 2, 2, 2, 0]
    assert careful.cpu().tolist() == expected
    ref = reference(z, y)
    keep = torch.tensor([i not in (4, 5) for i in range(9)])  # NaN rows: the caller's to reject
    for name, wanted in (("lse_z", True), ("lse_y", True), ("kl_pi_ref", ab), ("kl_ref_pi", ba)):
        if wanted:
            got = getattr(stats, name).cpu()[keep]
            assert_close(got, ref[name][keep], atol=forward_tol(z, y)[keep], what=name)
    assert stats.lse_z[4].isnan() and stats.lse_y[5].isnan()


@needs_triton
@pytest.mark.parametrize("gap", [10.0, 40.0, 80.0])
def test_entropy_rounding_grows_with_the_gap_to_the_first_block(gap):
    """The fast loop's entropy is lg s - w / s with both terms about the gap G (log2 units)
    between the row's maximum and the first block's: float32 leaves an absolute error of a few
    G 2^-24 (the module docstring's bound, 8 (G + log2 V) 2^-24 ln 2, is checked here on rows
    whose entropy is near 0, where the cancellation is total)."""
    z, _ = logits(4, 4096, torch.float32, seed=31)
    z[:, 3000] += gap  # one dominant token far above the first block
    z[1, 64:] += 0.5 * gap
    y = z + 0.01 * logits(4, 4096, torch.float32, seed=32)[0]
    stats = kl_logits_forward(*to_dev(z, y), block_v=1024)
    ref = reference(z, y)
    g_log2 = (z.max(1).values - z[:, :1024].max(1).values) * math.log2(math.e)
    bound = 8 * (g_log2 + math.log2(4096)) * 2.0**-24 * math.log(2)
    err = (stats.entropy.cpu().double() - ref["entropy"]).abs()
    assert (err <= bound.double()).all(), (err, bound)


WANTS = [(a, b, e) for a in (False, True) for b in (False, True) for e in (False, True)]


@needs_triton
@pytest.mark.parametrize(("ab", "ba", "ent"), WANTS)
def test_sums_not_wanted_are_zero_and_the_rest_unchanged(ab, ba, ent):
    """Each subset of the three sums, on rows that take the fast loop and rows that leave it
    (-inf entries, which must be caught whichever sums are accumulated, and a late maximum)."""
    z, y, _, _ = masked_rows(torch.float32)
    z2, y2 = logits(3, 200, torch.float32, seed=23)
    z2[2, 150] += 200.0
    z, y = torch.cat([z, z2]), torch.cat([y, y2])
    labels = torch.arange(len(z)) * 13 % 200
    stats = kl_logits_forward(
        *to_dev(z, y),
        labels=labels.to(DEV),
        want_kl_pi_ref=ab,
        want_kl_ref_pi=ba,
        want_entropy=ent,
        block_v=64,
    )
    ref = reference(z, y, labels=labels)
    wanted = {"kl_pi_ref": ab, "kl_ref_pi": ba, "entropy": ent}
    for name in FIELDS:
        got = getattr(stats, name)
        if wanted.get(name, True):
            assert_close(got, ref[name], atol=forward_tol(z, y), what=name)
        else:
            assert (got == 0).all(), name


# ----------------------------------------------------------------------------- -inf support


def masked_rows(dtype):
    """Rows whose -inf patterns cover each case; returns z, y and the expected infinite KLs."""
    z, y = logits(7, 200, torch.float32, seed=17)
    z[0, 5:190] = y[0, 5:190] = -INF  # a shared mask, including whole blocks
    z[1, :150] = y[1, :150] = -INF  # the first blocks entirely -inf (running max starts at -inf)
    z[2, 40:] = -INF  # pi's support inside ref's: KL(pi||ref) finite, KL(ref||pi) = +inf
    y[3, ::3] = -INF  # ref misses some of pi's support: KL(pi||ref) = +inf
    z[4, 199] = -INF  # a single -inf in the last, partial block: KL(ref||pi) = +inf
    y[4, :64] = -INF  # and a whole block of ref: KL(pi||ref) = +inf
    z[5, 100:] = -INF  # disjoint supports: both KLs +inf
    y[5, :100] = -INF
    z[6, 10] = -30.0  # an entry with far-below-max mass where ref has none: still +inf
    z[6, 11:] = z[6, 11:] + 100.0
    y[6, 10] = -INF
    inf_ab = torch.tensor([False, False, False, True, True, True, True])
    inf_ba = torch.tensor([False, False, True, False, True, True, False])
    return z.to(dtype), y.to(dtype), inf_ab, inf_ba


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_forward(dtype):
    z, y, inf_ab, inf_ba = masked_rows(dtype)
    labels = torch.tensor([3, 0, 100, 3, 199, 150, 10])  # rows 1, 2, 4, 5 hit -inf under pi
    stats = kl_logits_forward(*to_dev(z, y), temperature=0.7, labels=labels.to(DEV), block_v=64)
    ref = reference(z, y, 0.7, labels)
    check_forward(stats, ref, forward_tol(z, y, 0.7), f"-inf {dtype}")
    assert torch.equal(torch.isinf(stats.kl_pi_ref).cpu(), inf_ab)
    assert torch.equal(torch.isinf(stats.kl_ref_pi).cpu(), inf_ba)
    assert torch.equal(stats.logp_label.isinf().cpu(), torch.tensor([0, 1, 1, 0, 1, 1, 0]).bool())
    for name in FIELDS:
        assert not getattr(stats, name).isnan().any(), name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_minus_inf_backward(dtype):
    """Finite terms' gradients are exact; an infinite KL with upstream gradient 0 adds nothing."""
    z, y, inf_ab, inf_ba = masked_rows(dtype)
    labels = torch.tensor([3, 160, 1, 4, 100, -100, 11])  # on both supports, or ignored
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, generator=g) for _ in range(5)]
    grads[0] = torch.where(inf_ab, 0.0, grads[0])
    grads[1] = torch.where(inf_ba, 0.0, grads[1])
    stats = kl_logits_forward(*to_dev(z, y), temperature=0.7, labels=labels.to(DEV), block_v=64)
    dz, dy = kl_logits_backward(
        *to_dev(z, y),
        stats,
        temperature=0.7,
        labels=labels.to(DEV),
        **dict(zip(GRAD_NAMES, to_dev(*grads), strict=True)),
        need_grad_y=True,
        block_v=64,
    )
    rz, ry = reference_grads(z, y, 0.7, labels, grads)
    check_grad(dz, rz, dtype, "dz with -inf")
    check_grad(dy, ry, dtype, "dy with -inf")
    # Outside pi's support the z-gradient is exactly 0 (no mass, no label there); likewise y.
    assert (dz.cpu()[z == -INF] == 0).all()
    assert (dy.cpu()[y == -INF] == 0).all()


# ----------------------------------------------------------------------------- backward

TERMS = {
    "kl_pi_ref": (0,),
    "kl_ref_pi": (1,),
    "entropy": (2,),
    "logp_label": (3,),
    "logp_ref_label": (4,),
    "all": (0, 1, 2, 3, 4),
}


@needs_triton
@pytest.mark.parametrize("term", list(TERMS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (4, 157)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_backward_each_term(term, dtype, shape):
    n, v = shape
    tau = 0.7
    z, y = logits(n, v, dtype, seed=v)
    labels = torch.arange(n) * 37 % v
    labels[-1] = -100  # an ignored row
    gen = torch.Generator().manual_seed(1)
    grads = [None] * 5
    for k in TERMS[term]:
        grads[k] = torch.randn(n, generator=gen) * 3  # non-unit, mixed-sign upstream grads
    stats = kl_logits_forward(*to_dev(z, y), temperature=tau, labels=labels.to(DEV), block_v=64)
    dz, dy = kl_logits_backward(
        *to_dev(z, y),
        stats,
        temperature=tau,
        labels=labels.to(DEV),
        **dict(zip(GRAD_NAMES, to_dev(*grads), strict=True)),
        need_grad_y=True,
        block_v=64,
    )
    rz, ry = reference_grads(z, y, tau, labels, grads)
    check_grad(dz, rz, dtype, f"dz [{term}]")
    check_grad(dy, ry, dtype, f"dy [{term}]")
    if term in ("entropy", "logp_label"):
        assert (dy == 0).all()  # terms of pi alone do not reach ref's logits
    if term == "logp_ref_label":
        assert (dz == 0).all()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("block_v", "programs"),
    [(None, None), (64, None), (64, 2)],
    ids=["one-block", "blocks", "2-programs"],
)
def test_fused_kernel_matches_reference(dtype, block_v, programs):
    """``kl_logits_fused``: the statistics and every term's gradient in one launch, a row read
    once (one block) or in blocks read twice, rows spread over fewer programs, the gradient
    written over ``z`` itself; against the float64 reference with the forward's and the
    backward's tolerances (module docstring). A row not kept gets zeros."""
    n, v, tau = 5, 157, 0.7
    z, y = logits(n, v, dtype, seed=77)
    labels = torch.tensor([3, 156, -100, 0, 40])
    keep = torch.tensor([True, True, True, False, True])
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(n, generator=gen) * 3 for _ in range(5)]
    zc, y_dev, labels_dev, keep_dev = to_dev(z.clone(), y, labels, keep)
    stats, dz, dy = kl_logits_fused(
        zc,
        y_dev,
        temperature=tau,
        labels=labels_dev,
        **dict(zip(GRAD_NAMES, to_dev(*grads), strict=True)),
        need_grad_y=True,
        dz=zc,
        keep=keep_dev,
        block_v=block_v,
        programs=programs,
    )
    assert dz is zc
    kept = keep.unsqueeze(1)
    ref = {k: torch.where(keep, t, 0.0) for k, t in reference(z, y, tau, labels).items()}
    check_forward(stats, ref, forward_tol(z, y, tau) * keep, f"fused {block_v} {programs}")
    rz, ry = reference_grads(z, y, tau, labels, grads)
    check_grad(dz, rz * kept, dtype, f"fused dz {block_v} {programs}")
    check_grad(dy, ry * kept, dtype, f"fused dy {block_v} {programs}")


@needs_triton
@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize(("need_z", "need_y"), [(True, False), (False, True), (True, True)])
def test_backward_one_side_and_temperatures(tau, need_z, need_y):
    z, y = logits(3, 100, torch.float32, seed=21)
    y = y.to(torch.float16)
    labels = torch.tensor([5, 99, 0])
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(3, generator=gen) for _ in range(5)]
    stats = kl_logits_forward(*to_dev(z, y), temperature=tau, labels=labels.to(DEV), block_v=32)
    dz, dy = kl_logits_backward(
        *to_dev(z, y),
        stats,
        temperature=tau,
        labels=labels.to(DEV),
        **dict(zip(GRAD_NAMES, to_dev(*grads), strict=True)),
        need_grad_z=need_z,
        need_grad_y=need_y,
        block_v=32,
    )
    rz, ry = reference_grads(z, y, tau, labels, grads)
    assert (dz is None) == (not need_z) and (dy is None) == (not need_y)
    if need_z:
        check_grad(dz, rz, torch.float32, "dz")
    if need_y:
        check_grad(dy, ry, torch.float16, "dy")


@needs_triton
def test_backward_without_terms_gives_zeros():
    z, y = logits(2, 50, torch.bfloat16, seed=4)
    stats = kl_logits_forward(*to_dev(z, y))
    dz, dy = kl_logits_backward(*to_dev(z, y), stats, need_grad_y=True)
    assert dz.dtype == torch.bfloat16 and (dz == 0).all() and (dy == 0).all()
    # Only pi's terms: dy is zeros without running the kernel on y's side.
    g = torch.ones(2, device=DEV)
    dz, dy = kl_logits_backward(*to_dev(z, y), stats, grad_entropy=g, need_grad_y=True)
    assert (dy == 0).all() and (dz != 0).any()
    assert kl_logits_backward(*to_dev(z, y), stats, grad_entropy=g, need_grad_z=False) == (
        None,
        None,
    )


@needs_triton
def test_ignored_and_foreign_labels():
    """label < 0: log-probs 0, no gradient. label >= V (another shard's token): log-probs 0 here
    and the gradient's softmax part, -g q / tau on z and -g p / tau on y."""
    z, y = logits(4, 70, torch.float32, seed=6)
    labels = torch.tensor([-100, 70, 1000, 69])
    tau = 2.0
    stats = kl_logits_forward(*to_dev(z, y), temperature=tau, labels=labels.to(DEV), block_v=32)
    assert (stats.logp_label[:3] == 0).all() and (stats.logp_ref_label[:3] == 0).all()
    g4, g5 = torch.tensor([1.5, -2.0, 0.5, 3.0]), torch.tensor([-1.0, 0.25, 2.0, -0.5])
    dz, dy = kl_logits_backward(
        *to_dev(z, y),
        stats,
        temperature=tau,
        labels=labels.to(DEV),
        grad_logp_label=g4.to(DEV),
        grad_logp_ref_label=g5.to(DEV),
        need_grad_y=True,
        block_v=32,
    )
    assert (dz[0] == 0).all() and (dy[0] == 0).all()
    q = (z.double() / tau).softmax(-1)
    p = (y.double() / tau).softmax(-1)
    foreign = slice(1, 3)
    check_grad(dz[foreign], -g4[foreign, None] * q[foreign] / tau, torch.float32, "dz foreign")
    check_grad(dy[foreign], -g5[foreign, None] * p[foreign] / tau, torch.float32, "dy foreign")
    rz, ry = reference_grads(z[3:], y[3:], tau, labels[3:], [None, None, None, g4[3:], g5[3:]])
    check_grad(dz[3:], rz, torch.float32, "dz")
    check_grad(dy[3:], ry, torch.float32, "dy")


def combine_shards(parts):
    """Whole-row statistics from per-shard ones (float64), the vocab-parallel reduction.

    With shard k's normalizers L_k and the row's L = logsumexp_k L_k, shard k holds the mass
    w_k = exp(L_k - L), and its local KL(q_k||p_k) = E_{q_k}[a - b] - La_k + Lb_k, so
      KL(q||p) = sum_k wa_k (KL_k + La_k - Lb_k) - La + Lb,   H(q) = La - sum_k wa_k (La_k - H_k),
      log q_l = (log q_k)_l + La_k - La on the shard that holds l."""
    st = {f: torch.stack([getattr(s, f).double().cpu() for _, s in parts]) for f in FIELDS}
    owner = torch.stack([(lab >= 0) & (lab < w) for (lab, w), _ in parts]).double()
    la, lb = st["lse_z"].logsumexp(0), st["lse_y"].logsumexp(0)
    wa, wb = (st["lse_z"] - la).exp(), (st["lse_y"] - lb).exp()
    return {
        "lse_z": la,
        "lse_y": lb,
        "kl_pi_ref": (wa * (st["kl_pi_ref"] + st["lse_z"] - st["lse_y"])).sum(0) - la + lb,
        "kl_ref_pi": (wb * (st["kl_ref_pi"] + st["lse_y"] - st["lse_z"])).sum(0) - lb + la,
        "entropy": la - (wa * (st["lse_z"] - st["entropy"])).sum(0),
        "logp_label": (owner * (st["logp_label"] + st["lse_z"] - la)).sum(0),
        "logp_ref_label": (owner * (st["logp_ref_label"] + st["lse_y"] - lb)).sum(0),
    }


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vocabulary_shards_compose(dtype):
    """Vocab-parallel use: per-shard forwards combine into the row's statistics; per-shard
    backwards given the row's statistics are the row's gradient, column for column."""
    n, v, tau = 4, 150, 0.7
    z, y = logits(n, v, dtype, seed=31)
    z[0, 100:] = y[0, 100:] = -INF
    labels = torch.tensor([5, 120, -100, 69])
    gen = torch.Generator().manual_seed(3)
    upstream = to_dev(*[torch.randn(n, generator=gen) for _ in range(5)])
    grads = dict(zip(GRAD_NAMES, upstream, strict=True))
    z, y, labels_d = to_dev(z, y, labels)
    whole = kl_logits_forward(z, y, temperature=tau, labels=labels_d, block_v=32)
    dz, dy = kl_logits_backward(
        z, y, whole, temperature=tau, labels=labels_d, **grads, need_grad_y=True, block_v=32
    )
    parts, dzs, dys = [], [], []
    for lo, hi in ((0, 70), (70, v)):
        local = labels_d - lo
        local = torch.where((local >= 0) & (local < hi - lo), local, hi - lo)  # foreign: >= V
        local = torch.where(labels_d < 0, labels_d, local)  # ignored stays ignored
        zs, ys = z[:, lo:hi], y[:, lo:hi]  # strided views
        stats = kl_logits_forward(zs, ys, temperature=tau, labels=local, block_v=32)
        parts.append(((local.cpu(), hi - lo), stats))
        gz, gy = kl_logits_backward(
            zs, ys, whole, temperature=tau, labels=local, **grads, need_grad_y=True, block_v=32
        )
        dzs.append(gz)
        dys.append(gy)
    combined = combine_shards(parts)
    tol = forward_tol(z.cpu(), y.cpu(), tau, ulps=2 * FWD_ULPS)
    for name in FIELDS:
        # Combining float32 statistics of the row's logit scale cancels at that scale: the
        # shards' and the whole row's roundings, twice the rounding of one computation.
        want = getattr(whole, name).double().cpu()
        assert_close(combined[name], want, atol=tol, what=f"combined {name}")
    # The backward is elementwise given the row statistics: bit-for-bit the same columns.
    assert torch.equal(torch.cat(dzs, 1), dz) and torch.equal(torch.cat(dys, 1), dy)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs():
    z = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"z has shape \(2, 5\) but y has shape \(2, 4\)"):
        kl_logits_forward(z, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"z must be \[N, V\] with V >= 1, got shape \(5,\)"):
        kl_logits_forward(torch.zeros(5), torch.zeros(5))
    with pytest.raises(ValueError, match=r"V >= 1"):
        kl_logits_forward(torch.zeros(2, 0), torch.zeros(2, 0))
    with pytest.raises(TypeError, match="y must be float32, bfloat16 or float16"):
        kl_logits_forward(z, z.double())
    with pytest.raises(TypeError, match="z must be float32, bfloat16 or float16"):
        kl_logits_forward(z.long(), z)
    with pytest.raises(TypeError, match=r"z must be a torch\.Tensor, got list"):
        kl_logits_forward([[0.0]], z)
    with pytest.raises(
        ValueError, match=r"labels has shape \(3,\) but the rows of z have shape \(2,\)"
    ):
        kl_logits_forward(z, z, labels=torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="labels must hold integer ids"):
        kl_logits_forward(z, z, labels=torch.zeros(2))
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        kl_logits_forward(z, z, temperature=0.0)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        kl_logits_forward(z, z, block_v=100)
    for bad_block in (64.0, "64", True):  # not ints (a bool is one to Python)
        with pytest.raises(ValueError, match="block_v must be a power of two"):
            kl_logits_forward(z, z, block_v=bad_block)
    n = z.shape[0]
    for bad_rows in (
        torch.zeros(n, dtype=torch.int64),  # the right shape, the wrong dtype
        torch.zeros(n + 1, dtype=torch.int32),  # the right dtype, the wrong shape
        torch.zeros(2 * n, dtype=torch.int32)[::2],  # not contiguous
        [0] * n,  # not a tensor
    ):
        with pytest.raises(TypeError, match=r"careful_rows must be a contiguous int32 tensor"):
            kl_logits_forward(z, z, careful_rows=bad_rows)
    stats = KLRowStats(*[torch.zeros(2)] * 7)
    with pytest.raises(ValueError, match=r"grad_entropy has shape \(3,\); expected \(2,\)"):
        kl_logits_backward(z, z, stats, grad_entropy=torch.zeros(3))
    with pytest.raises(ValueError, match="need the labels"):
        kl_logits_backward(z, z, stats, grad_logp_label=torch.zeros(2))
    with pytest.raises(ValueError, match=r"stats\.lse_z has shape \(3,\)"):
        kl_logits_backward(z, z, KLRowStats(*[torch.zeros(3)] * 7))


@needs_triton
def test_empty_batch():
    stats = kl_logits_forward(*to_dev(torch.zeros(0, 5), torch.zeros(0, 5)))
    assert all(getattr(stats, f).shape == (0,) for f in FIELDS)


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's masked lanes
def test_rows_not_kept_are_not_read_and_get_zeros():
    """``keep``: rows flagged False may hold anything (NaN, +inf); they get 0 statistics and 0
    gradients, and the kept rows are what they are without the flags, bit for bit."""
    g = torch.Generator().manual_seed(21)
    z, y = torch.randn(6, 70, generator=g), torch.randn(6, 70, generator=g)
    labels = torch.tensor([3, 4, -100, 5, 69, 0])
    keep = torch.tensor([True, False, True, True, False, True])
    bad_z, bad_y = z.clone(), y.clone()
    bad_z[1], bad_y[4] = float("nan"), float("inf")
    z, y, bad_z, bad_y, labels, keep = to_dev(z, y, bad_z, bad_y, labels, keep)
    full = kl_logits_forward(z, y, labels=labels)
    part = kl_logits_forward(bad_z, bad_y, labels=labels, keep=keep)
    for f in FIELDS:
        assert torch.equal(getattr(part, f), torch.where(keep, getattr(full, f), 0.0)), f
    ones = torch.ones_like(full.lse_z)
    kw = dict(grad_kl_pi_ref=ones, grad_kl_ref_pi=ones, grad_logp_label=ones, labels=labels)
    dz, dy = kl_logits_backward(z, y, full, need_grad_y=True, **kw)
    dz2, dy2 = kl_logits_backward(bad_z, bad_y, part, need_grad_y=True, keep=keep, **kw)
    assert torch.equal(dz2, dz * keep[:, None]) and torch.equal(dy2, dy * keep[:, None])
    with pytest.raises(TypeError, match="keep must be a bool tensor"):
        kl_logits_forward(z, y, keep=keep.int())
    with pytest.raises(ValueError, match=r"keep must have shape \(6,\)"):
        kl_logits_forward(z, y, keep=keep[:5])


@needs_triton
def test_rows_not_kept_record_path_zero():
    """With ``keep`` and ``careful_rows``, a row flagged False is not read and its loop is
    recorded as 0 (its seven statistics are 0, a fast-loop row's); ordinary kept rows take the
    fast loop (0) too."""
    g = torch.Generator().manual_seed(22)
    z, y = torch.randn(5, 70, generator=g), torch.randn(5, 70, generator=g)
    keep = torch.tensor([True, False, False, True, False])
    z[1], y[2] = float("nan"), float("inf")  # rows that would take the careful loop if read
    z, y, keep = to_dev(z, y, keep)
    careful = torch.full((5,), -1, dtype=torch.int32, device=DEV)
    kl_logits_forward(z, y, keep=keep, careful_rows=careful)
    assert careful.cpu().tolist() == [0, 0, 0, 0, 0]


# ----------------------------------------------------------------------------- GPU compile

_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from klest.logits.kernels import _divergence_triton as dkern
from klest.logits.kernels import _kl_logits_triton as kern
from klest.logits.kernels import _scale_triton as skern

ints = dict.fromkeys(("stride_z", "stride_y", "stride_dz", "stride_dy", "N", "V"), "i32")
fwd = {"z_ptr": "*bf16", "y_ptr": "*fp16", "label_ptr": "*i64", "out_ptr": "*fp32",
       "path_ptr": "*i32", "keep_ptr": "*u8",
       **{k: ints[k] for k in ("stride_z", "stride_y", "N", "V")},
       "scale": "fp32", "HAS_LABELS": "constexpr", "RECORD_PATH": "constexpr",
       "HAS_KEEP": "constexpr",
       "WANT_AB": "constexpr", "WANT_BA": "constexpr", "WANT_ENT": "constexpr",
       "BLOCK_V": "constexpr"}
flags = ("HAS_G1", "HAS_G2", "HAS_G3", "HAS_G4", "HAS_G5", "NEED_DZ", "NEED_DY", "USE_Z", "USE_Y",
         "HAS_KEEP")
rows = ("lse_a_ptr", "lse_b_ptr", "kl_ab_ptr", "kl_ba_ptr", "ent_ptr",
        "g1_ptr", "g2_ptr", "g3_ptr", "g4_ptr", "g5_ptr")
bwd = {"z_ptr": "*bf16", "y_ptr": "*fp32", "label_ptr": "*i64", **dict.fromkeys(rows, "*fp32"),
       "dz_ptr": "*bf16", "dy_ptr": "*fp32", "keep_ptr": "*u8",
       **{k: ints[k] for k in ("stride_z", "stride_y", "stride_dz", "stride_dy", "V")},
       "scale": "fp32", "inv_tau": "fp32", **dict.fromkeys(flags, "constexpr"),
       "BLOCK_V": "constexpr"}
every = dict.fromkeys(flags, True)
pi_only = {**dict.fromkeys(flags, False), "HAS_G3": True, "HAS_G4": True, "NEED_DZ": True,
           "HAS_KEEP": True,
           "USE_Z": True}
ref_only = {**dict.fromkeys(flags, False), "HAS_G5": True, "NEED_DY": True, "USE_Y": True}
jobs = [(kern.kl_logits_fwd_kernel, fwd, {"HAS_LABELS": h, "RECORD_PATH": h, "HAS_KEEP": h,
                                           "WANT_AB": True,
                                           "WANT_BA": h,
                                           "WANT_ENT": h, "BLOCK_V": 1024}) for h in (True, False)]
for c in (every, pi_only, ref_only):
    jobs.append((kern.kl_logits_bwd_kernel, bwd, {**c, "BLOCK_V": 1024}))
dfwd = {"z_ptr": "*bf16", "y_ptr": "*fp32", "lse_a_ptr": "*fp32", "lse_b_ptr": "*fp32",
        "out_ptr": "*fp32", "stride_z": "i32", "stride_y": "i32", "N": "i32", "V": "i32",
        "inv_tau": "fp32", "w": "fp32", "c_q": "fp32", "c_p": "fp32", "keep_ptr": "*u8",
        "KIND": "constexpr", "HAS_KEEP": "constexpr", "CLAMP": "constexpr",
        "BLOCK_V": "constexpr"}
dbwd = {"z_ptr": "*bf16", "y_ptr": "*fp32",
        **dict.fromkeys(("lse_a_ptr", "lse_b_ptr", "s_q_ptr", "s_p_ptr", "g_ptr"), "*fp32"),
        "dz_ptr": "*bf16", "dy_ptr": "*fp32",
        **dict.fromkeys(("stride_z", "stride_y", "stride_dz", "stride_dy", "V"), "i32"),
        "inv_tau": "fp32", "w": "fp32", "c_q": "fp32", "c_p": "fp32", "keep_ptr": "*u8",
        **dict.fromkeys(("KIND", "NEED_DZ", "NEED_DY", "HAS_KEEP", "BLOCK_V"), "constexpr")}
for kind, keep in ((0, True), (1, False)):
    jobs.append((dkern.divergence_fwd_kernel, dfwd,
                 {"KIND": kind, "HAS_KEEP": keep, "CLAMP": keep, "BLOCK_V": 1024}))
    jobs.append((dkern.divergence_bwd_kernel, dbwd, {"KIND": kind, "NEED_DZ": True,
                 "NEED_DY": keep, "HAS_KEEP": keep, "BLOCK_V": 1024}))
# The fused kernels (statistics and gradient in one launch), one block and several per row.
gs = ("g1_ptr", "g2_ptr", "g3_ptr", "g4_ptr", "g5_ptr")
fused_flags = ("HAS_LABELS", "HAS_KEEP", "WANT_AB", "WANT_BA", "WANT_ENT", "HAS_G1", "HAS_G2",
               "HAS_G3", "HAS_G4", "HAS_G5", "NEED_DZ", "NEED_DY", "ONE_BLOCK")
fused = {"z_ptr": "*bf16", "y_ptr": "*fp16", "label_ptr": "*i64", "out_ptr": "*fp32",
         "keep_ptr": "*u8", **dict.fromkeys(gs, "*fp32"), "dz_ptr": "*bf16", "dy_ptr": "*fp16",
         **dict.fromkeys(("stride_z", "stride_y", "stride_dz", "stride_dy", "N", "V"), "i32"),
         "scale": "fp32", "inv_tau": "fp32", **dict.fromkeys(fused_flags, "constexpr"),
         "BLOCK_V": "constexpr"}
for one, block in ((True, 16384), (False, 1024)):
    jobs.append((kern.kl_logits_fused_kernel, fused,
                 {**dict.fromkeys(fused_flags, True), "ONE_BLOCK": one, "BLOCK_V": block}))
jobs.append((kern.kl_logits_fused_kernel, fused,
             {**dict.fromkeys(fused_flags, False), "HAS_G1": True, "NEED_DZ": True,
              "WANT_AB": True, "BLOCK_V": 1024}))
dfused = {"z_ptr": "*bf16", "y_ptr": "*fp32", "label_ptr": "*i64", "stats_ptr": "*fp32",
          "mix_ptr": "*fp32", "keep_ptr": "*u8", "g_ptr": "*fp32", "dz_ptr": "*bf16",
          "dy_ptr": "*fp32",
          **dict.fromkeys(("stride_z", "stride_y", "stride_dz", "stride_dy", "N", "V"), "i32"),
          "scale": "fp32", "inv_tau": "fp32", "w": "fp32", "c_q": "fp32", "c_p": "fp32",
          **dict.fromkeys(("KIND", "HAS_LABELS", "HAS_KEEP", "WANT_ENT", "NEED_DZ", "NEED_DY",
                           "ONE_BLOCK", "BLOCK_V"), "constexpr")}
for kind, one, block in ((0, True, 16384), (1, False, 1024)):
    jobs.append((dkern.divergence_fused_kernel, dfused,
                 {"KIND": kind, "HAS_LABELS": one, "HAS_KEEP": one, "WANT_ENT": one,
                  "NEED_DZ": True, "NEED_DY": one, "ONE_BLOCK": one, "BLOCK_V": block}))
jobs.append((skern.scale_rows_kernel, {"x_ptr": "*bf16", "g_ptr": "*fp32", "c_ptr": "*fp32",
             "stride": "i32", "V": "i32", "BLOCK_V": "constexpr"}, {"BLOCK_V": 1024}))
jobs.append((skern.scale_kernel, {"x_ptr": "*fp32", "r_ptr": "*fp32", "numel": "i64",
             "BLOCK": "constexpr"}, {"BLOCK": 1024}))
for fn, sig, const in jobs:
    const = {(fn.arg_names.index(k),): v for k, v in const.items()}  # the older key form
    src = ASTSource(fn=fn, signature=sig, constexprs=const)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert ".target sm_90" in compiled.asm["ptx"], (fn, const)
print("compiled")
"""


def _triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())


@needs_triton
def test_kernels_compile_for_sm90():
    """The interpreter runs code that the GPU compiler rejects (e.g. a global that is not a
    constexpr): compile the KL and divergence kernels for an H100 (sm_90), which needs no GPU.
    In a subprocess, because triton's interpreter (TRITON_INTERPRET=1) cannot compile."""
    if _triton_version() < (3, 3):
        pytest.skip("the compile call below uses the signature format of triton >= 3.3")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a triton 3.9 notice
    src = os.path.join(os.path.dirname(klest.__file__), os.pardir)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True
    )
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-4000:]
