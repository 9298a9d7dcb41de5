"""The kernels' ``num_warps`` keyword (for launch sweeps, ``benchmarks/gpu_tune.py``): any valid
warp count gives the default launch's answer, and an invalid one is refused by name.

Tolerance: a warp count changes only the order of float32 sums within a row (``V`` = 300 terms of
the row's logit scale, :func:`tests._tolerance.logit_scale`): each order rounds about sqrt(V) <=
16 times at that scale, so 2 x 16 roundings of it for the row statistics, and 2 x 32 of the
largest entry for the gradient, whose terms cancel at that entry's scale. Under triton's
interpreter (CPU, CI) the warp count is not simulated and the results are equal.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first imported

from klest.logits.kernels import (
    kl_logits_backward,
    kl_logits_forward,
    triton_available,
)
from tests._tolerance import assert_close_to_rounding, logit_scale

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs triton (CUDA or TRITON_INTERPRET=1)"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _logits() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    z, y = (torch.randn(2, 5, 300, generator=g) * 2).to(DEV).unbind(0)
    return z, y


@pytest.mark.parametrize("num_warps", [1, 2, 8])
def test_any_warp_count_gives_the_default_launch_answer(num_warps):
    z, y = _logits()
    ref = kl_logits_forward(z, y, block_v=64)
    got = kl_logits_forward(z, y, block_v=64, num_warps=num_warps)
    scale = logit_scale(z, y)
    for name, a, b in zip(ref._fields, got, ref, strict=True):
        assert_close_to_rounding(a, b, ulps=32, scale=scale.to(b.device), what=name)
    g = torch.ones(z.shape[0], device=DEV)
    dz_ref, _ = kl_logits_backward(z, y, ref, grad_kl_pi_ref=g, block_v=64)
    dz, _ = kl_logits_backward(z, y, ref, grad_kl_pi_ref=g, block_v=64, num_warps=num_warps)
    assert_close_to_rounding(dz, dz_ref, ulps=64, what="dz")


@pytest.mark.parametrize("bad", [0, 3, 64, 2.0, True])
def test_invalid_warp_count_is_refused(bad):
    z, y = _logits()
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        kl_logits_forward(z, y, num_warps=bad)
    stats = kl_logits_forward(z, y)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        kl_logits_backward(z, y, stats, grad_kl_pi_ref=torch.ones(5, device=DEV), num_warps=bad)
