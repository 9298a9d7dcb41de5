"""Context parallelism: each of 2 gloo ranks holds part of every sequence (zig-zag, head-tail,
contiguous; packed documents split one by one), and each rank's loss and gradient are its
tokens' part of single-process klest on the whole sequences.

The split is written out here (chunk indices), independently of klest's. Every rank's losses
summed, and its gradient, equal the whole batch's (float64, within 1e-12 of the scale): the
coefficients are computed from the same gathered numbers, only the sums' order differs.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import klest
from klest.testbeds import make_generator
from tests._spawn import run_ranks

C = 2
B, T, V = 4, 8, 5
GROUP = torch.tensor([0, 0, 1, 1])
DOCS = [4, 8, 0, 4]  # packed documents' lengths (each a multiple of 2C)
KINDS = ["zigzag", "head_tail", "contiguous"]
CASES = [  # estimator, grad, direction, baseline, off-policy, reduction
    ("k3", "cumulative", "pi||ref", "loo", False, "token-mean"),
    ("k3", "cumulative", "pi||ref", None, True, "seq-mean-token-sum"),
    ("k1", "score", "pi||ref", "loo", False, "seq-mean-token-sum"),
    ("k3", "cumulative", "ref||pi", "mean", False, "sum"),
    ("k3", "score", "ref||pi", None, True, "seq-mean-token-mean"),
    ("rb", "rb", "pi||ref", "loo", False, "seq-mean-token-sum"),
    ("rb", "rb", "pi||ref", None, True, "token-mean"),
    ("rb", "rb", "ref||pi", None, False, "sum"),
    ("k1", "token", "pi||ref", "exact-kl+loo", False, "none"),
    ("k3", "cumulative", "pi||ref", "ema", False, "seq-mean-token-sum"),
]
WEIGHTED = [  # with per-token weights of the objective (weights=), on-policy KL(pi||ref)
    ("k1", "cumulative", "pi||ref", "loo", False, "seq-mean-token-sum"),
    ("k3", "score", "pi||ref", None, False, "token-mean"),
    ("rb", "rb", "pi||ref", "loo", False, "sum"),
    ("k1", "token", "pi||ref", None, False, "none"),
]


def rank_columns(kind: str, length: int, rank: int) -> list[int]:
    """The columns of a sequence of ``length`` tokens that ``rank`` of C holds."""
    if kind == "contiguous":
        n = length // C
        return list(range(rank * n, (rank + 1) * n))
    h = length // (2 * C)
    first, second = rank * h, (2 * C - 1 - rank) * h
    return list(range(first, first + h)) + list(range(second, second + h))


def batch():
    g = make_generator(7)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    y = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    w = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:] = False  # right padding
    mask[2, :3] = False  # left padding
    mask[3, 2] = False  # a hole
    return z, y, w, tokens, mask


def at(x, tokens):
    return x.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def call(case, z, y, w, tokens, mask, **kw):
    estimator, grad, direction, baseline, off_policy, reduction = case
    if baseline == "ema":
        baseline = klest.BaselineEMA()
    uses_group = baseline in ("loo", "mean", "exact-kl+loo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return klest.kl_penalty(
            at(z, tokens),
            at(y, tokens),
            estimator=estimator,
            grad=grad,
            direction=direction,
            baseline=baseline,
            group=GROUP if uses_group else None,
            logp_behavior=at(w, tokens) if off_policy else None,
            logits=z,
            logits_ref=y,
            mask=mask,
            reduction=reduction,
            **kw,
        )


def token_weights(shape):
    """Positive weights, one per token, independent of the tokens."""
    return 0.5 + torch.rand(shape, generator=make_generator(11), dtype=torch.float64)


def counts_of(mask):
    return klest.GlobalCounts(mask.sum(), mask.any(-1).sum(), 1.0)


def packed_inputs():
    z, y, w, tokens, _ = batch()
    flat = [x.reshape(B * T, *x.shape[2:])[: sum(DOCS)] for x in (z, y, w, tokens)]
    mask = torch.ones(sum(DOCS), dtype=torch.bool)
    mask[5] = False
    cu = torch.tensor([0, *itertools.accumulate(DOCS)])
    return (*flat, mask, cu)


def _rank(rank: int, world: int):
    out = {}
    z, y, w, tokens, mask = batch()
    for kind in KINDS:
        cols = rank_columns(kind, T, rank)
        cp = klest.ContextParallel(kind=kind)
        for i, case in enumerate(CASES):
            zl = z[:, cols].clone().requires_grad_()
            kw = {"context_parallel": cp}
            if case[-1] not in ("sum", "none"):
                kw["counts"] = counts_of(mask)
            loss = call(case, zl, y[:, cols], w[:, cols], tokens[:, cols], mask[:, cols], **kw)
            (g,) = torch.autograd.grad(loss.sum(), zl)
            out[(kind, i)] = (loss.detach(), g)
        weights = token_weights((B, T))[:, cols]
        for i, case in enumerate(WEIGHTED):
            zl = z[:, cols].clone().requires_grad_()
            kw = {"context_parallel": cp, "weights": weights}
            if case[-1] not in ("sum", "none"):
                kw["counts"] = counts_of(mask)
            loss = call(case, zl, y[:, cols], w[:, cols], tokens[:, cols], mask[:, cols], **kw)
            (g,) = torch.autograd.grad(loss.sum(), zl)
            out[(kind, "weighted", i)] = (loss.detach(), g)
        reward = klest.kl_reward(
            at(z[:, cols], tokens[:, cols]),
            at(y[:, cols], tokens[:, cols]),
            mask=mask[:, cols],
            reward_to_go=True,
            context_parallel=cp,
        )
        out[(kind, "reward")] = reward
    # packed: each document split on its own, local offsets = global ones / C
    pz, py, pw, ptok, pmask, cu = packed_inputs()
    idx = [
        start + c
        for start, n in zip(cu.tolist(), DOCS, strict=False)
        for c in rank_columns("zigzag", n, rank)
    ]
    for i, case in enumerate(CASES):
        zl = pz[idx].clone().requires_grad_()
        kw = {"context_parallel": klest.ContextParallel(), "cu_seqlens": cu // C}
        if case[-1] not in ("sum", "none"):
            kw["counts"] = klest.GlobalCounts(pmask.sum(), sum(n > 0 for n in DOCS), 1.0)
        loss = call(case, zl, py[idx], pw[idx], ptok[idx], pmask[idx], **kw)
        (g,) = torch.autograd.grad(loss.sum(), zl)
        out[("packed", i)] = (loss.detach(), g, idx)
    weights = token_weights(sum(DOCS))[idx]
    for i, case in enumerate(WEIGHTED):
        zl = pz[idx].clone().requires_grad_()
        kw = {"context_parallel": klest.ContextParallel(), "cu_seqlens": cu // C}
        kw["weights"] = weights
        if case[-1] not in ("sum", "none"):
            kw["counts"] = klest.GlobalCounts(pmask.sum(), sum(n > 0 for n in DOCS), 1.0)
        loss = call(case, zl, py[idx], pw[idx], ptok[idx], pmask[idx], **kw)
        (g,) = torch.autograd.grad(loss.sum(), zl)
        out[("packed", "weighted", i)] = (loss.detach(), g, idx)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_rank, C, tmp_path_factory.mktemp("cp"))


def _check_rank_parts(what, whole, g, parts, *, per_token):
    """Each rank's ``(loss, gradient, where)``: its gradient is the whole batch's at ``where``
    (its tokens), and its loss is its part of the whole loss: the whole's values there
    (``per_token``: reduction "none" on padded rows), else summed over the ranks."""
    total = 0.0
    for r, (loss, grad, where) in enumerate(parts):
        _close(grad, g[where], f"{what} rank {r} gradient")
        if per_token:
            _close(loss, whole.detach()[where], f"{what} rank {r} values")
        else:
            total = total + loss.sum()
    if not per_token:
        _close(total, whole.detach().sum(), f"{what} summed loss")


def _close(a, b, what):
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1.0)
    assert float((a - b).abs().max()) <= 1e-12 * scale, what


@pytest.mark.parametrize("kind", KINDS)
def test_context_parallel_ranks_add_up_to_the_whole_sequences(ranks, kind):
    z, y, w, tokens, mask = batch()
    for i, case in enumerate(CASES):
        zz = z.clone().requires_grad_()
        kw = {} if case[-1] in ("sum", "none") else {"counts": counts_of(mask)}
        whole = call(case, zz, y, w, tokens, mask, **kw)
        (g,) = torch.autograd.grad(whole.sum(), zz)
        parts = [(*ranks[r][(kind, i)], (slice(None), rank_columns(kind, T, r))) for r in range(C)]
        _check_rank_parts(f"{kind} {case}", whole, g, parts, per_token=case[-1] == "none")
    want = klest.kl_reward(at(z, tokens), at(y, tokens), mask=mask, reward_to_go=True)
    for r in range(C):
        _close(ranks[r][(kind, "reward")], want[:, rank_columns(kind, T, r)], "reward-to-go")


def test_context_parallel_packed_documents_split_one_by_one(ranks):
    pz, py, pw, ptok, pmask, cu = packed_inputs()
    for i, case in enumerate(CASES):
        zz = pz.clone().requires_grad_()
        kw = {"cu_seqlens": cu}
        if case[-1] not in ("sum", "none"):
            kw["counts"] = klest.GlobalCounts(pmask.sum(), sum(n > 0 for n in DOCS), 1.0)
        whole = call(case, zz, py, pw, ptok, pmask, **kw)
        (g,) = torch.autograd.grad(whole.sum(), zz)
        parts = [ranks[r][("packed", i)] for r in range(C)]
        _check_rank_parts(f"packed {case}", whole, g, parts, per_token=False)


@pytest.mark.parametrize("kind", [*KINDS, "packed"])
def test_context_parallel_with_token_weights(ranks, kind):
    """weights= under context parallelism: each rank passes its tokens' weights; its loss and
    gradient are its part of the single-process weighted call's (the same 1e-12 of the scale:
    the weights are gathered with the other per-token inputs, only the sums' order differs)."""
    if kind == "packed":
        z, y, w, tokens, mask, cu = packed_inputs()
        weights, extra = token_weights(sum(DOCS)), {"cu_seqlens": cu}
        counts = klest.GlobalCounts(mask.sum(), sum(n > 0 for n in DOCS), 1.0)
    else:
        z, y, w, tokens, mask = batch()
        weights, extra, counts = token_weights((B, T)), {}, counts_of(mask)
    for i, case in enumerate(WEIGHTED):
        zz = z.clone().requires_grad_()
        kw = {**extra, "weights": weights}
        if case[-1] not in ("sum", "none"):
            kw["counts"] = counts
        whole = call(case, zz, y, w, tokens, mask, **kw)
        unweighted = call(case, z, y, w, tokens, mask, **{**kw, "weights": None})
        assert not torch.allclose(whole.detach(), unweighted)  # the weights matter here
        (g,) = torch.autograd.grad(whole.sum(), zz)
        if kind == "packed":
            parts = [ranks[r][("packed", "weighted", i)] for r in range(C)]
        else:
            parts = [
                (*ranks[r][(kind, "weighted", i)], (slice(None), rank_columns(kind, T, r)))
                for r in range(C)
            ]
        per_token = kind != "packed" and case[-1] == "none"
        _check_rank_parts(f"{kind} weighted {case}", whole, g, parts, per_token=per_token)


