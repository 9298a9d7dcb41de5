"""kl_from_hidden equals kl_from_logits on the materialized logits: values and every gradient.

Float64 throughout, so the two paths differ only by the order of float64 operations (the chunked
matmuls): tolerance 1e-10 (measured: <= 1e-13). float32 / bf16 run the same code; a float32 case
is compared with a float32 tolerance: values within ``VALUE_ULPS`` roundings of their row's
logit scale (:func:`tests._tolerance.logit_scale`), gradients within ``GRAD_ULPS`` roundings of
their largest entry.
"""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest
import torch

import klest
from tests._tolerance import assert_close_to_rounding, assert_logits_values_close, logit_scale

VALUE_ULPS = 32
"""Two float32 paths to a value from a row's logits (fused and plain: the matmul's sum over the
hidden size, then log-softmax and a sum over V): each rounds at the row's logit scale, about
sqrt(V) <= 8 times in random directions; 2 x 16. Measured: at most 0.5."""

GRAD_ULPS = 64
"""Two float32 paths to a gradient: the logits' gradient cancels at the row's scale (the largest
gradient entry's), and the matmuls back to the head and the hidden states sum it over V <= 37
and N <= 6 terms; 2 x 32. Measured: at most 9."""


def _value_close(got, want, *logits, temperature=1.0, what=""):
    assert_logits_values_close(
        got, want, *logits, ulps=VALUE_ULPS, temperature=temperature, what=what
    )


def _t(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _outputs(out):
    """The tensors a call returned: the KL, then (with details) log-probs and entropy."""
    if isinstance(out, torch.Tensor):
        return [out]
    kl, d = out
    return [kl, d.logp, d.logp_ref, d.entropy]


def _loss(out, n_weights):
    kl, *rest = _outputs(out)
    total = (kl * n_weights).sum()
    if rest:
        logp, logp_ref, entropy = rest
        if logp is not None:
            total = total + 0.3 * logp.sum() - 0.7 * logp_ref.sum()
        total = total + 1.3 * entropy.sum()
    return total


@pytest.mark.parametrize(
    ("direction", "ref_kind", "masked", "with_labels"),
    list(
        itertools.product(
            ["pi||ref", "ref||pi"], ["hidden", "logits"], [False, True], [False, True]
        )
    ),
)
def test_equals_logits_path(direction, ref_kind, masked, with_labels):
    n_lead, h_dim, v = (3, 4), 6, 23
    h = _t((*n_lead, h_dim), 1).requires_grad_()
    w = _t((v, h_dim), 2).requires_grad_()
    b = _t((v,), 3).requires_grad_()
    h_ref = _t((*n_lead, 5), 4).requires_grad_()
    w_ref = _t((v, 5), 5).requires_grad_()
    y = _t((*n_lead, v), 6).requires_grad_()
    mask = (_t(n_lead, 7) > -0.5) if masked else None
    labels = torch.randint(0, v, n_lead, generator=torch.Generator().manual_seed(8))
    labels[0, 0] = -100
    kw = {
        "direction": direction,
        "mask": mask,
        "labels": labels if with_labels else None,
        "return_details": with_labels,
        "reduction": "none",
        "temperature": 0.8,
    }
    if ref_kind == "hidden":
        fused = klest.kl_from_hidden(h, w, h_ref, w_ref, bias=b, chunk_size=2, **kw)
        logits_ref, params = h_ref @ w_ref.T, [h, w, b, h_ref, w_ref]
    else:
        fused = klest.kl_from_hidden(h, w, logits_ref=y, bias=b, chunk_size=5, **kw)
        logits_ref, params = y, [h, w, b, y]
    plain = klest.kl_from_logits(h @ w.T + b, logits_ref, **kw)
    weights = _t(n_lead, 9)
    got = torch.autograd.grad(_loss(fused, weights), params)
    want = torch.autograd.grad(_loss(plain, weights), params)
    for a, c in zip(_outputs(fused), _outputs(plain), strict=True):
        if a is not None:
            torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)
    for name, a, c in zip(["h", "w", "b", "ref1", "ref2"], got, want, strict=False):
        torch.testing.assert_close(
            a, c, atol=1e-10, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_float32_and_reduction_and_gradcheck():
    h = _t((5, 7), 10, torch.float32).requires_grad_()
    w = _t((31, 7), 11, torch.float32).requires_grad_()
    y = _t((5, 31), 12, torch.float32)
    fused = klest.kl_from_hidden(h, w, logits_ref=y, reduction="token-mean", memory_budget=1)
    plain = klest.kl_from_logits(h @ w.T, y, reduction="token-mean")
    gf = torch.autograd.grad(fused, [h, w])
    gp = torch.autograd.grad(plain, [h, w])
    _value_close(fused, plain, h @ w.T, y, what="token-mean")
    for a, c in zip(gf, gp, strict=True):
        assert_close_to_rounding(a, c, ulps=GRAD_ULPS, what="gradient")

    h64 = _t((3, 4), 13).requires_grad_()
    w64 = _t((9, 4), 14).requires_grad_()
    hr = _t((3, 2), 15).requires_grad_()
    wr = _t((9, 2), 16).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, w, hr, wr: klest.kl_from_hidden(
            h, w, hr, wr, direction="ref||pi", reduction="none", chunk_size=2
        ),
        (h64, w64, hr, wr),
    )


