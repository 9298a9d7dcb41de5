"""A step split over data-parallel ranks and micro-batches gives the loss and gradient of one
call on the whole batch: global counts (:func:`klest.distributed.global_counts`) and group
baselines computed where the whole group is visible (:func:`klest.group_baselines`).

Two gloo processes, spawned once for the module; each holds a different number of the batch's
8 sequences (with an empty one), processes them in two micro-batches, sums the micro-batches'
gradients and averages over ranks as DDP does. The parent compares with single-process klest
on the whole batch: float64 within 1e-12 of the value's scale; float32 within ``F32_ULPS``
roundings of the largest entry (the pieces add the same terms in another order: a sum of at
most 40 tokens per loss, so 2 x 40 roundings, and 4x margin).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import klest
from klest.testbeds import make_generator
from tests._spawn import run_ranks
from tests._tolerance import assert_close_to_rounding

S, T, V = 8, 5, 4
GROUP = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
LENGTHS = torch.tensor([5, 2, 0, 4, 1, 5, 3, 2])
# Each rank's rows, as two micro-batches: unequal counts, every group split over the ranks.
PIECES = {0: [[0, 3], [5, 2, 7]], 1: [[1, 6], [4]]}
REDUCTIONS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "sum"]
SPLIT_GRADS = ["cumulative", "score", "rb"]
F32_ULPS = 320


def batch(dtype: torch.dtype):
    g = make_generator(0)
    params = torch.randn(S, T, V, generator=g, dtype=torch.float64).to(dtype)
    ref = torch.randn(S, T, V, generator=g, dtype=torch.float64).to(dtype)
    tokens = torch.randint(0, V, (S, T), generator=g)
    mask = torch.arange(T) < LENGTHS.unsqueeze(-1)
    return params, ref, tokens, mask


def logp_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def losses(params, ref, tokens, mask, rows, *, counts, reduction, baseline, grad):
    """The losses of one piece (rows of the batch), each a scalar with a graph to params."""
    z = params[rows]
    logp, logp_ref = logp_of(z, tokens[rows]), logp_of(ref[rows], tokens[rows])
    common = {"mask": mask[rows], "reduction": reduction, "counts": counts}
    out = {
        "k3/cumulative": klest.kl_penalty(logp, logp_ref, **common),
        "rb/rb": klest.kl_penalty(
            logp, logp_ref, estimator="rb", grad="rb", logits=z, logits_ref=ref[rows], **common
        ),
        "kl_from_logits": klest.kl_from_logits(z, ref[rows], **common),
        "aggregate": klest.aggregate(logp - logp_ref, **common),
    }
    if baseline is not None:
        kw = {"logits": z, "logits_ref": ref[rows]} if grad == "rb" else {}
        est = "rb" if grad == "rb" else "k3"
        out = {
            f"split/{grad}": klest.kl_penalty(
                logp, logp_ref, estimator=est, grad=grad, baseline=baseline, **kw, **common
            )
        }
    return out


def split_baselines(params, ref, tokens, mask, grad):
    """The group baselines of the whole batch, as the engine's driver computes them."""
    logp, logp_ref = logp_of(params, tokens), logp_of(ref, tokens)
    kw = {"logits": params, "logits_ref": ref} if grad == "rb" else {}
    t = klest.penalty_targets(logp.detach(), logp_ref, grad=grad, mask=mask, **kw)
    return klest.group_baselines(t.targets, mask=t.mask, group=GROUP)


def _rank(rank: int, world: int, dtype: torch.dtype):
    """This rank's averaged gradients and mean loss values for every case."""
    params, ref, tokens, mask = batch(dtype)
    counts = klest.distributed.global_counts([mask[rows] for rows in PIECES[rank]])
    results = {}
    cases = [(r, None, None) for r in REDUCTIONS]
    cases += [(r, g, "split") for r in REDUCTIONS for g in SPLIT_GRADS]
    for reduction, grad, split in cases:
        baseline_all = None if split is None else split_baselines(params, ref, tokens, mask, grad)
        p = params.clone().requires_grad_()
        values, grads = {}, {}
        for rows in PIECES[rank]:
            piece_counts = counts
            baseline = None
            if baseline_all is not None:
                baseline = baseline_all[rows].reshape(-1) if grad == "score" else baseline_all[rows]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = losses(
                    p,
                    ref,
                    tokens,
                    mask,
                    rows,
                    counts=piece_counts,
                    reduction=reduction,
                    baseline=baseline,
                    grad=grad,
                )
            for name, loss in out.items():
                (g,) = torch.autograd.grad(loss, p, retain_graph=True)
                grads[name] = grads.get(name, 0) + g
                values[name] = values.get(name, 0) + loss.detach()
        for name in grads:
            dist.all_reduce(grads[name])  # DDP: the mean over ranks
            dist.all_reduce(values[name])
            results[(reduction, name)] = (values[name] / world, grads[name] / world)
    return results


