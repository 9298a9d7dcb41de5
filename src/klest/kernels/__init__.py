"""Optional Triton kernels (GPU) for the exact KL from logits; importable without triton.

:func:`triton_available` says whether they can run here. The PyTorch entry points that use them
(and fall back to plain PyTorch) are in :mod:`klest.vocab`.
"""

# The public surface is one import per line (an isort merge would undo that).
# ruff: noqa: I001
from klest.kernels.kl_logits import KLRowStats
from klest.kernels.kl_logits import kl_logits_backward
from klest.kernels.kl_logits import kl_logits_forward
from klest.kernels.kl_logits import triton_available

__all__ = [
    "KLRowStats",
    "kl_logits_backward",
    "kl_logits_forward",
    "triton_available",
]
