"""The multi-teacher KLs against a slow loop over positions and teachers in plain float64 torch:
values and gradients (student logits / hidden states / heads, teachers that require grad) for
routes, global and per-position weights, masks, empty rows, packed sequences, a teacher with no
row; the work done (a routed row costs one teacher's KL); bad input.

Tolerances: each side computes every teacher's KL from a log-softmax, rounding at the row's
logit scale (tests._tolerance.logit_scale) about sqrt(V) <= 4 times in random directions, and a
weighted mean over the teachers (weights summing to 1) of such values rounds no worse than its
largest term: VALUE_ULPS = 2 paths x 16. Gradients cancel at the row's scale (their largest
entry) and the heads' sum them over N <= 24 rows and V = 13: GRAD_ULPS = 2 x 32."""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import klest
from klest.logits import from_hidden
from tests._tolerance import assert_close_to_rounding, assert_logits_values_close

VALUE_ULPS = 32
GRAD_ULPS = 64
V, K = 13, 3
F64 = torch.float64


def _t(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _kl(z, y, direction, temperature):
    """Plain torch KL of one position (``[V]`` logits)."""
    a, b = torch.log_softmax(z / temperature, -1), torch.log_softmax(y / temperature, -1)
    p, lp, lq = (a.exp(), a, b) if direction == "pi||ref" else (b.exp(), b, a)
    return (p * (lp - lq)).sum()


def _reference(z, teachers, w, keep, direction, temperature):
    """Per position (flat ``[N]``): sum over the teachers with weight > 0 of w * KL, a loop."""
    n = z.shape[0]
    out = []
    for i in range(n):
        total = torch.zeros((), dtype=F64)
        if keep[i]:
            for k in range(len(teachers)):
                if w[i, k] > 0:
                    total = total + w[i, k] * _kl(z[i], teachers[k][i], direction, temperature)
        out.append(total)
    return torch.stack(out)


def _weights(mode, lead, route):
    """``(argument dict, dense [N, K] weights)`` of a weighting mode."""
    n = lead.numel()
    if mode == "route":
        rows = route.reshape(-1)
        dense = torch.nn.functional.one_hot(rows, K).to(F64)
        dense = dense[:, None].expand(-1, n // rows.numel(), -1).reshape(n, K)
        return {"route": route}, dense
    if mode == "default":
        return {}, torch.full((n, K), 1 / K, dtype=F64)
    if mode == "global":
        w = torch.tensor([0.5, 0.0, 0.5], dtype=F64)  # teacher 1 never computed
        return {"weights": w}, w.expand(n, K)
    # per position: one-hot, two-teacher and three-teacher mixtures, in different orders
    raw = _t((n, K), 5).abs() * (
        torch.rand((n, K), generator=torch.Generator().manual_seed(6)) > 0.4
    )
    raw[torch.arange(n), torch.arange(n) % K] += 0.3  # at least one teacher per position
    dense = raw / raw.sum(-1, keepdim=True)
    return {"weights": dense.reshape(*lead, K)}, dense


MODES = ("route", "default", "global", "per-position")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_logits_match_the_loop(mode, direction):
    """Values (reduction "none" and the default) and gradients to the student's and to a
    trainable teacher's logits equal the loop's; masked positions and a fully masked row give 0;
    with a route, teacher 1 has no row."""
    lead, temperature = torch.Size((4, 6)), 0.8
    z = _t((*lead, V), 0).requires_grad_(True)
    teachers = [_t((*lead, V), 10 + k).requires_grad_(k == 2) for k in range(K)]
    mask = _t(lead, 1) > -0.8
    mask[2] = False  # an empty row
    route = torch.tensor([0, 2, 2, 0])
    kwargs, dense = _weights(mode, lead, route)
    got = klest.multi_teacher_kl_from_logits(
        z,
        teachers,
        direction=direction,
        mask=mask,
        temperature=temperature,
        reduction="none",
        **kwargs,
    )
    flat = [t.reshape(-1, V) for t in teachers]
    want = _reference(z.reshape(-1, V), flat, dense, mask.reshape(-1), direction, temperature)
    assert_logits_values_close(
        got.reshape(-1), want, z.reshape(-1, V), *flat, ulps=VALUE_ULPS, temperature=temperature
    )
    upstream = _t(lead, 2)
    params = [z, teachers[2]]
    g_got = torch.autograd.grad((got * upstream).sum(), params)
    g_want = torch.autograd.grad((want * upstream.reshape(-1)).sum(), params)
    for a, b in zip(g_got, g_want, strict=True):
        assert_close_to_rounding(a, b, ulps=GRAD_ULPS, what="gradient")
    assert (g_got[0][2] == 0).all()
    reduced = klest.multi_teacher_kl_from_logits(
        z, teachers, direction=direction, mask=mask, temperature=temperature, **kwargs
    )
    # seq-mean-token-sum: the row sums over the 3 rows with a counted position
    assert_logits_values_close(
        reduced, want.sum() / 3, z, *teachers, ulps=VALUE_ULPS, temperature=temperature, terms=24
    )


def test_packed_sequences_with_a_route():
    """cu_seqlens: the route is per sequence (an empty one included); per-sequence sums and the
    token mean equal the loop's."""
    cu = torch.tensor([0, 3, 3, 8, 10])
    route = torch.tensor([1, 0, 2, 1])  # the empty sequence's entry is not read
    z = _t((10, V), 20).requires_grad_(True)
    teachers = [_t((10, V), 21 + k) for k in range(K)]
    per_token = torch.tensor([1, 1, 1, 2, 2, 2, 2, 2, 1, 1])
    dense = torch.nn.functional.one_hot(per_token, K).to(F64)
    want = _reference(z, teachers, dense, torch.ones(10, dtype=torch.bool), "pi||ref", 1.0)
    per_seq = klest.multi_teacher_kl_from_logits(
        z, teachers, route=route, cu_seqlens=cu, reduction="per-sequence"
    )
    want_seq = torch.stack([want[a:b].sum() for a, b in itertools.pairwise(cu.tolist())])
    assert_logits_values_close(per_seq, want_seq, z, *teachers, ulps=VALUE_ULPS, terms=5)
    mean = klest.multi_teacher_kl_from_logits(
        z, teachers, route=route, cu_seqlens=cu, reduction="token-mean"
    )
    assert_logits_values_close(mean, want.mean(), z, *teachers, ulps=VALUE_ULPS)
    (g,) = torch.autograd.grad(mean, z)
    (g_want,) = torch.autograd.grad(want.mean(), z)
    assert_close_to_rounding(g, g_want, ulps=GRAD_ULPS, what="gradient")


def _hidden_case(mode, seed, route, dtype=F64):
    """A student (hidden states, head and bias, all trained) and K teachers' heads (teacher 0's
    trained, teacher 1's with a bias), a mask with an empty row, the weighting ``mode``:
    ``(call's arguments, dense [N, K] weights, trained tensors, materialized logits z, ys)``.
    With a route, one teacher_hidden tensor holds each row's own teacher's states (trained);
    otherwise each teacher has its own (sizes differ; teacher 0's trained)."""
    lead, hsz = torch.Size((4, 6)), 5

    def t(shape, offset):
        return _t(shape, seed + offset).to(dtype)

    h, w, b = (
        t(shape, i).requires_grad_(True) for i, shape in enumerate(((*lead, hsz), (V, hsz), (V,)))
    )
    sizes = (hsz, hsz, hsz) if mode == "route" else (3, 5, 7)
    heads = [t((V, s), 10 + k).requires_grad_(k == 0) for k, s in enumerate(sizes)]
    biases = [None, t((V,), 15), None]
    mask = _t(lead, seed + 3) > -0.8
    mask[1] = False
    kwargs, dense = _weights(mode, lead, route)
    if mode == "route":
        states = t((*lead, hsz), 20).requires_grad_(True)
        teacher_hidden, per_teacher = states, [states] * K
    else:
        per_teacher = [t((*lead, s), 20 + k).requires_grad_(k == 0) for k, s in enumerate(sizes)]
        teacher_hidden, states = per_teacher, per_teacher[0]
    args = {
        "hidden": h,
        "weight": w,
        "teacher_hidden": teacher_hidden,
        "teacher_weights": heads,
        "bias": b,
        "teacher_biases": biases,
        "mask": mask,
        **kwargs,
    }
    z = torch.nn.functional.linear(h, w, b)
    ys = [
        torch.nn.functional.linear(s, hd, bi)
        for s, hd, bi in zip(per_teacher, heads, biases, strict=True)
    ]
    return args, dense, [h, w, b, heads[0], states], z, ys


@pytest.mark.parametrize("mode", ["route", "per-position"])
def test_hidden_matches_the_loop(mode):
    """From hidden states with each teacher's own head and bias (:func:`_hidden_case`): values
    and gradients per position equal the loop on the materialized logits."""
    args, dense, params, z, ys = _hidden_case(mode, 30, torch.tensor([0, 1, 0, 0]))
    got = klest.multi_teacher_kl_from_hidden(**args, reduction="none")
    z, ys = z.reshape(-1, V), [y.reshape(-1, V) for y in ys]
    want = _reference(z, ys, dense, args["mask"].reshape(-1), "pi||ref", 1.0)
    assert_logits_values_close(got.reshape(-1), want, z, *ys, ulps=VALUE_ULPS)
    upstream = _t(got.shape, 34)
    g_got = torch.autograd.grad((got * upstream).sum(), params)
    g_want = torch.autograd.grad((want * upstream.reshape(-1)).sum(), params)
    for name, a, c in zip(["h", "w", "b", "head0", "teacher_hidden"], g_got, g_want, strict=True):
        assert_close_to_rounding(a, c, ulps=GRAD_ULPS, what=name)


DIRECTIONS = {
    "route": "pi||ref",
    "default": "ref||pi",
    "global": "pi||ref",
    "per-position": "ref||pi",
}


def _by_hand(values, mask, reduction):
    """klest's reductions of per-position ``values`` ``[B, T]`` (0 where masked), written out."""
    if reduction == "none":
        return values
    if reduction == "token-mean":
        return values.sum() / mask.sum()
    return values.sum() / mask.any(-1).sum()  # seq-mean-token-sum over the counted rows


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["seq-mean-token-sum", "token-mean", "none"])
def test_hidden_matches_each_teachers_kl_from_logits(dtype, mode, reduction):
    """The fused path (gradient in the forward for a scalar reduction, recomputed per position)
    against kl_from_logits on the materialized logits, per teacher, weighted and reduced by
    hand: values, each teacher's details, and gradients to the student's hidden states, head
    and bias and to a trainable teacher's head and hidden states, with a loss reaching the
    backward with 1 and with 0.7. Teacher 1 has no row (route, global weights); chunks of 5
    rows cross the teacher groups. Tolerances: the module's, in the dtype's precision."""
    lead, temperature = torch.Size((4, 6)), 0.8
    args, dense, params, z, ys = _hidden_case(mode, 130, torch.tensor([0, 2, 2, 0]), dtype)
    mask = args["mask"]
    options = {"direction": DIRECTIONS[mode], "mask": mask, "temperature": temperature}
    got, details = klest.multi_teacher_kl_from_hidden(
        **args | options, reduction=reduction, chunk_size=5, return_details=True
    )
    kls = torch.stack([klest.kl_from_logits(z, y, reduction="none", **options) for y in ys], -1)
    weighted = dense.reshape(*lead, K).to(dtype)
    want = _by_hand((weighted * kls).sum(-1), mask, reduction)
    value_options = {"ulps": VALUE_ULPS, "temperature": temperature}
    flat = [x.reshape(-1, V) for x in (z, *ys)]
    if reduction == "none":
        assert_logits_values_close(got.reshape(-1), want.reshape(-1), *flat, **value_options)
    else:
        assert_logits_values_close(got, want, *flat, terms=lead[-1], **value_options)
    computed = (weighted > 0) & mask[..., None]
    assert torch.equal(details.teacher_positions, computed.reshape(-1, K).sum(0))
    for k in range(K):
        assert_logits_values_close(
            details.teacher_kls[..., k].reshape(-1),
            torch.where(computed[..., k], kls[..., k], 0.0).detach().reshape(-1),
            flat[0],
            flat[1 + k],
            **value_options,
        )
    upstream = {"none": _t(lead, 134).to(dtype), "token-mean": 0.7}.get(reduction, 1.0)
    g_got = torch.autograd.grad((got * upstream).sum(), params)
    g_want = torch.autograd.grad((want * upstream).sum(), params)
    for name, a, c in zip(["h", "w", "b", "head0", "teacher_hidden"], g_got, g_want, strict=True):
        assert_close_to_rounding(a, c, ulps=GRAD_ULPS, what=f"{name} {dtype} {mode} {reduction}")


def test_hidden_packed_sequences_with_a_route():
    """cu_seqlens (an empty sequence included), a scalar reduction: the gradient written in the
    forward equals kl_from_logits per teacher on the materialized logits, each sequence's
    teacher picked and reduced by hand (float64, the module's tolerances)."""
    cu = torch.tensor([0, 3, 3, 8, 10])
    route = torch.tensor([1, 0, 2, 1])
    per_token = torch.tensor([1, 1, 1, 2, 2, 2, 2, 2, 1, 1])
    h, w = _t((10, 4), 160).requires_grad_(True), _t((V, 4), 161).requires_grad_(True)
    heads, states = [_t((V, 3), 162 + k) for k in range(K)], _t((10, 3), 166)
    ys = [states @ hd.T for hd in heads]
    kls = torch.stack([klest.kl_from_logits(h @ w.T, y, reduction="none") for y in ys], -1)
    per_position = kls.gather(1, per_token[:, None])[:, 0]
    sums = torch.stack([per_position[a:b].sum() for a, b in itertools.pairwise(cu.tolist())])
    for reduction, want in (
        ("token-mean", per_position.mean()),
        ("seq-mean-token-sum", sums.sum() / 3),  # 3 sequences with a position
    ):
        got = klest.multi_teacher_kl_from_hidden(
            h, w, states, heads, route=route, cu_seqlens=cu, reduction=reduction, chunk_size=2
        )
        assert_logits_values_close(got, want, h @ w.T, *ys, ulps=VALUE_ULPS, terms=5)
        for a, c in zip(
            torch.autograd.grad(got, [h, w]),
            torch.autograd.grad(want, [h, w], retain_graph=True),
            strict=True,
        ):
            assert_close_to_rounding(a, c, ulps=GRAD_ULPS, what=reduction)


def test_hidden_gradient_in_the_forward_is_used_once(monkeypatch):
    """With a scalar reduction the backward only scales the gradients written in the forward:
    by exactly 1 when the loss reaches it with 1 (the coefficients are the backward's own, bit
    for bit), by 2 for a loss doubled. A second backward is refused (stash=False allows it, and
    equals it); stash=True with a per-position result is refused."""
    h, w = _t((3, 4, 5), 170).requires_grad_(True), _t((V, 5), 171).requires_grad_(True)
    heads, states = [_t((V, 5), 172 + k) for k in range(K)], _t((3, 4, 5), 176)
    weights = torch.tensor([0.2, 0.0, 0.8], dtype=F64)
    factors = []
    real = from_hidden.uniform_factor

    def record(g, c):
        factors.append(real(g, c))
        return factors[-1]

    monkeypatch.setattr(from_hidden, "uniform_factor", record)
    for upstream in (1.0, 2.0):
        out = klest.multi_teacher_kl_from_hidden(h, w, states, heads, weights=weights)
        grads = torch.autograd.grad(out * upstream, [h, w])
    assert [float(f) for f in factors] == [1.0, 2.0]
    out = klest.multi_teacher_kl_from_hidden(h, w, states, heads, weights=weights)
    (out * 2.0).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="stash=False"):
        out.backward()
    twice = klest.multi_teacher_kl_from_hidden(h, w, states, heads, weights=weights, stash=False)
    for _ in range(2):
        again = torch.autograd.grad(twice * 2.0, [h, w], retain_graph=True)
        for a, c in zip(again, grads, strict=True):
            assert_close_to_rounding(a, c, ulps=GRAD_ULPS)
    with pytest.raises(ValueError, match="stash=True"):
        klest.multi_teacher_kl_from_hidden(h, w, states, heads, reduction="none", stash=True)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
    reason="needs triton with CUDA or TRITON_INTERPRET=1 (make test sets it)",
)
def test_hidden_triton_backend_equals_torch_backend():
    """The fused path's kernels (interpreter on CPU), a scalar loss over per-position weights
    (chunks of one, two and three teachers): value and gradients within float32 rounding of the
    PyTorch backend's (the module's tolerances)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args, _, params, z, ys = _hidden_case("per-position", 180, None, torch.float32)
    args = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    got = {}
    for backend in ("torch", "triton"):
        out = klest.multi_teacher_kl_from_hidden(**args, backend=backend, chunk_size=4)
        got[backend] = [out, *torch.autograd.grad(out * 0.7, params)]
    assert_logits_values_close(got["triton"][0], got["torch"][0], z, *ys, ulps=VALUE_ULPS, terms=6)
    for a, c in zip(got["triton"][1:], got["torch"][1:], strict=True):
        assert_close_to_rounding(a, c, ulps=GRAD_ULPS)


def test_routed_rows_cost_one_teacher():
    """Work, counted: routed over K = 3 teachers, the fused call does the matrix products of one
    kl_from_hidden call over the same rows, with a scalar loss (each row's logits, student and
    teacher, once, and the gradients written in the forward) and per position (recomputed in
    the backward); from logits, a route is one kl_from_logits call. Rows of a teacher's tensor
    that are not routed to it are not read: NaN there changes nothing."""
    lead, hsz = torch.Size((6, 4)), 8
    h = _t((*lead, hsz), 60).requires_grad_(True)
    w = _t((V, hsz), 61)
    heads = [_t((V, hsz), 62 + k) for k in range(K)]
    th = _t((*lead, hsz), 66)
    route = torch.tensor([0, 1, 2, 2, 1, 0])
    for reduction in ("seq-mean-token-sum", "none"):
        with FlopCounterMode(display=False) as multi:
            out = klest.multi_teacher_kl_from_hidden(
                h, w, th, heads, route=route, reduction=reduction
            )
            out.sum().backward()
        with FlopCounterMode(display=False) as single:
            klest.kl_from_hidden(h, w, th, heads[0], reduction=reduction).sum().backward()
        assert multi.get_total_flops() == single.get_total_flops() > 0, reduction
    z = _t((*lead, V), 70)
    teachers = [torch.full((*lead, V), float("nan"), dtype=F64) for _ in range(K)]
    for b, k in enumerate(route.tolist()):
        teachers[k][b] = _t((lead[1], V), 71 + b)
    routed = torch.stack([teachers[k][b] for b, k in enumerate(route.tolist())])
    got = klest.multi_teacher_kl_from_logits(z, teachers, route=route, validate=True)
    assert got == klest.kl_from_logits(z, routed)


def test_nothing_counted_gives_zero_with_a_zero_gradient():
    z = _t((2, 3, V), 80).requires_grad_(True)
    teachers = [_t((2, 3, V), 81 + k) for k in range(K)]
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for fn in (
        lambda: klest.multi_teacher_kl_from_logits(z, teachers, mask=mask),
        lambda: klest.multi_teacher_kl_from_logits(z[:0], [t[:0] for t in teachers]),
    ):
        out = fn()
        (g,) = torch.autograd.grad(out, z)
        assert out == 0 and (g == 0).all()
    h, w = _t((2, 3, 4), 90).requires_grad_(True), _t((V, 4), 91)
    out = klest.multi_teacher_kl_from_hidden(
        h, w, _t((2, 3, 4), 92), [w, w], mask=mask, route=torch.tensor([5, 7])
    )
    (g,) = torch.autograd.grad(out, h)
    assert out == 0 and (g == 0).all()


def test_details():
    """Per teacher, its KLs where computed and its positions."""
    z = _t((3, 4, V), 100)
    teachers = [_t((3, 4, V), 101 + k) for k in range(K)]
    route = torch.tensor([2, 0, 2])
    _, d = klest.multi_teacher_kl_from_logits(
        z, teachers, route=route, reduction="none", return_details=True
    )
    assert d.teacher_positions.tolist() == [4, 0, 8]
    want = klest.kl_from_logits(z[0], teachers[2][0], reduction="none")
    assert torch.equal(d.teacher_kls[0, :, 2], want)
    assert (d.teacher_kls[0, :, :2] == 0).all() and (d.teacher_kls[:, :, 1] == 0).all()


def test_bad_input():
    z = _t((2, 3, V), 110)
    ts = [_t((2, 3, V), 111 + k) for k in range(K)]
    h, w = _t((2, 3, 4), 120), _t((V, 4), 121)
    f, fh = klest.multi_teacher_kl_from_logits, klest.multi_teacher_kl_from_hidden
    cases = {
        "route outside": (
            ValueError,
            r"outside \[0, 3\)",
            lambda: f(z, ts, route=torch.tensor([0, 3])),
        ),
        "route negative": (ValueError, "route", lambda: f(z, ts, route=torch.tensor([-1, 0]))),
        "route shape": (ValueError, "route has shape", lambda: f(z, ts, route=torch.tensor([0]))),
        "route float": (TypeError, "integer", lambda: f(z, ts, route=torch.tensor([0.0, 1.0]))),
        "both": (
            ValueError,
            "not both",
            lambda: f(z, ts, weights=[1, 0, 0], route=torch.tensor([0, 1])),
        ),
        "K mismatch": (ValueError, r"\(3,\)", lambda: f(z, ts, weights=[0.5, 0.5])),
        "negative": (ValueError, ">= 0", lambda: f(z, ts, weights=[1.5, -0.5, 0.0])),
        "sum": (ValueError, "sum to 1", lambda: f(z, ts, weights=[0.5, 0.2, 0.2])),
        "per-position sum": (
            ValueError,
            "sum to 1",
            lambda: f(z, ts, weights=torch.full((2, 3, K), 0.3, dtype=F64)),
        ),
        "teacher shape": (ValueError, r"teacher_logits\[1\]", lambda: f(z, [ts[0], ts[1][:1]])),
        "tensor": (TypeError, "sequence", lambda: f(z, ts[0])),
        "empty": (TypeError, "non-empty", lambda: f(z, [])),
        "hidden K": (
            ValueError,
            "2 tensors but teacher_weights 3",
            lambda: fh(h, w, [h, h], [w, w, w]),
        ),
        "biases K": (
            ValueError,
            "teacher_biases",
            lambda: fh(h, w, h, [w, w], teacher_biases=[None]),
        ),
        "hidden shape": (ValueError, "teacher_hidden", lambda: fh(h, w, h[:1], [w])),
        "hidden route": (
            ValueError,
            "outside",
            lambda: fh(h, w, h, [w, w], route=torch.tensor([0, 2])),
        ),
    }
    for err, match, call in cases.values():
        with pytest.raises(err, match=match):
            call()
    # a masked position's weights are not read
    wts = torch.full((2, 3, K), 0.3, dtype=F64)
    wts[..., 0] = 0.4
    wts[1, 2] = -5.0
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    assert torch.isfinite(f(z, ts, weights=wts, mask=mask))
