"""Every backend on every device it runs on: the PyTorch engine on CUDA too (``make test-gpu``).

On CUDA ``backend="auto"`` picks the Triton kernels, so the PyTorch engine runs there only for
float64 logits, without triton, or when asked: these cases would otherwise never run on a GPU.
Tolerances as in test_from_logits.py: values within ``VALUE_ULPS`` roundings (float32 or
float64 arithmetic) of their row's logit scale.
"""

from __future__ import annotations

import pytest
import torch

import klest
from tests._reference import logits_reference
from tests._tolerance import assert_logits_values_close

VALUE_ULPS = 16
"""As test_from_logits.py's: a log-softmax and a sum over V, rounding at the row's logit scale."""

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("stash", [True, False])
def test_torch_backend_on_cuda_with_masks_and_labels(dtype, stash):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(3, 5, 40, generator=g) * 2).to(dtype).cuda().requires_grad_()
    y = (torch.randn(3, 5, 40, generator=g) * 2).to(dtype).cuda()
    mask = torch.rand(3, 5, generator=g).cuda() > 0.3
    labels = torch.randint(0, 40, (3, 5), generator=g).cuda()
    kl = klest.kl_from_logits(
        z, y, mask=mask, labels=labels, reduction="none", backend="torch", stash=stash
    )
    (dz,) = torch.autograd.grad(kl.sum(), [z])
    assert dz.device == z.device and dz.dtype == dtype
    ref = logits_reference(z.detach().double().cpu(), y.double().cpu())["kl_pi_ref"]
    want = torch.where(mask.cpu(), ref, 0.0)
    what = f"{dtype} stash={stash}"
    assert_logits_values_close(kl, want, z.cpu(), y.cpu(), ulps=VALUE_ULPS, what=what)


@needs_cuda
def test_penalty_and_fused_head_on_cuda():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 30, generator=g).cuda().requires_grad_()
    logits_ref = torch.randn(4, 6, 30, generator=g).cuda()
    tokens = torch.distributions.Categorical(logits=logits.detach()).sample()
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    logp_ref = torch.log_softmax(logits_ref, -1).gather(-1, tokens[..., None])[..., 0]
    mask = torch.ones(4, 6, dtype=torch.bool, device="cuda")
    mask[1, 3:] = False
    loss = klest.kl_penalty(
        logp, logp_ref, mask=mask, estimator="rb", grad="rb", logits=logits, logits_ref=logits_ref
    )
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    head = torch.nn.Linear(8, 30).cuda()
    h = torch.randn(4, 6, 8, device="cuda")
    fused = klest.kl_from_hidden(h, head.weight, logits_ref=logits_ref, bias=head.bias, mask=mask)
    plain = klest.kl_from_logits(head(h), logits_ref, mask=mask)
    # two float32 paths; a mean over rows of sums over 6 positions
    z = head(h).detach().cpu()
    assert_logits_values_close(fused, plain, z, logits_ref.cpu(), ulps=2 * VALUE_ULPS, terms=6)