def test_no_vocabulary_sized_tensor_is_saved():
    n, h_dim, v = 12, 4, 257
    h = _t((n, h_dim), 17, torch.float32).requires_grad_()
    w = _t((v, h_dim), 18, torch.float32).requires_grad_()
    h_ref, w_ref = _t((n, h_dim), 19, torch.float32), _t((v, h_dim), 20, torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kl = klest.kl_from_hidden(h, w, h_ref, w_ref, reduction="sum", chunk_size=3)
    inputs = {t.data_ptr() for t in (h, w, h_ref, w_ref)}
    big = [tuple(t.shape) for t in saved if t.numel() >= n * v // 2 and t.data_ptr() not in inputs]
    assert big == []
    kl.backward()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"weight": torch.zeros(11, 3)}, ValueError, "hidden.*weight"),
        ({"weight_ref": torch.zeros(12, 4)}, ValueError, "same vocabulary"),
        ({"logits_ref": torch.zeros(5, 11)}, ValueError, "either"),
        ({"hidden_ref": None, "weight_ref": None}, ValueError, "either"),
        ({"bias": torch.zeros(10)}, ValueError, "bias"),
        ({"hidden": torch.zeros(5, 4, dtype=torch.int32)}, TypeError, "hidden"),
        ({"labels": torch.tensor([0, 1, 2, 3, 11])}, ValueError, "labels"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {
        "hidden": torch.zeros(5, 4),
        "weight": torch.zeros(11, 4),
        "hidden_ref": torch.zeros(5, 4),
        "weight_ref": torch.zeros(11, 4),
    } | kwargs
    with pytest.raises(error, match=match):
        klest.kl_from_hidden(
            args.pop("hidden"),
            args.pop("weight"),
            args.pop("hidden_ref"),
            args.pop("weight_ref"),
            **args,
        )


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
    reason="needs triton with CUDA or TRITON_INTERPRET=1 (make test sets it)",
)
def test_triton_backend_equals_torch_backend():
    """The per-chunk kernels behind the fused path (interpreter on CPU): float32 tolerance."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h = _t((6, 5), 21, torch.float32).to(dev).requires_grad_()
    w = _t((37, 5), 22, torch.float32).to(dev).requires_grad_()
    y = _t((6, 37), 23, torch.float32).to(dev)
    labels = torch.tensor([0, 36, 5, -100, 2, 2], device=dev)
    got = {}
    for backend in ("torch", "triton"):
        out = klest.kl_from_hidden(
            h,
            w,
            logits_ref=y,
            labels=labels,
            reduction="none",
            backend=backend,
            chunk_size=4,
            return_details=True,
        )
        grads = torch.autograd.grad(_loss(out, torch.ones(6, device=dev)), [h, w])
        got[backend] = [*_outputs(out), *grads]
    names = ("kl", "logp", "logp_ref", "entropy", "dh", "dw")
    for name, a, b in zip(names, got["torch"], got["triton"], strict=True):
        if name.startswith("d"):
            assert_close_to_rounding(b, a, ulps=GRAD_ULPS, what=name)
        else:
            _value_close(b, a, h @ w.T, y, what=name)


def test_empty_rows_and_an_empty_batch():
    h = _t((3, 4, 5), 24, torch.float32).requires_grad_()
    w = _t((13, 5), 25, torch.float32).requires_grad_()
    y = _t((3, 4, 13), 26, torch.float32)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False
    fused = klest.kl_from_hidden(h, w, logits_ref=y, mask=mask)
    plain = klest.kl_from_logits(h @ w.T, y, mask=mask)
    _value_close(fused, plain, h[mask] @ w.T, y[mask], what="masked mean")
    none = klest.kl_from_hidden(h, w, logits_ref=y, mask=torch.zeros(3, 4, dtype=torch.bool))
    dh, dw = torch.autograd.grad(none, [h, w])
    assert float(none) == 0.0 and float(dh.abs().max()) == 0.0 and float(dw.abs().max()) == 0.0
    empty = klest.kl_from_hidden(h[:0], w, logits_ref=y[:0])
    assert float(empty) == 0.0


@pytest.mark.parametrize("half", ["hidden_ref", "weight_ref"])
def test_logits_ref_with_half_of_the_hidden_form_is_refused(half):
    """``logits_ref`` beside one of ``hidden_ref`` / ``weight_ref`` gives ref twice: refused,
    not silently read from ``logits_ref``."""
    ref = {"hidden_ref": None, "weight_ref": None}
    ref[half] = torch.zeros(5, 4) if half == "hidden_ref" else torch.zeros(11, 4)
    with pytest.raises(ValueError, match="either"):
        klest.kl_from_hidden(
            torch.zeros(5, 4), torch.zeros(11, 4), **ref, logits_ref=torch.zeros(5, 11)
        )


@pytest.mark.parametrize("trainable", ["h_ref", "w_ref"])
def test_gradient_reaches_whichever_half_of_the_ref_head_is_trainable(trainable):
    """Only one of ref's hidden states and head weight requires grad (a frozen encoder under a
    trained head, or the reverse): that one's gradient is autograd's of the KL written out from
    the plain logits (float64), and the other gets none."""
    h, w = _t((4, 6), 31).requires_grad_(), _t((17, 6), 32)
    h_ref, w_ref = _t((4, 5), 33), _t((17, 5), 34)
    leaf = {"h_ref": h_ref, "w_ref": w_ref}[trainable].requires_grad_()
    fused = klest.kl_from_hidden(h, w, h_ref, w_ref, reduction="none", chunk_size=3)
    lq, lp = (h @ w.T).log_softmax(-1), (h_ref @ w_ref.T).log_softmax(-1)
    plain = (lq.exp() * (lq - lp)).sum(-1)  # KL(pi||ref) per row, float64
    weights = _t((4,), 35)
    got = torch.autograd.grad((fused * weights).sum(), [h, leaf])
    want = torch.autograd.grad((plain * weights).sum(), [h, leaf])
    for a, c in zip(got, want, strict=True):
        torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)
    other = w_ref if trainable == "h_ref" else h_ref
    assert other.grad is None and not other.requires_grad


def test_bf16_hidden_states_with_a_float32_head():
    """Hidden states from a forward under bf16 autocast, the LM heads (and biases) float32
    parameters, the loss outside autocast: the logits are the heads' products in float32, as
    a float64 reference on the same values gives them (value and gradients, each in its
    input's dtype). It used to fail in the matmul (BFloat16 != float)."""
    h = _t((2, 3, 8), 30).bfloat16().requires_grad_()
    w = _t((11, 8), 31, torch.float32).requires_grad_()
    b = _t((11,), 32, torch.float32).requires_grad_()
    hr, wr, br = _t((2, 3, 5), 33).bfloat16(), _t((11, 5), 34, torch.float32), _t((11,), 35)
    br = br.float()
    kl = klest.kl_from_hidden(h, w, hr, wr, bias=b, bias_ref=br, chunk_size=4)
    got = torch.autograd.grad(kl, [h, w, b])
    leaves = [t.detach().double().requires_grad_() for t in (h, w, b)]
    z = leaves[0] @ leaves[1].T + leaves[2]
    y = hr.double() @ wr.double().T + br.double()
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(y, -1)
    want = (logp.exp() * (logp - logq)).sum(-1).sum(-1).mean()
    want_grads = torch.autograd.grad(want, leaves)
    # A sum of 3 positions' KLs, averaged over 2 rows: 3 times a position's rounding.
    scale = 3 * logit_scale(z, y).max()
    assert_close_to_rounding(kl, want, ulps=VALUE_ULPS, dtype=torch.float32, scale=scale)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32, torch.float32]
    for g, ref in zip(got, want_grads, strict=True):
        # bf16 keeps 8 significant bits: the hidden states' gradient is rounded to 2^-8 of each
        # entry and, summed over the chunks in bf16, of the largest; float32: its arithmetic.
        unit = 2.0**-8 if g.dtype == torch.bfloat16 else GRAD_ULPS * torch.finfo(torch.float32).eps
        rtol = 2.0**-8 if g.dtype == torch.bfloat16 else 0.0
        torch.testing.assert_close(g.double(), ref, atol=unit * float(ref.abs().max()), rtol=rtol)
    jsd = klest.jsd_from_hidden(h, w, hr, wr, beta=0.5, bias=b, bias_ref=br)
    want_jsd = klest.jsd_from_logits(z, y, beta=0.5)
    assert_close_to_rounding(jsd, want_jsd, ulps=VALUE_ULPS, dtype=torch.float32, scale=scale)


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_scale_and_ce_weight_with_the_gradients_made_in_the_forward(direction):
    """``scale * seq-mean-token-sum(KL + w * CE)`` with the head's gradients made in the forward
    pass equals kl_from_logits on the materialized logits (recomputing, ``stash=False``), in
    float64 (1e-10, as above), for a loss reaching the backward with 1 and with -1.5."""
    h = _t((2, 3, 5), 40).requires_grad_()
    w = _t((11, 5), 41).requires_grad_()
    b = _t((11,), 42).requires_grad_()
    hr, wr = _t((2, 3, 4), 43), _t((11, 4), 44)
    labels = torch.tensor([[1, 10, -100], [4, 4, 0]])
    mask = torch.tensor([[True, True, True], [False, True, True]])
    options = dict(
        direction=direction, labels=labels, mask=mask, reduction="seq-mean-token-sum",
        temperature=0.8, scale=0.4, ce_weight=0.6,
    )  # fmt: skip
    for upstream in (1.0, -1.5):
        fused = klest.kl_from_hidden(h, w, hr, wr, bias=b, chunk_size=2, **options)
        got = torch.autograd.grad(fused * upstream, [h, w, b])
        plain = klest.kl_from_logits(
            torch.nn.functional.linear(h, w, b), hr @ wr.T, stash=False, **options
        )
        want = torch.autograd.grad(plain * upstream, [h, w, b])
        assert abs(float(fused) - float(plain)) <= 1e-10
        for a, e, name in zip(got, want, ("dh", "dW", "db"), strict=True):
            assert float((a - e).abs().max()) <= 1e-10, (name, upstream)
