"""Vocab-parallel JSD, skew KL and TV from logit shards over gloo equal the single-process
``*_from_logits`` functions.

Rank r holds columns [o_r, o_r + V_r) of both logits (uneven shards; with [2, 5, 4], rank 0
holds only -inf in one row, and labels sit on the shard boundaries: ``test_vocab_parallel``'s
inputs). Each rank's value and details equal the single-process ones, its logits gradients the
columns of the whole ones, per position and reduced, with masks, labels, a temperature,
``valid_vocab_size`` and the ends of ``beta`` (the KL path). Tolerances: those of
``test_vocab_parallel`` (the same merge; the divergence's terms sum over V and the shards).
"""

from __future__ import annotations

import pytest
import torch

import klest
from tests._spawn import run_ranks
from tests._tolerance import assert_close_to_rounding, logit_scale
from tests.logits.test_vocab_parallel import (
    GRAD_ULPS,
    N_LEAD,
    VALUE_ULPS,
    _case_inputs,
    needs_triton,
)

CASES = {
    "jsd 0.3": ("jsd", {"beta": 0.3}),
    "jsd 0 (the KL)": ("jsd", {"beta": 0.0}),
    "skew pi||ref": ("skew_kl", {"alpha": 0.2, "direction": "pi||ref"}),
    "skew ref||pi": ("skew_kl", {"alpha": 0.4, "direction": "ref||pi"}),
    "tv": ("tv", {}),
}
"""Each case: the function's stem (``klest.<stem>_from_logits[_vocab_parallel]``) and options."""
VALID = 9
"""``valid_vocab_size`` of the truncated runs (columns 9.. are padding)."""


def _run(call, z, y, labels, mask, valid=None):
    """Outputs and gradients of every case, for a shard (or the whole vocabulary)."""
    out = {}
    w = torch.arange(1.0, 7.0, dtype=torch.float64).reshape(N_LEAD)
    lab = labels if valid is None else torch.where(labels >= 0, labels.clamp(max=valid - 1), labels)
    for case, (stem, options) in CASES.items():
        zz, yy = z.clone().requires_grad_(), y.clone().requires_grad_()
        value, d = call(
            stem, zz, yy, labels=lab, mask=mask, reduction="none", return_details=True, **options
        )
        loss = (value * w.to(value.dtype)).sum()
        outs = [value.detach(), d.logp, d.entropy]
        out[case, "none"] = (outs, list(torch.autograd.grad(loss, [zz, yy])))
        zz = z.clone().requires_grad_()
        value = call(stem, zz, y, mask=mask, temperature=0.7, **options)  # gradient in forward
        out[case, "mean"] = ([value.detach()], list(torch.autograd.grad(value, [zz])))
    return out


def _rank(rank, world, sizes, dtype, backend):
    z, y, labels, mask = _case_inputs(sizes, dtype)
    lo = sum(sizes[:rank])
    cols = slice(lo, lo + sizes[rank])

    def shard_call(**extra):
        def call(stem, zz, yy, **kw):
            fn = getattr(klest, f"{stem}_from_logits_vocab_parallel")
            return fn(zz, yy, chunk_size=2, backend=backend, **extra, **kw)

        return call

    valid = shard_call(valid_vocab_size=VALID, vocab_start_index=lo, vocab_size=sum(sizes))
    return {
        "plain": _run(shard_call(), z[..., cols], y[..., cols], labels, mask),
        "valid": _run(valid, z[..., cols], y[..., cols], labels, mask, valid=VALID),
    }


def _single(stem, zz, yy, **kw):
    return getattr(klest, f"{stem}_from_logits")(zz, yy, **kw)


@pytest.mark.parametrize(
    ("sizes", "dtype", "backend"),
    [
        ([7, 6], torch.float64, "torch"),
        ([2, 5, 4], torch.float64, "torch"),
        # The Triton kernels (CPU, through the interpreter) on float32 against the PyTorch
        # engine on the whole logits, in float32's roundings.
        pytest.param([7, 6], torch.float32, "triton", marks=needs_triton),
    ],
)
def test_vocab_parallel_divergences_equal_single_process(tmp_path, sizes, dtype, backend):
    results = run_ranks(_rank, len(sizes), tmp_path, sizes, dtype, backend)
    z, y, labels, mask = _case_inputs(sizes, dtype)
    for variant, cut in (("plain", None), ("valid", VALID)):
        v = z.shape[-1] if cut is None else cut
        want = _run(_single, z[..., :v], y[..., :v], labels, mask, valid=cut)
        rows = logit_scale(z[..., :v], y[..., :v], temperature=0.7)
        for key, (outs, grads) in want.items():
            for rank, got in enumerate(results):
                g_outs, g_grads = got[variant][key]
                what = f"{variant} {key} rank {rank}"
                for i, (a, e) in enumerate(zip(g_outs, outs, strict=True)):
                    finite = torch.isfinite(e)
                    assert torch.equal(finite, torch.isfinite(a)), what
                    scale = rows[finite] if e.dim() else N_LEAD[-1] * float(rows.max())
                    assert_close_to_rounding(
                        a[finite], e[finite], ulps=2 * VALUE_ULPS, scale=scale, what=f"{what} {i}"
                    )
                lo = sum(sizes[:rank])
                for j, (a, e) in enumerate(zip(g_grads, grads, strict=True)):
                    full = torch.zeros(*e.shape[:-1], z.shape[-1], dtype=e.dtype)
                    full[..., :v] = e  # padding columns: gradient 0
                    e_shard = full[..., lo : lo + sizes[rank]]
                    tol = float(e.abs().max())
                    assert_close_to_rounding(
                        a, e_shard, ulps=2 * GRAD_ULPS, scale=tol, what=f"{what} grad {j}"
                    )


def test_needs_initialized_process_group():
    with pytest.raises(RuntimeError, match=r"jsd_from_logits_vocab_parallel needs"):
        klest.jsd_from_logits_vocab_parallel(torch.zeros(2, 3), torch.zeros(2, 3), beta=0.5)
