"""What the Triton launches of :mod:`klest.logits.kernels` share: whether triton can run, the
checks of their inputs, and the choice of vocabulary block and warps.

Imports without triton (:func:`triton_importable` tries it, once).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from klest._checks import check_logits_pair

__all__ = [
    "MAX_GRID_Y",
    "ONE_BLOCK_MAX",
    "cdiv",
    "check_device",
    "check_grad_buffer",
    "check_keep",
    "check_logits",
    "check_programs",
    "interpreting",
    "resolve_block_v",
    "resolve_fused_launch",
    "resolve_num_warps",
    "triton_importable",
]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_WHAT = (
    "the kernels compute in float32; for float64 use kl_from_logits(..., backend='torch')"
)
_MIN_BLOCK_V = 16
_MAX_BLOCK_V = 65536
# Default vocabulary block, with resolve_num_warps(None, 1024) = 4 warps: 8 elements per thread
# per tensor.
# Measured on an H200 (benchmarks/gpu_tune.py, N=16384, V=128256 bf16): the backward runs at 94-95%
# of its 3-pass roofline for blocks 1024-4096 with 2-8 warps; the forward is fastest at 1024 with
# 4 warps (benchmarks/README.md has the numbers).
_DEFAULT_MAX_BLOCK_V = 1024
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (the backward's vocabulary blocks)
ONE_BLOCK_MAX = 16384
"""The largest row the fused kernels hold in one block by default (read once: 16 float32 values
per thread and tensor at 32 warps); longer rows are read in blocks of 1024, twice."""


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` is set: triton's CPU interpreter runs the kernels."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def triton_importable() -> bool:
    """Whether triton imports here (checked once)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_device(z: Tensor) -> None:
    """Raise unless ``z`` is on CUDA, or triton's CPU interpreter is on."""
    if z.device.type == "cuda":
        return
    if not interpreting():
        raise RuntimeError(
            f"the Triton KL kernels run on CUDA tensors, got a tensor on {z.device} "
            "(set TRITON_INTERPRET=1 before triton is imported to run them on CPU, slowly)"
        )


def check_logits(z: object, y: object) -> tuple[Tensor, Tensor]:
    """``z`` and ``y`` checked as a pair of ``[N, V]`` logits in a kernel dtype, each with
    contiguous rows."""
    z, y = check_logits_pair(
        z, y, names=("z", "y"), dtypes=_KERNEL_DTYPES, matrix=True, what=_KERNEL_WHAT
    )
    # The kernels index rows by a stride and columns contiguously.
    return (z if z.stride(1) == 1 else z.contiguous()), (y if y.stride(1) == 1 else y.contiguous())


def check_keep(keep: object, n: int, device: torch.device) -> Tensor | None:
    """``keep`` as contiguous bytes (a bool is the byte 0 or 1), or None."""
    if keep is None:
        return None
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        raise TypeError(f"keep must be a bool tensor, got {getattr(keep, 'dtype', type(keep))}")
    if keep.shape != (n,) or keep.device != device:
        raise ValueError(
            f"keep must have shape ({n},) on {device} (one flag per row of z), got "
            f"{tuple(keep.shape)} on {keep.device}"
        )
    return keep.contiguous().view(torch.uint8)


def resolve_block_v(block_v: object, v: int) -> int:
    """The vocabulary block: the given power of two, else ``min(1024, next_pow2(V))``."""
    if block_v is None:
        return max(_MIN_BLOCK_V, min(_DEFAULT_MAX_BLOCK_V, 1 << (v - 1).bit_length()))
    if (
        isinstance(block_v, bool)
        or not isinstance(block_v, int)
        or block_v < _MIN_BLOCK_V
        or block_v > _MAX_BLOCK_V
        or block_v & (block_v - 1)
    ):
        raise ValueError(
            f"block_v must be a power of two in [{_MIN_BLOCK_V}, {_MAX_BLOCK_V}], got {block_v!r}"
        )
    return block_v


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)


def resolve_num_warps(num_warps: object, block_v: int) -> int:
    """The given power of two in [1, 32], else about 8 elements per thread per tensor (one
    16-byte load of bf16): ``block_v / 256`` warps, 1 to 16."""
    if num_warps is None:
        return max(1, min(16, block_v // 256))
    if (
        isinstance(num_warps, bool)
        or not isinstance(num_warps, int)
        or not 1 <= num_warps <= 32
        or num_warps & (num_warps - 1)
    ):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {num_warps!r}")
    return num_warps


def resolve_fused_launch(block_v: object, num_warps: object, v: int) -> tuple[int, int, bool]:
    """``(block, warps, one_block)`` of a fused kernel (statistics and gradient in one launch):
    the whole row in one block when ``next_pow2(V) <= ONE_BLOCK_MAX`` (or ``block_v >= V``),
    with ``block / 512`` warps (1 to 32); else blocks of 1024 with 4 warps, as the forward."""
    whole = max(_MIN_BLOCK_V, 1 << (v - 1).bit_length())
    if block_v is None:
        block = whole if whole <= ONE_BLOCK_MAX else _DEFAULT_MAX_BLOCK_V
    else:
        block = resolve_block_v(block_v, v)
    one_block = block >= v
    if num_warps is None and one_block:
        return block, max(1, min(32, block // 512)), True
    return block, resolve_num_warps(num_warps, block), one_block


def check_programs(programs: object, n: int) -> int:
    """The fused kernels' number of programs: given (an int >= 1, at most ``n``), else ``n``
    (one row each)."""
    if programs is None:
        return max(n, 1)
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be an int >= 1, got {programs!r}")
    return min(programs, max(n, 1))


def check_grad_buffer(name: str, buf: object, like: Tensor, others: tuple[Tensor, ...]) -> Tensor:
    """An output buffer for the gradient of ``like``: its shape and device, a kernel dtype,
    contiguous rows, and no memory shared with the tensors the kernel reads (``others``) but
    ``like`` itself (whose rows it reads before writing them)."""
    if not isinstance(buf, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(buf).__name__}")
    if buf.shape != like.shape or buf.device != like.device or buf.dtype not in _KERNEL_DTYPES:
        raise ValueError(
            f"{name} must have shape {tuple(like.shape)} on {like.device} in float32 / bfloat16 /"
            f" float16, got {tuple(buf.shape)} {buf.dtype} on {buf.device}"
        )
    if buf.ndim == 2 and buf.shape[1] > 1 and buf.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride 1 along V)")
    if buf.numel():
        ptr = buf.untyped_storage().data_ptr()
        sharing = [o for o in others if o.numel() and o.untyped_storage().data_ptr() == ptr]
        is_like = buf.data_ptr() == like.data_ptr() and buf.stride() == like.stride()
        if any(o is not like for o in sharing) or (sharing and not is_like):
            raise ValueError(
                f"{name} shares memory with an input of the kernel other than the one whose "
                "gradient it receives (written over its own logits, it must be exactly them)"
            )
    return buf
