"""Vocab-parallel KL, JSD, skew KL and TV from hidden states over gloo equal the single-process
``*_from_hidden`` functions.

Rank r holds rows [o_r, o_r + V_r) of both LM heads (uneven shards, 2 and 3 ranks, one spawn
each, every divergence in it); the hidden states are [S, B, H] (Megatron's layout). Every
rank's value and details equal the single-process ones, each rank's head gradients equal the
rows of the full ones, the ranks' partial hidden-state gradients sum to the full one (and
``reduce_hidden_grad=True`` gives it on every rank), and ``valid_vocab_size`` gives the answer
of the truncated heads. Float64 (and float32 on the Triton kernels); tolerances as in
``test_vocab_parallel`` (same arithmetic, plus one product per logit: its rounding is at the
logits' scale, which ``logit_scale`` measures).
"""

from __future__ import annotations

import pytest
import torch

import klest
from tests._spawn import run_ranks
from tests._tolerance import assert_close_to_rounding, logit_scale
from tests.logits.test_vocab_parallel import GRAD_ULPS, VALUE_ULPS, _collectives, needs_triton

LEAD = (3, 2)  # [s, b]
H, H_REF = 5, 4


def _inputs(v: int, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(2)
    h = torch.randn((*LEAD, H), generator=g, dtype=torch.float64)
    h_ref = torch.randn((*LEAD, H_REF), generator=g, dtype=torch.float64)
    w = torch.randn(v, H, generator=g, dtype=torch.float64)
    w_ref = torch.randn(v, H_REF, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, LEAD, generator=g)
    mask = torch.ones(LEAD, dtype=torch.bool)
    mask[2, 1] = False
    return (*(t.to(dtype) for t in (h, h_ref, w, w_ref, b)), labels, mask)


DIVERGENCES = {
    "kl pi||ref": ("kl", {"direction": "pi||ref"}),
    "kl ref||pi": ("kl", {"direction": "ref||pi"}),
    "jsd 0.3": ("jsd", {"beta": 0.3}),
    "skew pi||ref": ("skew_kl", {"alpha": 0.2, "direction": "pi||ref"}),
    "skew ref||pi": ("skew_kl", {"alpha": 0.4, "direction": "ref||pi"}),
    "tv": ("tv", {}),
}
"""Each case: the function's stem (``klest.<stem>_from_hidden[_vocab_parallel]``) and options."""


def _run(call, h, h_ref, w, w_ref, b, labels, mask, valid=None):
    """Every configuration's outputs and gradients (h, h_ref, w, w_ref, b); ``call(stem,
    ...)`` runs one function."""
    out = {}
    for case, (stem, options) in DIVERGENCES.items():
        for reduction in ("seq-mean-token-sum", "none"):
            leaves = [t.clone().requires_grad_() for t in (h, h_ref, w, w_ref, b)]
            lab = labels if valid is None else labels.clamp(max=valid - 1)
            kl, d = call(
                stem,
                *leaves[:4],
                bias=leaves[4],
                mask=mask,
                labels=lab,
                reduction=reduction,
                return_details=True,
                **options,
            )
            loss = kl if reduction != "none" else (kl * torch.arange(1.0, 7.0).reshape(LEAD)).sum()
            grads = torch.autograd.grad(loss, leaves)
            out[case, reduction] = ([kl.detach(), d.logp, d.entropy], list(grads))
    return out


def _rank(rank, world, sizes, valid, dtype=torch.float64, backend="torch"):
    h, h_ref, w, w_ref, b, labels, mask = _inputs(sum(sizes), dtype)
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])

    def shard_fn(reduce_hidden_grad=False, **extra):
        def call(stem, h_, h_ref_, w_, w_ref_, **kw):
            return getattr(klest, f"{stem}_from_hidden_vocab_parallel")(
                h_,
                w_,
                h_ref_,
                w_ref_,
                reduce_hidden_grad=reduce_hidden_grad,
                chunk_size=2,
                backend=backend,
                **extra,
                **kw,
            )

        return call

    shards = (h, h_ref, w[rows], w_ref[rows], b[rows], labels, mask)
    return {
        "plain": _run(shard_fn(), *shards),
        "reduced": _run(shard_fn(reduce_hidden_grad=True), *shards),
        "valid": _run(
            shard_fn(valid_vocab_size=valid, vocab_start_index=lo, vocab_size=sum(sizes)),
            *shards,
            valid=valid,
        ),
    }


def _single(stem, h, h_ref, w, w_ref, **kw):
    return getattr(klest, f"{stem}_from_hidden")(h, w, h_ref, w_ref, **kw)


