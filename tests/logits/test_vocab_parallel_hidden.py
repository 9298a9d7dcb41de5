"""Vocab-parallel KL from hidden states over gloo equals single-process kl_from_hidden.

Rank r holds rows [o_r, o_r + V_r) of both LM heads (uneven shards, 2 and 3 ranks, one spawn
each); the hidden states are [S, B, H] (Megatron's layout). Every rank's value and details
equal the single-process ones, each rank's head gradients equal the rows of the full ones, the
ranks' partial hidden-state gradients sum to the full one (and ``reduce_hidden_grad=True`` gives
it on every rank), and ``valid_vocab_size`` gives the answer of the truncated heads. Float64;
tolerances as in ``test_vocab_parallel`` (same arithmetic, plus one product per logit: its
rounding is at the logits' scale, which ``logit_scale`` measures).
"""

from __future__ import annotations

import pytest
import torch

import klest
from tests._spawn import run_ranks
from tests._tolerance import assert_close_to_rounding, logit_scale
from tests.logits.test_vocab_parallel import GRAD_ULPS, VALUE_ULPS

LEAD = (3, 2)  # [s, b]
H, H_REF = 5, 4


def _inputs(v: int):
    g = torch.Generator().manual_seed(2)
    h = torch.randn((*LEAD, H), generator=g, dtype=torch.float64)
    h_ref = torch.randn((*LEAD, H_REF), generator=g, dtype=torch.float64)
    w = torch.randn(v, H, generator=g, dtype=torch.float64)
    w_ref = torch.randn(v, H_REF, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, LEAD, generator=g)
    mask = torch.ones(LEAD, dtype=torch.bool)
    mask[2, 1] = False
    return h, h_ref, w, w_ref, b, labels, mask


def _run(kl_fn, h, h_ref, w, w_ref, b, labels, mask, valid=None):
    """Every configuration's outputs and gradients (h, h_ref, w, w_ref, b)."""
    out = {}
    for direction in ("pi||ref", "ref||pi"):
        for reduction in ("seq-mean-token-sum", "none"):
            leaves = [t.clone().requires_grad_() for t in (h, h_ref, w, w_ref, b)]
            lab = labels if valid is None else labels.clamp(max=valid - 1)
            kl, d = kl_fn(
                *leaves[:4],
                bias=leaves[4],
                direction=direction,
                mask=mask,
                labels=lab,
                reduction=reduction,
                return_details=True,
            )
            loss = kl if reduction != "none" else (kl * torch.arange(1.0, 7.0).reshape(LEAD)).sum()
            grads = torch.autograd.grad(loss, leaves)
            out[direction, reduction] = ([kl.detach(), d.logp, d.entropy], list(grads))
    return out


def _rank(rank, world, sizes, valid):
    h, h_ref, w, w_ref, b, labels, mask = _inputs(sum(sizes))
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])

    def shard_fn(reduce_hidden_grad=False, **extra):
        def kl_fn(h_, h_ref_, w_, w_ref_, **kw):
            return klest.kl_from_hidden_vocab_parallel(
                h_,
                w_,
                h_ref_,
                w_ref_,
                reduce_hidden_grad=reduce_hidden_grad,
                chunk_size=2,
                **extra,
                **kw,
            )

        return kl_fn

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


def _single(h, h_ref, w, w_ref, **kw):
    return klest.kl_from_hidden(h, w, h_ref, w_ref, **kw)


@pytest.mark.parametrize(("sizes", "valid"), [([7, 6], 9), ([2, 5, 4], 6)])
def test_vocab_parallel_hidden_equals_single_process(tmp_path, sizes, valid):
    results = run_ranks(_rank, len(sizes), tmp_path, sizes, valid)
    h, h_ref, w, w_ref, b, labels, mask = _inputs(sum(sizes))
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
