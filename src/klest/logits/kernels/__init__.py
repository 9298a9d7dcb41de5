"""Optional Triton kernels (GPU) for the exact KL from logits; importable without triton.

:func:`triton_available` says whether they can run here. The PyTorch entry points that use them
(and fall back to plain PyTorch) are in :mod:`klest.logits.from_logits`.
"""

# The public surface is one import per line (an isort merge would undo that).
# ruff: noqa: I001
from klest.logits._stats import KLRowStats
from klest.logits.kernels.kl_logits import kl_logits_backward
from klest.logits.kernels.kl_logits import kl_logits_forward
from klest.logits.kernels.kl_logits import triton_available

__all__ = [
    "KLRowStats",
    "kl_logits_backward",
    "kl_logits_forward",
    "triton_available",
]