@pytest.mark.parametrize(
    ("sizes", "valid", "dtype", "backend"),
    [
        ([7, 6], 9, torch.float64, "torch"),
        ([2, 5, 4], 6, torch.float64, "torch"),
        # The Triton kernels (CPU, through the interpreter) on float32, against the PyTorch
        # engine on the whole heads: the same tolerances in float32's roundings.
        pytest.param([7, 6], 9, torch.float32, "triton", marks=needs_triton),
    ],
)
def test_vocab_parallel_hidden_equals_single_process(tmp_path, sizes, valid, dtype, backend):
    results = run_ranks(_rank, len(sizes), tmp_path, sizes, valid, dtype, backend)
    h, h_ref, w, w_ref, b, labels, mask = _inputs(sum(sizes), dtype)
    for case, cut in (("plain", None), ("reduced", None), ("valid", valid)):
        v = sum(sizes) if cut is None else cut
        want = _run(_single, h, h_ref, w[:v], w_ref[:v], b[:v], labels, mask, valid=cut)
        scale = logit_scale(h @ w[:v].T + b[:v], h_ref @ w_ref[:v].T)
        for key, (outs, grads) in want.items():
            for rank, got in enumerate(results):
                g_outs, g_grads = got[case][key]
                what = f"{case} {key} rank {rank}"
                for i, (a, e) in enumerate(zip(g_outs, outs, strict=True)):
                    s = scale if e.dim() else 2 * float(scale.max())  # a mean of two positions
                    if e.dim():
                        s = torch.where(mask, scale, 1.0)
                    assert_close_to_rounding(a, e, ulps=2 * VALUE_ULPS, scale=s, what=f"{what} {i}")
                lo = sum(sizes[:rank])
                for j in (2, 3, 4):  # head shards: the rows of the full gradients (0 past V')
                    full = torch.zeros(sum(sizes), *grads[j].shape[1:], dtype=grads[j].dtype)
                    full[:v] = grads[j]
                    e = full[lo : lo + sizes[rank]]
                    tol = float(grads[j].abs().max())
                    assert_close_to_rounding(
                        g_grads[j], e, ulps=4 * GRAD_ULPS, scale=tol, what=f"{what} head {j}"
                    )
                if case == "reduced":  # the whole hidden-state gradients on every rank
                    for j in (0, 1):
                        tol = float(grads[j].abs().max())
                        assert_close_to_rounding(
                            g_grads[j], grads[j], ulps=4 * GRAD_ULPS, scale=tol, what=what
                        )
            if case != "reduced":  # the partial hidden-state gradients sum to the whole
                for j in (0, 1):
                    total = sum(got[case][key][1][j] for got in results)
                    tol = float(grads[j].abs().max())
                    assert_close_to_rounding(
                        total, grads[j], ulps=4 * GRAD_ULPS, scale=tol, what=f"{case} {key} sum"
                    )


def _count_rank(rank, world, sizes):
    h, h_ref, w, w_ref, _, labels, _ = _inputs(sum(sizes))
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    counts = {}
    for stem, options in (("kl", {}), ("jsd", {"beta": 0.3}), ("tv", {})):
        fn = getattr(klest, f"{stem}_from_hidden_vocab_parallel")

        def call(hh, _, fn=fn, options=options, **kw):
            return fn(hh, w[rows], h_ref, w_ref[rows], chunk_size=4, **options, **kw)

        counts[stem] = _collectives(h, None, labels, call)
    return counts


def test_vocab_parallel_hidden_collectives(tmp_path):
    """Per chunk of n_c rows: the KL's MAX of [2, n_c] and SUM of [7, n_c]; the JSD and TV one
    more SUM of [3, n_c] (their second phase); one gather of the shard sizes per call; none in
    the backward (the gradient is each shard's own, from the merged statistics)."""
    sizes = [7, 6]
    results = run_ranks(_count_rank, 2, tmp_path, sizes)
    n = LEAD[0] * LEAD[1]
    chunks = [4, n - 4]
    for got in results:
        kl = [("forward", "all_gather", "", (2,))]
        for n_c in chunks:
            kl += [
                ("forward", "all_reduce", "MAX", (2, n_c)),
                ("forward", "all_reduce", "SUM", (7, n_c)),
            ]
        assert got["kl"] == kl
        two_phase = [kl[0]]
        for i, n_c in enumerate(chunks):
            two_phase += [*kl[1 + 2 * i : 3 + 2 * i], ("forward", "all_reduce", "SUM", (3, n_c))]
        assert got["jsd"] == two_phase
        assert got["tv"] == two_phase
