"""Vocab-parallel KL with a padded vocabulary and given shard offsets, over gloo.

``valid_vocab_size=V'`` leaves out the columns ``[V', V)``: every rank's outputs equal the
single-process KL of the first V' columns, and the padding's gradient is exactly 0, whether a
shard is whole, cut, or padding only. ``vocab_start_index=`` gives the same answers without the
all-gather of the shard sizes. Tolerances: those of ``test_vocab_parallel`` (same arithmetic).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import klest
from tests._spawn import run_ranks
from tests._tolerance import assert_close_to_rounding, logit_scale
from tests.logits.test_vocab_parallel import GRAD_ULPS, VALUE_ULPS

SIZES = [5, 4, 3]  # V = 12 over three ranks
LEAD = (2, 3)


def _inputs(valid: int):
    g = torch.Generator().manual_seed(1)
    v = sum(SIZES)
    z = torch.randn((*LEAD, v), generator=g, dtype=torch.float64) * 2
    y = torch.randn((*LEAD, v), generator=g, dtype=torch.float64) * 2
    z[..., valid:] = 40.0  # padding that would dominate both softmaxes if it counted
    y[..., valid:] = -40.0
    labels = torch.randint(0, valid, LEAD, generator=g)
    labels[0, 0] = valid - 1  # the last real token
    return z, y, labels


def _outputs(z, y, labels, direction, kl_fn):
    zz, yy = z.clone().requires_grad_(), y.clone().requires_grad_()
    kl, d = kl_fn(zz, yy, direction=direction, labels=labels, reduction="none", return_details=True)
    loss = (kl * torch.arange(1.0, 7.0, dtype=kl.dtype).reshape(LEAD)).sum()
    loss = loss + 0.3 * d.logp.sum() - 0.5 * d.logp_ref.sum() + d.entropy.sum()
    grads = torch.autograd.grad(loss, [zz, yy])
    return [t.detach() for t in (kl, d.logp, d.logp_ref, d.entropy)], list(grads)


CASES = [(12, True), (9, False), (7, True)]
"""(V', offsets given): no padding; rank 2 padding only; rank 1 cut too."""


def _rank(rank, world):
    lo = sum(SIZES[:rank])
    shard = slice(lo, lo + SIZES[rank])
    results = {}
    gather = dist.all_gather
    for valid, given_start in CASES:
        z, y, labels = _inputs(valid)
        options = {"vocab_size": sum(SIZES), "valid_vocab_size": valid}
        if given_start:
            options["vocab_start_index"] = lo

            def no_gather(*args, **kwargs):
                raise AssertionError("all_gather called with vocab_start_index given")

            dist.all_gather = no_gather  # this worker process only, restored below

        def kl_fn(zz, yy, options=options, **kw):
            return klest.kl_from_logits_vocab_parallel(zz, yy, **options, **kw)

        try:
            results[valid] = {
                d: _outputs(z[..., shard], y[..., shard], labels, d, kl_fn)
                for d in ("pi||ref", "ref||pi")
            }
        finally:
            dist.all_gather = gather
    return {"cases": results, "errors": _bad(rank)}


def _bad(rank):
    z = torch.zeros(2, SIZES[rank], dtype=torch.float64)
    errors = {}
    for name, options in {
        "start without size": {"vocab_start_index": 0},
        "start past the end": {"vocab_start_index": 10, "vocab_size": 12},
        "valid zero": {"valid_vocab_size": 0},
        "valid too large": {"valid_vocab_size": 13},
    }.items():
        try:
            klest.kl_from_logits_vocab_parallel(z, z, **options)
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    return errors


def test_padding_is_left_out_on_every_rank(tmp_path):
    """One spawn of three ranks runs every case and the refusals."""
    results = run_ranks(_rank, len(SIZES), tmp_path)
    for valid, _ in CASES:
        z, y, labels = _inputs(valid)
        scale = logit_scale(z[..., :valid], y[..., :valid])
        for direction in ("pi||ref", "ref||pi"):
            want, want_grads = _outputs(
                z[..., :valid], y[..., :valid], labels, direction, klest.kl_from_logits
            )
            for rank, got in enumerate(results):
                outs, grads = got["cases"][valid][direction]
                for i, (a, e) in enumerate(zip(outs, want, strict=True)):
                    what = f"V'={valid} rank {rank} {direction} output {i}"
                    assert_close_to_rounding(a, e, ulps=2 * VALUE_ULPS, scale=scale, what=what)
                lo = sum(SIZES[:rank])
                for a, e in zip(grads, want_grads, strict=True):
                    full = torch.zeros((*LEAD, sum(SIZES)), dtype=e.dtype)
                    full[..., :valid] = e  # the padding's gradient: exactly 0
                    e_shard = full[..., lo : lo + SIZES[rank]]
                    what = f"V'={valid} rank {rank} {direction} gradient"
                    tol = float(e.abs().max())
                    assert_close_to_rounding(a, e_shard, ulps=2 * GRAD_ULPS, scale=tol, what=what)
                    cut = max(valid - lo, 0)
                    assert torch.equal(a[..., cut:], e_shard[..., cut:])
    for got in results:
        errors = got["errors"]
        assert "needs vocab_size" in errors["start without size"]
        assert "exceeds vocab_size=12" in errors["start past the end"]
        assert "valid_vocab_size must be in [1, V = 12]" in errors["valid zero"]
        assert "valid_vocab_size must be in [1, V = 12]" in errors["valid too large"]
