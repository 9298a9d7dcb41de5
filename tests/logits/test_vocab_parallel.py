"""Vocab-parallel KL over gloo in local processes equals the single-process kl_from_logits.

Each case spawns ``world`` processes; rank r holds columns [o_r, o_r + V_r) of the same logits.
Tolerances, in roundings of the arithmetic's dtype (float32 or float64): values within
``VALUE_ULPS`` of their row's logit scale (:func:`tests._tolerance.logit_scale`; the merge
reorders the sums over the shards and takes the log of the merged sums); gradients within
``GRAD_ULPS`` of the largest entry: ``q (d - sum q d)`` inherits the rounding of ``lse`` times
the size of ``d``, which cancels at the scale of the row's largest entries.
"""

from __future__ import annotations

import importlib.util
import math
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import klest
from tests._spawn import start_ranks
from tests._tolerance import assert_close_to_rounding, logit_scale

N_LEAD = (2, 3)
VALUE_ULPS = 16
"""Each path: a log-softmax rounding at the row's logit scale, sums over V (and the shards) of
terms that size in random directions. Measured: at most 0.6 for the two paths together."""
GRAD_ULPS = 32
"""Each path: the gradient's terms round at the largest entry's scale and sum over V <= 13.
Measured: at most 10 for the two paths together."""


def _case_inputs(sizes: list[int], dtype: torch.dtype):
    """Logits over ``V = sum(sizes)`` columns; labels on the shard boundaries: the last
    column of shard 0 and the first of shard 1 at positions (0, 0), (0, 1), the first and the
    last of the vocabulary at (1, 0), (1, 1) with two shards, or shard 1's last column and
    shard 2's first with three (which shard owns a label is decided right there)."""
    v = sum(sizes)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn((*N_LEAD, v), generator=g, dtype=torch.float64) * 2).to(dtype)
    y = (torch.randn((*N_LEAD, v), generator=g, dtype=torch.float64) * 2).to(dtype)
    z[0, 1, :3] = -math.inf  # a masked-vocabulary row: rank 0 of [2, 5, 4] holds only -inf
    y[0, 1, :3] = -math.inf
    labels = torch.randint(0, v, N_LEAD, generator=g)
    ends = [sum(sizes[: r + 1]) for r in range(len(sizes))]  # each shard's first column after
    labels[0, :2] = torch.tensor([ends[0] - 1, ends[0]]) if len(sizes) > 1 else labels[0, :2]
    labels[1, :2] = torch.tensor([ends[1] - 1, ends[1]] if len(sizes) > 2 else [0, v - 1])
    labels[1, 2] = -100
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return z, y, labels, mask


def _run_all(z, y, labels, mask, kl_fn):
    """Outputs and gradients of every configuration, for one shard (or the whole vocabulary)."""
    results = []
    for direction in ("pi||ref", "ref||pi"):
        zz, yy = z.clone().requires_grad_(), y.clone().requires_grad_()
        kl, d = kl_fn(
            zz,
            yy,
            direction=direction,
            labels=labels,
            mask=mask,
            reduction="none",
            return_details=True,
        )
        w = torch.arange(1.0, 7.0, dtype=kl.dtype, device=kl.device).reshape(N_LEAD)
        loss = (kl * w).sum() + 0.3 * d.logp.sum() - 0.5 * d.logp_ref.sum() + d.entropy.sum()
        outputs = (kl, d.logp, d.logp_ref, d.entropy)
        results.append([t.detach() for t in outputs] + list(torch.autograd.grad(loss, [zz, yy])))
        zz = z.clone().requires_grad_()
        kl = kl_fn(zz, y, direction=direction, reduction="seq-mean-token-sum", temperature=0.7)
        results.append([kl.detach(), *torch.autograd.grad(kl, [zz])])
    # Trainer batches: a row with no valid position counts in no mean; no valid position at all
    # gives 0 with a zero gradient.
    empty_row = mask.clone()
    empty_row[0] = False
    for m in (empty_row, torch.zeros_like(mask)):
        zz = z.clone().requires_grad_()
        kl = kl_fn(zz, y, mask=m, reduction="seq-mean-token-sum")
        results.append([kl.detach(), *torch.autograd.grad(kl, [zz])])
    assert float(results[-1][0]) == 0.0 and float(results[-1][1].abs().max()) == 0.0
    return results


