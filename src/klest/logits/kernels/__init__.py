"""Optional Triton kernels (GPU) for the exact KL, and the generalized JSD, skew KL and total
variation, from logits (statistics, gradients, or both in one launch; and the backward's
device-side rescaling of a gradient written in the forward pass); importable without triton.

:func:`triton_available` says whether they can run here. The PyTorch entry points that use them
(and fall back to plain PyTorch) are in :mod:`klest.logits.from_logits` and
:mod:`klest.logits.divergences`.
"""

# The public surface is one import per line (an isort merge would undo that).
# ruff: noqa: I001
from klest.logits._stats import KLRowStats
from klest.logits.kernels.kl_logits import kl_logits_backward
from klest.logits.kernels.kl_logits import kl_logits_forward
from klest.logits.kernels.kl_logits import kl_logits_fused
from klest.logits.kernels.kl_logits import triton_available
from klest.logits.kernels.divergence import divergence_backward
from klest.logits.kernels.divergence import divergence_forward
from klest.logits.kernels.divergence import divergence_fused
from klest.logits.kernels.scale import scale_
from klest.logits.kernels.scale import scale_rows_

__all__ = [
    "KLRowStats",
    "divergence_backward",
    "divergence_forward",
    "divergence_fused",
    "kl_logits_backward",
    "kl_logits_forward",
    "kl_logits_fused",
    "scale_",
    "scale_rows_",
    "triton_available",
]