def test_context_parallel_refuses_what_has_no_per_rank_part():
    lp = -torch.rand(2, 4, dtype=torch.float64, requires_grad=True)
    cp = klest.ContextParallel()
    with pytest.raises(ValueError, match="needs counts="):
        klest.kl_penalty(lp, lp.detach(), context_parallel=cp)
    with pytest.raises(ValueError, match="per-sequence"):
        klest.kl_penalty(lp, lp.detach(), context_parallel=cp, reduction="per-sequence")
    with pytest.raises(ValueError, match="reparameterized"):
        klest.kl_penalty(
            lp,
            lp * 0.5,
            grad="pathwise",
            reparameterized=True,
            context_parallel=cp,
            reduction="sum",
        )
    with pytest.raises(TypeError, match=r"klest\.ContextParallel"):
        klest.kl_penalty(lp, lp.detach(), context_parallel="zigzag", reduction="sum")
    with pytest.raises(ValueError, match="kind must be"):
        klest.ContextParallel(kind="ring")


def _rank_cp_tp(rank: int, world: int):
    """4 ranks: context-parallel pairs {0, 2} and {1, 3}, vocabulary (tensor-parallel) pairs
    {0, 1} and {2, 3}: the exact KLs come from the vocabulary shards, the gradient from the
    whole sequences."""
    import torch.distributed as dist

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp_rank, tp_rank = rank // 2, rank % 2
    z, y, _, tokens, mask = batch()
    cols = rank_columns("zigzag", T, cp_rank)
    vocab = slice(0, 3) if tp_rank == 0 else slice(3, V)
    zl = z[:, cols].clone().requires_grad_()
    shard = zl[..., vocab]
    kls, details = klest.kl_from_logits_vocab_parallel(
        shard,
        y[:, cols][..., vocab],
        group=tp_groups[cp_rank],
        labels=tokens[:, cols],
        mask=mask[:, cols],
        reduction="none",
        return_details=True,
    )
    loss = klest.kl_penalty(
        details.logp,
        details.logp_ref,
        estimator="rb",
        grad="rb",
        baseline="loo",
        group=GROUP,
        position_kls=kls,
        mask=mask[:, cols],
        reduction="seq-mean-token-sum",
        counts=counts_of(mask),
        context_parallel=klest.ContextParallel(group=cp_groups[tp_rank]),
    )
    (g,) = torch.autograd.grad(loss, zl)
    return loss.detach(), g, cols, vocab


def test_context_parallel_with_vocabulary_shards(tmp_path):
    results = run_ranks(_rank_cp_tp, 4, tmp_path)
    z, y, _, tokens, mask = batch()
    zz = z.clone().requires_grad_()
    whole = klest.kl_penalty(
        at(zz, tokens),
        at(y, tokens),
        estimator="rb",
        grad="rb",
        baseline="loo",
        group=GROUP,
        logits=zz,
        logits_ref=y,
        mask=mask,
        reduction="seq-mean-token-sum",
    )
    (g,) = torch.autograd.grad(whole, zz)
    for rank, (_, grad, cols, vocab) in enumerate(results):
        # a rank's loss is its context-parallel part (replicated over its vocabulary pair);
        # the gradient to its shard of its columns is the whole batch's there
        _close(grad[..., vocab], g[:, cols][..., vocab], f"rank {rank} gradient")
    _close(results[0][0] + results[2][0], whole.detach(), "the parts' losses")
