"""DTensor logits: kl_from_logits, jsd_from_logits and kl_penalty(logits=...) on a device mesh
over gloo; kl_from_hidden, tv_from_hidden and skew_kl_from_hidden on row-sharded DTensor heads.

A 1-D mesh of 2 ranks shards the vocabulary (V even and odd: DTensor's uneven chunks); a 2-D
(context, tensor) mesh of 4 ranks shards the positions over the first dimension and the
vocabulary over the second. The result is a DTensor with the vocabulary replicated and the
other placements kept; its full tensor, and the local gradients, equal the single-process ones.
Tolerances: those of ``test_vocab_parallel`` (the same merge, in float64).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import klest
from tests._spawn import run_ranks
from tests._tolerance import assert_close_to_rounding, logit_scale
from tests.logits.test_vocab_parallel import GRAD_ULPS, VALUE_ULPS

B, T = 2, 4


def _inputs(v: int):
    g = torch.Generator().manual_seed(5)
    z = torch.randn(B, T, v, generator=g, dtype=torch.float64) * 2
    y = torch.randn(B, T, v, generator=g, dtype=torch.float64) * 2
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64)
    logp_ref = -torch.rand(B, T, generator=g, dtype=torch.float64)
    return z, y, logp, logp_ref


def _rank(rank, world, mesh_shape, sizes):
    return {v: _rank_v(v, mesh_shape) for v in sizes}


def _rank_v(v, mesh_shape):
    names = ("cp", "tp")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    z, y, logp, logp_ref = _inputs(v)
    vocab = [Shard(2)] if len(mesh_shape) == 1 else [Shard(1), Shard(2)]
    positions = [Replicate()] if len(mesh_shape) == 1 else [Shard(1), Replicate()]
    results = {}
    for direction in ("pi||ref", "ref||pi"):
        zz = distribute_tensor(z, mesh, vocab).requires_grad_()
        kl = klest.kl_from_logits(
            zz, distribute_tensor(y, mesh, vocab), direction=direction, reduction="none"
        )
        assert list(kl.placements) == positions, kl.placements
        w = distribute_tensor(
            torch.arange(1.0, 1.0 + B * T, dtype=z.dtype).reshape(B, T), mesh, positions
        )
        (kl * w).sum().full_tensor().backward()
        results["none", direction] = (kl.full_tensor().detach(), zz.grad.to_local())
    zz = distribute_tensor(z, mesh, vocab).requires_grad_()
    total = klest.kl_from_logits(zz, distribute_tensor(y, mesh, vocab), reduction="sum")
    want = [Replicate()] if len(mesh_shape) == 1 else [Partial(), Replicate()]
    assert list(total.placements) == want, total.placements
    total.full_tensor().backward()
    results["sum"] = (total.full_tensor().detach(), zz.grad.to_local())
    # the JSD dispatches the same way (a two-step merge over the vocabulary's mesh dimension)
    zz = distribute_tensor(z, mesh, vocab).requires_grad_()
    jsd = klest.jsd_from_logits(zz, distribute_tensor(y, mesh, vocab), beta=0.3, reduction="none")
    assert list(jsd.placements) == positions, jsd.placements
    (jsd * w).sum().full_tensor().backward()
    results["jsd none"] = (jsd.full_tensor().detach(), zz.grad.to_local())
    # kl_penalty with DTensor logits: this rank's positions of plain log-probs.
    t_local = (
        slice(None) if len(mesh_shape) == 1 else _t_slice(mesh.get_local_rank("cp"), mesh_shape[0])
    )
    zz = distribute_tensor(z, mesh, vocab).requires_grad_()
    lp = logp[:, t_local].clone().requires_grad_()
    loss = klest.kl_penalty(
        lp,
        logp_ref[:, t_local],
        estimator="rb",
        grad="rb",
        logits=zz,
        logits_ref=distribute_tensor(y, mesh, vocab),
        reduction="none",
        context_parallel=None
        if len(mesh_shape) == 1
        else klest.ContextParallel(group=mesh.get_group("cp"), kind="contiguous"),
    )
    loss.sum().backward()
    results["penalty"] = (loss.detach(), lp.grad, zz.grad.to_local())
    if len(mesh_shape) == 1:  # heads sharded over their rows, replicated hidden states
        results["hidden"] = {stem: _hidden_dtensor(mesh, v, stem) for stem in HIDDEN}
    return results


HIDDEN = {"kl": {}, "tv": {}, "skew_kl": {"alpha": 0.3}}
"""Functions ``klest.<stem>_from_hidden`` run on DTensor heads, with their options."""


def _hidden_inputs(v):
    g = torch.Generator().manual_seed(6)
    shapes = [(B, T, 5), (v, 5), (B, T, 3), (v, 3)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _hidden_dtensor(mesh, v, stem):
    h, w, h_ref, w_ref = _hidden_inputs(v)
    leaves = [
        distribute_tensor(h, mesh, [Replicate()]).requires_grad_(),
        distribute_tensor(w, mesh, [Shard(0)]).requires_grad_(),
    ]
    kl = getattr(klest, f"{stem}_from_hidden")(
        *leaves,
        distribute_tensor(h_ref, mesh, [Replicate()]),
        distribute_tensor(w_ref, mesh, [Shard(0)]),
        reduction="token-mean",
        **HIDDEN[stem],
    )
    assert list(kl.placements) == [Replicate()], kl.placements
    kl.full_tensor().backward()
    return kl.full_tensor().detach(), leaves[0].grad.full_tensor(), leaves[1].grad.to_local()


def _t_slice(cp_rank: int, cp: int) -> slice:
    n = T // cp
    return slice(cp_rank * n, (cp_rank + 1) * n)


def _single(v):
    z, y, logp, logp_ref = _inputs(v)
    out = {}
    for direction in ("pi||ref", "ref||pi"):
        zz = z.clone().requires_grad_()
        kl = klest.kl_from_logits(zz, y, direction=direction, reduction="none")
        (kl * torch.arange(1.0, 1.0 + B * T, dtype=z.dtype).reshape(B, T)).sum().backward()
        out["none", direction] = (kl.detach(), zz.grad)
    zz = z.clone().requires_grad_()
    total = klest.kl_from_logits(zz, y, reduction="sum")
    total.backward()
    out["sum"] = (total.detach(), zz.grad)
    zz = z.clone().requires_grad_()
    jsd = klest.jsd_from_logits(zz, y, beta=0.3, reduction="none")
    (jsd * torch.arange(1.0, 1.0 + B * T, dtype=z.dtype).reshape(B, T)).sum().backward()
    out["jsd none"] = (jsd.detach(), zz.grad)
    zz, lp = z.clone().requires_grad_(), logp.clone().requires_grad_()
    loss = klest.kl_penalty(
        lp, logp_ref, estimator="rb", grad="rb", logits=zz, logits_ref=y, reduction="none"
    )
    loss.sum().backward()
    out["penalty"] = (loss.detach(), lp.grad, zz.grad)
    return out


def _check(results, v, mesh_shape):
    z, y, _logp, _logp_ref = _inputs(v)
    want = _single(v)
    scale = logit_scale(z, y)
    chunks = torch.arange(v).chunk(mesh_shape[-1])  # DTensor's Shard: torch.chunk's split
    for rank, by_v in enumerate(results):
        got = by_v[v]
        tp_rank = rank % mesh_shape[-1]
        cols = chunks[tp_rank]
        t_rows = (
            slice(None) if len(mesh_shape) == 1 else _t_slice(rank // mesh_shape[-1], mesh_shape[0])
        )
        pen, pen_lp, pen_z = want["penalty"]
        g_pen, g_lp, g_z = got["penalty"]
        what = f"penalty {rank}"
        assert_close_to_rounding(
            g_pen, pen[:, t_rows], ulps=2 * VALUE_ULPS, scale=scale[:, t_rows], what=what
        )
        lp_scale = float(pen.abs().sum(-1).max())  # the future KLs' sums the scores carry
        assert_close_to_rounding(
            g_lp, pen_lp[:, t_rows], ulps=2 * VALUE_ULPS, scale=lp_scale, what=what
        )
        e = pen_z[:, t_rows][..., cols[0] : cols[-1] + 1]
        assert_close_to_rounding(
            g_z, e, ulps=2 * GRAD_ULPS, scale=float(pen_z.abs().max()), what=what
        )
        for key, (value, grad) in ((k, w) for k, w in want.items() if k != "penalty"):
            g_value, g_grad = got[key]
            s = scale if value.dim() else float(scale.sum())
            assert_close_to_rounding(
                g_value, value, ulps=2 * VALUE_ULPS, scale=s, what=f"{key} {rank}"
            )
            e = grad[:, t_rows][..., cols[0] : cols[-1] + 1]
            assert_close_to_rounding(
                g_grad,
                e,
                ulps=2 * GRAD_ULPS,
                scale=float(grad.abs().max()),
                what=f"{key} {rank} grad",
            )


def test_one_dimensional_mesh_shards_the_vocabulary(tmp_path):
    """V = 8 (even chunks) and 7 (DTensor's uneven ones) in one spawn; logits and, from
    hidden states, heads sharded over their rows (the hidden states' gradient, a Partial sum
    over the ranks, reduces to the whole one)."""
    results = run_ranks(_rank, 2, tmp_path, (2,), (8, 7))
    for v in (8, 7):
        _check(results, v, (2,))
    for v, stem in ((v, stem) for v in (8, 7) for stem in HIDDEN):
        h, w, h_ref, w_ref = (t.requires_grad_(i < 2) for i, t in enumerate(_hidden_inputs(v)))
        fn = getattr(klest, f"{stem}_from_hidden")
        kl = fn(h, w, h_ref, w_ref, reduction="token-mean", **HIDDEN[stem])
        d_h, d_w = torch.autograd.grad(kl, [h, w])
        rows = torch.arange(v).chunk(2)
        for rank, by_v in enumerate(results):
            got, g_h, g_w = by_v[v]["hidden"][stem]
            what = f"hidden {stem} V={v} rank {rank}"
            assert_close_to_rounding(got, kl.detach(), ulps=2 * VALUE_ULPS, what=what)
            tol = float(d_h.abs().max())
            assert_close_to_rounding(g_h, d_h, ulps=4 * GRAD_ULPS, scale=tol, what=what)
            e = d_w[rows[rank][0] : rows[rank][-1] + 1]
            tol = float(d_w.abs().max())
            assert_close_to_rounding(g_w, e, ulps=4 * GRAD_ULPS, scale=tol, what=what)


def test_context_by_tensor_mesh(tmp_path):
    results = run_ranks(_rank, 4, tmp_path, (2, 2), (7,))
    _check(results, 7, (2, 2))