def _collectives(z, y, labels, kl_fn):
    """The collectives of one call and its backward, as ``(phase, name, op, shape)``."""
    seen = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}
    phase = ["forward"]

    def recording(name):
        def call(tensor_or_list, *args, **kwargs):
            t = args[0] if name == "all_gather" else tensor_or_list
            op = str(kwargs.get("op", "")).rsplit(".", 1)[-1] if name == "all_reduce" else ""
            seen.append((phase[0], name, op, tuple(t.shape)))
            return originals[name](tensor_or_list, *args, **kwargs)

        return call

    try:
        for name in originals:
            setattr(dist, name, recording(name))
        zz = z.clone().requires_grad_()
        kl = kl_fn(zz, y, labels=labels, reduction="sum")
        phase[0] = "backward"
        kl.backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return seen


def _worker(rank, world, store_path, sizes, dtype, backend, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        z, y, labels, mask = _case_inputs(sizes, dtype)
        lo = sum(sizes[:rank])
        shard = slice(lo, lo + sizes[rank])

        def kl_fn(zz, yy, **kw):
            return klest.kl_from_logits_vocab_parallel(
                zz, yy, vocab_size=sum(sizes), backend=backend, **kw
            )

        result = {"ok": _run_all(z[..., shard], y[..., shard], labels, mask, kl_fn)}
        errors = {}
        for name, call in {
            "vocab_size": lambda: klest.kl_from_logits_vocab_parallel(
                z[..., shard], y[..., shard], vocab_size=sum(sizes) + 1
            ),
            "rows": lambda: klest.kl_from_logits_vocab_parallel(
                z[..., shard][: 1 + rank % 2], y[..., shard][: 1 + rank % 2]
            ),
        }.items():
            try:
                call()
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        result["errors"] = errors
        result["collectives"] = _collectives(z[..., shard], y[..., shard], labels, kl_fn)
    except Exception:  # reported to the parent, which fails the test with it
        result = {"traceback": traceback.format_exc()}
    torch.save(result, f"{out_path}.{rank}")
    dist.destroy_process_group()


# The gloo workers hold CPU tensors: the Triton kernels run on them through the interpreter only.
TRITON_ON_CPU = (
    importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
)
needs_triton = pytest.mark.skipif(
    not TRITON_ON_CPU, reason="needs triton and TRITON_INTERPRET=1 (make test sets it)"
)


@pytest.mark.parametrize(
    ("sizes", "dtype", "backend"),
    [
        ([7, 6], torch.float32, "torch"),
        ([2, 5, 4], torch.float64, "torch"),
        # Triton kernels (on CPU through the interpreter): rank 0 holds only -inf for a row.
        pytest.param([2, 5, 4], torch.float32, "triton", marks=needs_triton),
    ],
)
def test_vocab_parallel_equals_single_process(tmp_path, sizes, dtype, backend):
    world = len(sizes)
    start_ranks(
        _worker,
        world,
        (world, str(tmp_path / "store"), sizes, dtype, backend, str(tmp_path / "out")),
    )
    z, y, labels, mask = _case_inputs(sizes, dtype)
    expected = _run_all(z, y, labels, mask, klest.kl_from_logits)
    rows = logit_scale(z, y, temperature=0.7)  # the smaller temperature of _run_all's
    sums = N_LEAD[-1] * float(rows.max())  # a mean of rows' sums over positions
    for rank in range(world):
        got = torch.load(tmp_path / f"out.{rank}")
        assert "traceback" not in got, got.get("traceback")
        lo = sum(sizes[:rank])
        for case, (g_case, e_case) in enumerate(zip(got["ok"], expected, strict=True)):
            n_grads = 2 if len(e_case) == 6 else 1
            outs, grads = e_case[:-n_grads], e_case[-n_grads:]
            for i, (a, e) in enumerate(zip(g_case[:-n_grads], outs, strict=True)):
                finite = torch.isfinite(e)
                assert torch.equal(finite, torch.isfinite(a)), (rank, case, i)
                scale = rows[finite] if e.shape == N_LEAD else sums
                what = f"rank {rank} case {case} output {i}"
                # two computations in the same dtype: twice one's rounding
                ulps = 2 * VALUE_ULPS
                assert_close_to_rounding(a[finite], e[finite], ulps=ulps, scale=scale, what=what)
            for a, e in zip(g_case[-n_grads:], grads, strict=True):
                e_shard = e[..., lo : lo + sizes[rank]]
                what = f"rank {rank} case {case} gradient"
                scale = float(e.abs().max())  # the whole row's, not only the shard's
                assert_close_to_rounding(a, e_shard, ulps=2 * GRAD_ULPS, scale=scale, what=what)
        assert "add up to V" in (got["errors"]["vocab_size"] or ""), got["errors"]
        # The module's count: a gather of the shard sizes, a MAX of [2, N] and a SUM of [7, N]
        # floats in the forward; none in the backward.
        n = math.prod(N_LEAD)
        assert got["collectives"] == [
            ("forward", "all_gather", "", (2,)),
            ("forward", "all_reduce", "MAX", (2, n)),
            ("forward", "all_reduce", "SUM", (7, n)),
        ], got["collectives"]
        assert "same positions" in (got["errors"]["rows"] or ""), got["errors"]


def test_needs_initialized_process_group():
    with pytest.raises(RuntimeError, match=r"torch\.distributed"):
        klest.kl_from_logits_vocab_parallel(torch.zeros(2, 3), torch.zeros(2, 3))


def _nccl_worker(rank, store_path, out_path):
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        z, y, labels, mask = (t.cuda() for t in _case_inputs([11], torch.float32))

        def kl_fn(zz, yy, **kw):
            return klest.kl_from_logits_vocab_parallel(zz, yy, vocab_size=11, **kw)

        result = {"ok": [[t.cpu() for t in case] for case in _run_all(z, y, labels, mask, kl_fn)]}
    except Exception:
        result = {"traceback": traceback.format_exc()}
    torch.save(result, out_path)
    dist.destroy_process_group()


@pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA GPU and NCCL (run on the GPU machine)",
)
def test_nccl_single_rank_runs_the_same_collectives(tmp_path):
    """The collectives over NCCL (CUDA tensors, the Triton kernels): one rank, as one GPU allows
    (NCCL refuses two ranks on one device); the merge must then reproduce kl_from_logits."""
    mp.spawn(_nccl_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=1)
    got = torch.load(tmp_path / "out")
    assert "traceback" not in got, got.get("traceback")
    z, y, labels, mask = (t.cuda() for t in _case_inputs([11], torch.float32))
    expected = _run_all(z, y, labels, mask, klest.kl_from_logits)
    rows = logit_scale(z, y, temperature=0.7)
    for g_case, e_case in zip(got["ok"], expected, strict=True):
        n_grads = 2 if len(e_case) == 6 else 1
        for i, (a, e) in enumerate(zip(g_case, e_case, strict=True)):
            # One shard: the merge's exp/log round trip of float32 statistics, at the rows'
            # logit scale (values) or the largest entry's (gradients), as above.
            e = e.cpu()
            if i >= len(e_case) - n_grads:
                assert_close_to_rounding(a, e, ulps=2 * GRAD_ULPS, what=f"gradient {i}")
            else:
                scale = rows.to(e.device) if e.shape == N_LEAD else N_LEAD[-1] * rows.max()
                assert_close_to_rounding(a, e, ulps=2 * VALUE_ULPS, scale=scale, what=f"{i}")