def _whole_batch(dtype: torch.dtype):
    params, ref, tokens, mask = batch(dtype)
    out = {}
    for reduction in REDUCTIONS:
        p = params.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            whole = losses(
                p,
                ref,
                tokens,
                mask,
                list(range(S)),
                counts=None,
                reduction=reduction,
                baseline=None,
                grad=None,
            )
            for grad in SPLIT_GRADS:
                kw = {"logits": p, "logits_ref": ref} if grad == "rb" else {}
                logp, logp_ref = logp_of(p, tokens), logp_of(ref, tokens)
                whole[f"split/{grad}"] = klest.kl_penalty(
                    logp,
                    logp_ref,
                    estimator="rb" if grad == "rb" else "k3",
                    grad=grad,
                    baseline="loo",
                    group=GROUP,
                    mask=mask,
                    reduction=reduction,
                    **kw,
                )
        for name, loss in whole.items():
            (g,) = torch.autograd.grad(loss, p, retain_graph=True)
            out[(reduction, name)] = (loss.detach(), g)
    return out


DTYPES = (torch.float64, torch.float32)


def _rank_every_dtype(rank: int, world: int) -> dict:
    return {dtype: _rank(rank, world, dtype) for dtype in DTYPES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both dtypes' per-rank results, from one spawn of two processes."""
    per_rank = run_ranks(_rank_every_dtype, 2, tmp_path_factory.mktemp("dp"))
    return {dtype: [r[dtype] for r in per_rank] for dtype in DTYPES}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_pieces_over_ranks_and_micro_batches_equal_the_whole_batch(ranks, dtype):
    expected = _whole_batch(dtype)
    per_rank = ranks[dtype]
    assert set(per_rank[0]) == set(expected)
    for key, (value, grad) in expected.items():
        for r, got in enumerate(per_rank):
            got_value, got_grad = got[key]
            what = f"{key} rank {r}"
            if dtype == torch.float64:
                scale = max(float(value.abs()), float(grad.abs().max()), 1.0)
                assert float((got_value - value).abs()) <= 1e-12 * scale, what
                assert float((got_grad - grad).abs().max()) <= 1e-12 * scale, what
            else:
                assert_close_to_rounding(got_value, value, ulps=F32_ULPS, what=what)
                assert_close_to_rounding(got_grad, grad, ulps=F32_ULPS, what=what + " grad")


def test_local_counts_are_not_the_global_ones():
    """The check has power: each rank reducing by its own counts (the engines' old default)
    differs from the whole batch, as with unequal masks it must."""
    params, ref, tokens, mask = batch(torch.float64)
    p = params.clone().requires_grad_()
    pieces = [rows for rank in PIECES for rows in PIECES[rank]]
    local = sum(
        klest.kl_penalty(
            logp_of(p[r], tokens[r]),
            logp_of(ref[r], tokens[r]),
            mask=mask[r],
            reduction="token-mean",
        )
        for r in pieces
    ) / len(pieces)
    whole = klest.kl_penalty(
        logp_of(p, tokens), logp_of(ref, tokens), mask=mask, reduction="token-mean"
    )
    assert float((local - whole).detach().abs()) > 1e-3


def test_split_group_baselines_do_not_depend_on_the_sample_itself():
    """Leave-one-out: changing a sample's own targets leaves its baseline as it was (up to the
    group sum's rounding) and moves its group-mate's, and the group baselines of a permuted
    batch are the permuted baselines."""
    params, ref, tokens, mask = batch(torch.float64)
    t = klest.penalty_targets(logp_of(params, tokens), logp_of(ref, tokens), mask=mask)
    b = klest.group_baselines(t.targets, mask=t.mask, group=GROUP)
    changed = t.targets.clone()
    changed[0] += 7.0  # row 0's group-mate, row 1, has tokens where row 0 does
    b2 = klest.group_baselines(changed, mask=t.mask, group=GROUP)
    # (sum of the group - own) / (n - 1): its own value enters and leaves the sum, exactly up to
    # the rounding of that sum (2 roundings at the changed sum's scale)
    assert_close_to_rounding(b2[0], b[0], ulps=2, scale=float(changed[:2].abs().max()))
    assert float((b2[1] - b[1]).abs().max()) > 1.0
    order = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    bp = klest.group_baselines(t.targets[order], mask=t.mask[order], group=GROUP[order])
    assert torch.equal(bp, b[order])


def test_global_counts_refuse_bad_masks_and_a_group_without_distributed():
    with pytest.raises(ValueError, match="at least one mask"):
        klest.distributed.global_counts([])
    with pytest.raises(ValueError, match=r"torch\.distributed"):
        klest.distributed.global_counts(torch.ones(2, 2), group=object())
    with pytest.raises(ValueError, match="counts normalise the scalar reductions"):
        klest.kl_penalty(
            -torch.rand(2, 2), -torch.rand(2, 2), reduction="none", counts=klest.GlobalCounts(4, 2)
        )
