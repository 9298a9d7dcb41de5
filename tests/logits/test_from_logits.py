"""kl_from_logits against a plain float64 log_softmax reference: values and gradients.

Tolerances. The reference gets the very inputs the fast path gets (bf16 / fp16 inputs are upcast
to float64 unchanged), so only arithmetic is compared:
  * values: float32 (float64) arithmetic on a row rounds at the size of its logits over T and
    its log-sum-exp, and a KL's sum over V entries stays at that scale: ``VALUE_ULPS eps`` times
    :func:`tests._tolerance.logit_scale` (a sum of rows: their sum; a mean: the largest);
  * gradients: float32 arithmetic relative to the row's gradient scale (``1e-5 max|ref|``) plus
    the rounding of the result to the input dtype, half an ulp relative (2^-24, 2^-11, 2^-8 for
    fp32 / fp16 / bf16); the stash path rounds twice (per-unit gradient, then scaled), so one
    ulp is allowed.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import zlib

import pytest
import torch

import klest
from klest.logits.from_logits import kl_from_logits
from tests._reference import assert_verbose_close, logits_reference
from tests._tolerance import assert_logits_values_close

INF = math.inf
KL_KEY = {"pi||ref": "kl_pi_ref", "ref||pi": "kl_ref_pi"}
ULP = {
    torch.float64: 2.0**-52,
    torch.float32: 2.0**-23,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
}


def reference(z, y, *, direction="pi||ref", temperature=1.0, labels=None):
    """:func:`logits_reference`, with ``"kl"`` the KL in ``direction``."""
    out = logits_reference(z, y, temperature, labels)
    return out | {"kl": out[KL_KEY[direction]]}


def arithmetic_scale(z, y, temperature=1.0, upstream=None):
    """Per entry, the size of what the gradient's float arithmetic cancels: (q + p) times
    (1 + |log q| + |log p| + both KLs + H(q)) / T, times |upstream| per row."""
    la = torch.log_softmax(z.detach().double() / temperature, -1)
    lb = torch.log_softmax(y.detach().double() / temperature, -1)
    q, p = la.exp(), lb.exp()
    fin = torch.isfinite(la) & torch.isfinite(lb)
    la, lb = torch.where(fin, la, 0.0), torch.where(fin, lb, 0.0)
    kls = (q * (la - lb)).sum(-1, keepdim=True) + (p * (lb - la)).sum(-1, keepdim=True)
    ent = -(q * la).sum(-1, keepdim=True)
    up = 1.0 if upstream is None else upstream.abs().unsqueeze(-1)
    return (q + p) * (1 + la.abs() + lb.abs() + kls + ent) / temperature * up


def grad_close(actual, expected, dtype, *, scale, ulps, what, upstream_scale=1.0):
    """``|actual - expected| <= 32 eps scale + ulps ulp(dtype)``: float32 (float64) arithmetic
    on terms of size ``scale`` (measured worst case over 720 random cases: 8.2 eps scale, so a
    margin of 4), plus the rounding of the result to the input dtype, relative (``ulps`` ulps of
    ``|expected|``) and, for subnormal results (fp16 gradients below 6e-5), absolute; the
    stash rounds the per-unit gradient before scaling it by the upstream gradient, so there the
    subnormal rounding is multiplied by ``upstream_scale = max(1, |upstream|)``."""
    eps = 2.0**-52 if dtype == torch.float64 else 2.0**-24
    subnormal_spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    atol = 32 * eps * scale + ulps * subnormal_spacing * upstream_scale
    assert_verbose_close(actual, expected, atol=atol, rtol=ulps * ULP[dtype], what=what)


VALUE_ULPS = 16
"""A KL, entropy or label log-prob from a row's logits: the log-softmax rounds each entry at the
row's logit scale, and the sums over V add as many roundings of terms of that size, but in
random directions (about sqrt(V) <= 16). Measured worst case over this file: 1.9 (CPU, its
vector widths avx512, avx2 and none alike)."""


def value_close(actual, expected, *logits, temperature=1.0, what="", terms=1, paths=1):
    """:func:`assert_logits_values_close` at ``VALUE_ULPS`` (``paths``: 2 where both sides are
    computed in float32)."""
    assert_logits_values_close(
        actual,
        expected,
        *logits,
        ulps=paths * VALUE_ULPS,
        temperature=temperature,
        terms=terms,
        what=what,
    )


def _logits(shape, dtype, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


GRID = list(
    itertools.product(
        [(7, 5), (2, 3, 33), (4, 257), (1, 1)],  # shapes [..., V]: odd V, V = 1
        [torch.float32, torch.bfloat16, torch.float16, torch.float64],
        ["pi||ref", "ref||pi"],
    )
)


@pytest.mark.parametrize(("shape", "dtype", "direction"), GRID)
@pytest.mark.parametrize("stash", [True, False])
def test_values_and_gradients_match_reference(shape, dtype, direction, stash):
    seed = zlib.crc32(repr((shape, str(dtype), direction)).encode())
    z = _logits(shape, dtype, seed).requires_grad_()
    y = _logits(shape, dtype, seed + 1).requires_grad_()
    upstream = _logits(shape[:-1], torch.float64, seed + 2, scale=1.0)
    for temperature, chunk in ((1.0, None), (0.7, 2)):
        kl = kl_from_logits(
            z,
            y,
            direction=direction,
            reduction="none",
            temperature=temperature,
            chunk_size=chunk,
            stash=stash,
        )
        assert kl.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        dz, dy = torch.autograd.grad((kl.double() * upstream).sum(), [z, y])
        assert dz.dtype == dtype and dy.dtype == dtype
        zr, yr = z.detach().double().requires_grad_(), y.detach().double().requires_grad_()
        ref = reference(zr, yr, direction=direction, temperature=temperature)["kl"]
        rz, ry = torch.autograd.grad((ref * upstream).sum(), [zr, yr])
        what = f"{shape} {dtype} {direction} T={temperature} stash={stash}"
        value_close(kl, ref, z, y, temperature=temperature, what=what)
        ulps = 1.0 if stash else 0.5
        scale = arithmetic_scale(z, y, temperature, upstream)
        g_scale = upstream.abs().clamp(min=1.0).unsqueeze(-1)
        for name, got, want in (("dz", dz, rz), ("dy", dy, ry)):
            grad_close(
                got,
                want,
                dtype,
                scale=scale,
                ulps=ulps,
                what=f"{name} {what}",
                upstream_scale=g_scale,
            )


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_labels_entropy_and_all_gradients(direction):
    """All five outputs at once, each with its own upstream gradient (the recompute path)."""
    z = _logits((3, 4, 19), torch.float32, 1).requires_grad_()
    y = _logits((3, 4, 19), torch.float32, 2).requires_grad_()
    labels = torch.randint(0, 19, (3, 4), generator=torch.Generator().manual_seed(3))
    labels[0, 1] = -100
    g = [_logits((3, 4), torch.float64, s, scale=1.0) for s in range(10, 14)]
    kl, details = kl_from_logits(
        z,
        y,
        direction=direction,
        reduction="none",
        labels=labels,
        temperature=1.3,
        return_details=True,
    )
    assert isinstance(details, klest.LogitsDetails)
    out = (kl, details.logp, details.logp_ref, details.entropy)
    loss = sum((t.double() * w).sum() for t, w in zip(out, g, strict=True))
    dz, dy = torch.autograd.grad(loss, [z, y])

    zr, yr = z.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    ref = reference(zr, yr, direction=direction, temperature=1.3, labels=labels)
    keep = labels != -100
    parts = [ref["kl"], ref["logp_label"], ref["logp_ref_label"], ref["entropy"]]
    parts = [torch.where(keep, t, 0.0) for t in parts]
    for name, a, b in zip(("kl", "logp", "logp_ref", "entropy"), out, parts, strict=True):
        value_close(a, b, z, y, temperature=1.3, what=name)
    rz, ry = torch.autograd.grad(
        sum((t * w).sum() for t, w in zip(parts, g, strict=True)), [zr, yr]
    )
    scale = arithmetic_scale(z, y, 1.3, sum(w.abs() for w in g))
    grad_close(dz, rz, torch.float32, scale=scale, ulps=0.5, what="dz")
    grad_close(dy, ry, torch.float32, scale=scale, ulps=0.5, what="dy")
    assert float(dz[0, 1].abs().max()) == 0.0 and float(dy[0, 1].abs().max()) == 0.0


def test_gradcheck_float64_all_outputs():
    z = _logits((2, 3, 6), torch.float64, 5).requires_grad_()
    y = _logits((2, 3, 6), torch.float64, 6).requires_grad_()
    labels = torch.tensor([[0, 5, -100], [2, 2, 1]])
    mask = torch.tensor([[True, True, True], [True, False, True]])

    for direction in ("pi||ref", "ref||pi"):

        def f(z, y, direction=direction):
            kl, d = kl_from_logits(
                z,
                y,
                direction=direction,
                reduction="none",
                labels=labels,
                mask=mask,
                temperature=0.8,
                chunk_size=2,
                return_details=True,
            )
            return kl, d.logp, d.logp_ref, d.entropy

        assert torch.autograd.gradcheck(f, (z, y))


def test_gradcheck_stash_off_and_reduction():
    z = _logits((3, 5, 7), torch.float64, 7).requires_grad_()
    y = _logits((3, 5, 7), torch.float64, 8).requires_grad_()
    for reduction in ("seq-mean-token-sum", "token-mean"):
        assert torch.autograd.gradcheck(
            lambda z, y, r=reduction: kl_from_logits(z, y, reduction=r, stash=False), (z, y)
        )


def test_masked_vocabulary_entries_are_outside_the_support():
    """-inf at the same entries of both: equal to the KL over the remaining entries."""
    z = _logits((5, 12), torch.float32, 9)
    y = _logits((5, 12), torch.float32, 10)
    z[:, 8:] = -INF
    y[:, 8:] = -INF
    z.requires_grad_()
    for direction in ("pi||ref", "ref||pi"):
        kl = kl_from_logits(z, y, direction=direction, reduction="none")
        (dz,) = torch.autograd.grad(kl.sum(), [z])
        small = z.detach()[:, :8].double().requires_grad_()
        ref = reference(small, y[:, :8], direction=direction)["kl"]
        (rz,) = torch.autograd.grad(ref.sum(), [small])
        assert torch.isfinite(kl).all() and torch.isfinite(dz).all()
        value_close(kl, ref, z, y, what=direction)
        scale = arithmetic_scale(z[:, :8], y[:, :8])
        grad_close(dz[:, :8], rz, torch.float32, scale=scale, ulps=1, what="dz")
        assert float(dz[:, 8:].abs().max()) == 0.0


def test_mass_outside_the_other_support_gives_inf_not_nan():
    z = _logits((3, 6), torch.float32, 11)
    y = _logits((3, 6), torch.float32, 12)
    y[0, 2] = -INF  # pi has mass where ref has none: KL(pi||ref) = inf, KL(ref||pi) finite
    z[1, 4] = -INF  # the other way round
    kl_pr = kl_from_logits(z, y, direction="pi||ref", reduction="none")
    kl_rp = kl_from_logits(z, y, direction="ref||pi", reduction="none")
    assert kl_pr[0] == INF and torch.isfinite(kl_rp[0])
    assert kl_rp[1] == INF and torch.isfinite(kl_pr[1])
    ref = reference(z, y)
    value_close(kl_pr[1:], ref["kl_pi_ref"][1:], z[1:], y[1:], what="finite rows")


def test_identical_inputs_give_exactly_zero():
    z = _logits((4, 6, 50), torch.float32, 13).requires_grad_()
    y = z.detach().clone().requires_grad_()
    for direction in ("pi||ref", "ref||pi"):
        kl = kl_from_logits(z, y, direction=direction, reduction="none", temperature=0.9)
        dz, dy = torch.autograd.grad(kl.sum(), [z, y])
        assert float(kl.detach().abs().max()) == 0.0
        assert float(dz.abs().max()) == 0.0 and float(dy.abs().max()) == 0.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mask_excludes_rows_that_may_hold_garbage(backend):
    """Masked rows may hold NaN or -inf everywhere: the PyTorch engine skips them by index,
    the Triton kernels by a flag per row (without reading them); either way 0 and 0 gradient."""
    if backend not in BACKENDS:
        pytest.skip("needs triton (CUDA, or TRITON_INTERPRET=1)")
    z = _logits((2, 4, 9), torch.float32, 14)
    y = _logits((2, 4, 9), torch.float32, 15)
    mask = torch.tensor([[True, False, True, True], [True, True, True, False]])
    z[0, 1] = float("nan")
    y[1, 3] = -INF
    z.requires_grad_()
    y.requires_grad_()
    for stash, direction in ((True, "pi||ref"), (False, "pi||ref"), (False, "ref||pi")):
        kl = kl_from_logits(
            z, y, mask=mask, reduction="none", stash=stash, backend=backend, direction=direction
        )
        dz, dy = torch.autograd.grad(kl.sum(), [z, y])
        for t in (kl.detach(), dz, dy):
            assert float(t[~mask].abs().max()) == 0.0 and bool(torch.isfinite(t).all())
        ref = reference(z.detach(), y.detach(), direction=direction)["kl"]
        value_close(kl[mask], ref[mask], z[mask], y[mask], what="kept rows")
    for reduction in ("seq-mean-token-sum", "token-mean", "seq-mean-token-mean", "sum"):
        got = kl_from_logits(z, y, mask=mask, reduction=reduction, backend=backend)
        want = klest.aggregate(
            torch.where(mask, reference(z.detach(), y.detach())["kl"], 0.0),
            mask=mask,
            reduction=reduction,
        )
        terms = int(mask.sum()) if reduction == "sum" else 1
        value_close(got, want, z[mask], y[mask], what=reduction, terms=terms)


def test_matches_categorical_kl_and_memory_budget_chunks_agree():
    z = _logits((40, 70), torch.float32, 16)
    y = _logits((40, 70), torch.float32, 17)
    exact = klest.categorical_kl(z.double(), y.double(), reduction="none")
    for budget in (1, 5 * 4 * 70 * 3, 2**30):  # 1 row, 3 rows, all rows per chunk
        got = kl_from_logits(z, y, reduction="none", memory_budget=budget)
        value_close(got, exact, z, y, what=f"budget {budget}")


def test_no_vocabulary_sized_tensor_is_saved_for_backward():
    """What autograd keeps between forward and backward: the inputs (recompute) or the gradient
    buffer (stash), and [N]-sized row statistics; never an [N, V] intermediate."""
    n, v = 16, 301
    z = _logits((n, v), torch.float32, 18).requires_grad_()
    y = _logits((n, v), torch.float32, 19)
    for stash in (True, False):
        saved = []

        def pack(t, saved=saved):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            kl = kl_from_logits(z, y, reduction="token-mean", stash=stash, chunk_size=4)
        big = [
            t for t in saved if t.numel() >= v and t.data_ptr() not in (z.data_ptr(), y.data_ptr())
        ]
        assert big == [], [tuple(t.shape) for t in big]
        kl.backward()


def test_stash_backward_twice_raises_and_recompute_allows_it():
    z = _logits((3, 8), torch.float32, 20).requires_grad_()
    y = _logits((3, 8), torch.float32, 21)
    kl = kl_from_logits(z, y, reduction="sum")
    kl.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="stash=False"):
        kl.backward()
    z.grad = None
    kl = kl_from_logits(z, y, reduction="sum", stash=False)
    kl.backward(retain_graph=True)
    first = z.grad.clone()
    kl.backward()
    torch.testing.assert_close(z.grad, 2 * first)


def test_no_grad_and_ref_only_gradient():
    z = _logits((3, 8), torch.float32, 22)
    y = _logits((3, 8), torch.float32, 23).requires_grad_()
    with torch.no_grad():
        assert not kl_from_logits(z, y).requires_grad
    kl = kl_from_logits(z, y, direction="ref||pi", reduction="none")
    (dy,) = torch.autograd.grad(kl.sum(), [y])
    yr = y.detach().double().requires_grad_()
    (ry,) = torch.autograd.grad(reference(z, yr, direction="ref||pi")["kl"].sum(), [yr])
    grad_close(dy, ry, torch.float32, scale=arithmetic_scale(z, y), ulps=1, what="dy")


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logits_ref": torch.zeros(3, 6)}, ValueError, r"\(3, 5\).*\(3, 6\)"),
        ({"logits": torch.zeros(3, 5, dtype=torch.int64)}, TypeError, "logits"),
        ({"direction": "forward"}, ValueError, "direction"),
        ({"reduction": "mean"}, ValueError, "reduction"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": "1"}, TypeError, "temperature"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"labels": torch.tensor([0, 5, 1])}, ValueError, "labels"),
        ({"labels": torch.tensor([0.0, 1.0, 1.0])}, TypeError, "labels"),
        ({"labels": torch.tensor([0, 1])}, ValueError, "labels"),
        ({"mask": torch.ones(4, dtype=torch.bool)}, ValueError, "mask"),
        ({"mask": torch.tensor([0, 2, 1])}, ValueError, "only 0 and 1"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {"logits": torch.zeros(3, 5), "logits_ref": torch.zeros(3, 5)} | kwargs
    with pytest.raises(error, match=match):
        kl_from_logits(args.pop("logits"), args.pop("logits_ref"), **args)


@pytest.mark.parametrize("bad", [float("nan"), INF, "all -inf"])
@pytest.mark.parametrize("which", ["logits", "logits_ref"])
def test_bad_logits_rows_raise(bad, which):
    t = {"logits": torch.randn(4, 6), "logits_ref": torch.randn(4, 6)}
    if bad == "all -inf":
        t[which][2] = -INF
    else:
        t[which][2, 3] = bad
    with pytest.raises(ValueError, match=rf"{which} has 1 row.*flat row 2"):
        kl_from_logits(t["logits"], t["logits_ref"])


# -- the Triton backend through the same Function (interpreter on CPU) ---------------------------

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(
    not (HAS_TRITON and (INTERPRET or torch.cuda.is_available())),
    reason="needs triton with CUDA or TRITON_INTERPRET=1 (make test sets it)",
)
@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_triton_backend_equals_torch_backend(direction):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    z = _logits((6, 37), torch.float32, 24).to(dev).requires_grad_()
    y = _logits((6, 37), torch.float32, 25).to(dev).requires_grad_()
    labels = torch.tensor([1, 36, -100, 0, 5, 5], device=dev)
    mask = torch.tensor([True, True, True, False, True, True], device=dev)
    g = [_logits((6,), torch.float32, s, scale=1.0).to(dev) for s in range(30, 34)]
    grads = {}
    for backend in ("torch", "triton"):
        kl, d = kl_from_logits(
            z,
            y,
            direction=direction,
            reduction="none",
            labels=labels,
            mask=mask,
            temperature=0.9,
            backend=backend,
            return_details=True,
        )
        out = (kl, d.logp, d.logp_ref, d.entropy)
        loss = sum((t * w).sum() for t, w in zip(out, g, strict=True))
        grads[backend] = (out, torch.autograd.grad(loss, [z, y]))
    (o1, (dz1, dy1)), (o2, (dz2, dy2)) = grads["torch"], grads["triton"]
    # Both are float32 computations: twice the single-path bound.
    for a, b in zip(o1, o2, strict=True):
        value_close(b, a, z, y, temperature=0.9, what="outputs", paths=2)
    scale = 2 * arithmetic_scale(z, y, 0.9, sum(w.abs() for w in g))
    grad_close(dz2, dz1.double(), torch.float32, scale=scale.to(dz1.device), ulps=2, what="dz")
    grad_close(dy2, dy1.double(), torch.float32, scale=scale.to(dz1.device), ulps=2, what="dy")


# -- trainer batches -----------------------------------------------------------------------------


def test_rows_with_no_valid_position_contribute_nothing():
    """An all-padding row, and a row whose labels are all ignore_index, count in no mean."""
    z = _logits((4, 3, 9), torch.float32, 40).requires_grad_()
    y = _logits((4, 3, 9), torch.float32, 41)
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[1] = False
    labels = torch.randint(0, 9, (4, 3), generator=torch.Generator().manual_seed(42))
    labels[2] = -100
    per_token = reference(z.detach(), y)["kl"]
    kept = torch.tensor([0, 3])
    want = {
        "seq-mean-token-sum": per_token[kept].sum(-1).mean(),
        "token-mean": per_token[kept].mean(),
        "seq-mean-token-mean": per_token[kept].mean(-1).mean(),
        "sum": per_token[kept].sum(),
    }
    for reduction, expected in want.items():
        got, details = kl_from_logits(
            z, y, mask=mask, labels=labels, reduction=reduction, return_details=True
        )
        terms = per_token[kept].numel() if reduction == "sum" else 1
        value_close(got, expected, z, y, what=reduction, terms=terms)
        assert details.diagnostics.n_empty_rows == 2
        if reduction != "sum":  # a mean reduction: the diagnostics' mean is the value
            assert abs(details.diagnostics.mean - float(got)) <= 1e-6 * abs(float(got))
    per_seq = kl_from_logits(z, y, mask=mask, labels=labels, reduction="per-sequence")
    assert per_seq.shape == (4,) and float(per_seq[1]) == 0.0 and float(per_seq[2]) == 0.0


@pytest.mark.parametrize("stash", [True, False])
def test_a_batch_with_no_valid_position_gives_zero_and_a_zero_gradient(stash):
    z = _logits((2, 3, 7), torch.float32, 43)
    z[0, 0] = float("nan")  # garbage under the mask is never read
    z.requires_grad_()
    y = _logits((2, 3, 7), torch.float32, 44)
    for reduction in ("seq-mean-token-sum", "token-mean", "seq-mean-token-mean", "sum"):
        kl = kl_from_logits(
            z, y, mask=torch.zeros(2, 3, dtype=torch.bool), reduction=reduction, stash=stash
        )
        (dz,) = torch.autograd.grad(kl, [z])
        assert float(kl) == 0.0 and float(dz.abs().max()) == 0.0
    empty = torch.zeros(0, 3, 7, requires_grad=True)
    kl = kl_from_logits(empty, torch.zeros(0, 3, 7))
    (dz,) = torch.autograd.grad(kl, [empty])
    assert float(kl) == 0.0 and dz.shape == (0, 3, 7)


def test_labels_alone_never_change_the_return_type():
    z, y = _logits((2, 4, 6), torch.float32, 45), _logits((2, 4, 6), torch.float32, 46)
    labels = torch.tensor([[1, 2, -100, 0], [5, 5, 5, -100]])
    out = kl_from_logits(z, y, labels=labels, reduction="none")
    assert isinstance(out, torch.Tensor) and out.shape == (2, 4)
    assert float(out[0, 2]) == 0.0 and float(out[1, 3]) == 0.0


# -- precision at realistic vocabularies ---------------------------------------------------------

BACKENDS = ["torch"] + (
    ["triton"] if HAS_TRITON and (INTERPRET or torch.cuda.is_available()) else []
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("v", [32000, 128256])
def test_float32_is_as_accurate_as_the_plain_float32_expression(v, backend):
    """Against float64, per position: klest's float32 KLs and entropy are at least as accurate as
    ``kl_div(log_softmax(.), log_softmax(.), log_target=True)`` in float32 (its relative error
    here: 8e-7 at V = 32000, 4e-6 at V = 128256). A 25% margin covers another summation order;
    measured, the torch backend equals the plain expression and the Triton one is 5-30x better."""
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    z, y = _logits((4, v), torch.float32, 50), _logits((4, v), torch.float32, 51)
    ref = logits_reference(z, y)
    for direction, key in KL_KEY.items():
        a, b = (z, y) if direction == "pi||ref" else (y, z)
        plain = torch.nn.functional.kl_div(
            torch.log_softmax(b, -1), torch.log_softmax(a, -1), log_target=True, reduction="none"
        ).sum(-1)
        got, details = kl_from_logits(
            z.to(dev),
            y.to(dev),
            direction=direction,
            reduction="none",
            backend=backend,
            return_details=True,
        )

        def rel(x, want):
            return float(((x.double().cpu() - want).abs() / want.abs()).max())

        assert rel(got, ref[key]) <= 1.25 * rel(plain, ref[key]), (direction, rel(got, ref[key]))
        log_q = torch.log_softmax(z, -1)
        plain_entropy = -(log_q.exp() * log_q).sum(-1)
        want = ref["entropy"]
        assert rel(details.entropy, want) <= 1.25 * rel(plain_entropy, want)


def _infinite_kl_row_gradient(direction: str, stash: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient w.r.t. pi's logits of rows whose KL(direction) is [finite, +inf, finite]
    (one model has mass where the other has none in row 1) under upstream gradients
    [0.5, 0, 2], and the plain float64 formula's gradient of the finite rows."""
    z = _logits((3, 6), torch.float64, 13)
    y = _logits((3, 6), torch.float64, 14)
    if direction == "pi||ref":
        y[1, 2] = -INF  # pi has mass where ref has none
    else:
        z[1, 4] = -INF  # ref has mass where pi has none
    z.requires_grad_()
    upstream = torch.tensor([0.5, 0.0, 2.0], dtype=torch.float64)
    kl = kl_from_logits(z, y, direction=direction, reduction="none", stash=stash)
    assert kl[1] == INF
    (dz,) = torch.autograd.grad(kl, z, upstream)
    finite = z.detach()[[0, 2]].requires_grad_()
    lp, lq = torch.log_softmax(finite, -1), torch.log_softmax(y[[0, 2]], -1)
    if direction == "ref||pi":
        lp, lq = lq, lp
    (want,) = torch.autograd.grad((lp.exp() * (lp - lq)).sum(-1), finite, upstream[[0, 2]])
    return dz, want


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_an_infinite_kl_with_zero_upstream_gradient_passes_zero_not_nan(direction):
    """A row whose KL is +inf and whose upstream gradient is 0 (a weight of 0, a masked
    position) passes gradient 0, not inf * 0 = NaN (the default, stashed gradient); the other
    rows get the gradient of the plain float64 formula, sum p (log p - log q)."""
    dz, want = _infinite_kl_row_gradient(direction, stash=True)
    assert float(dz[1].abs().max()) == 0.0, dz[1]
    torch.testing.assert_close(dz[[0, 2]], want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_an_infinite_kl_with_zero_upstream_gradient_passes_zero_without_the_stash(direction):
    """The same for the gradient recomputed in the backward (``stash=False``)."""
    dz, want = _infinite_kl_row_gradient(direction, stash=False)
    assert float(dz[1].abs().max()) == 0.0, dz[1]
    torch.testing.assert_close(dz[[0, 2]], want, rtol=1e-12, atol=1e-14)


# -- scale, ce_weight, overwrite_logits: the gradient written in the forward pass ----------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_scale_ce_weight_and_overwrite_match_reference(backend, direction, overwrite):
    """``scale * token-mean(KL + w * CE)`` (CE = -log pi(label); a label -100 drops its
    position) and its gradients to both logits against float64 autograd, for a loss reaching
    the backward with 1
    (nothing rescaled) and with 2.5 (rescaled there). Tolerances: ``value_close`` (two terms per
    position) and ``grad_close`` at one ulp (the gradient rounds in the forward, then when
    rescaled)."""
    scale, w, temperature = 0.3, 0.7, 0.9
    z0 = _logits((2, 3, 37), torch.float32, 60).requires_grad_()
    y0 = _logits((2, 3, 37), torch.float32, 61).requires_grad_()
    labels = torch.tensor([[3, -100, 36], [0, 5, 5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    zr, yr = z0.detach().double().requires_grad_(), y0.detach().double().requires_grad_()
    ref = reference(zr, yr, direction=direction, temperature=temperature, labels=labels)
    kept = mask & (labels != -100)
    per_position = ref["kl"] - w * ref["logp_label"]
    want = scale * per_position[kept].mean()
    rz, ry = torch.autograd.grad(want, [zr, yr])
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    for upstream in (1.0, 2.5):
        # the logits a head makes (overwritten when asked)
        z, y = z0.to(dev) * 1.0, y0.to(dev) * 1.0
        got = kl_from_logits(
            z,
            y,
            direction=direction,
            reduction="token-mean",
            temperature=temperature,
            labels=labels.to(dev),
            mask=mask.to(dev),
            scale=scale,
            ce_weight=w,
            overwrite_logits=overwrite,
            backend=backend,
            chunk_size=2,
        )
        dz, dy = torch.autograd.grad(got * upstream, [z0, y0])
        got = got.cpu()
        what = f"{backend} {direction} overwrite={overwrite} upstream={upstream}"
        value_close(got, want, z0, y0, temperature=temperature, what=what, terms=2)
        if overwrite:  # the gradient went where the logits were
            assert_verbose_close(z.detach().cpu(), dz, atol=0.0, what=f"overwritten {what}")
        up = torch.full(mask.shape, scale * upstream / float(kept.sum()), dtype=torch.float64)
        up = up * kept
        g_scale = arithmetic_scale(z0, y0, temperature, up * (1 + w))
        for name, a, e in (("dz", dz, rz * upstream), ("dy", dy, ry * upstream)):
            grad_close(a, e, torch.float32, scale=g_scale, ulps=1.0, what=f"{name} {what}")


def test_a_tensor_scale_gets_its_gradient_and_stash_false_agrees():
    """A ``scale`` tensor that requires grad gets the unscaled result as its gradient (float64,
    exact up to the rounding of one product), and the forward-written gradient equals the
    recomputed one (``stash=False``) to 8 float64 ulps of the largest entry."""
    z = _logits((4, 9), torch.float64, 62).requires_grad_()
    y = _logits((4, 9), torch.float64, 63)
    beta = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    got = kl_from_logits(z, y, scale=beta, reduction="sum")
    dz, dbeta = torch.autograd.grad(got, [z, beta])
    plain = kl_from_logits(z, y, reduction="sum", stash=False)
    (want_dz,) = torch.autograd.grad(plain * 0.25, [z])
    assert_verbose_close(dbeta, plain.detach(), atol=2 * ULP[torch.float64] * float(plain))
    assert_verbose_close(got, 0.25 * plain.detach(), atol=2 * ULP[torch.float64] * float(plain))
    atol = 8 * ULP[torch.float64] * float(want_dz.abs().max())
    assert_verbose_close(dz, want_dz, atol=atol, what="forward-written vs recomputed")


def test_overwrite_logits_and_stash_false_conflict():
    z = _logits((2, 5), torch.float32, 64).requires_grad_()
    with pytest.raises(ValueError, match="overwrite_logits"):
        kl_from_logits(z * 1.0, z.detach(), overwrite_logits=True, stash=False)
    with pytest.raises(ValueError, match="ce_weight"):
        kl_from_logits(z, z.detach(), ce_weight=1.0)
    with pytest.raises(TypeError, match="scale"):
        kl_from_logits(z, z.detach(), scale="0.1")
