"""Tolerances derived from rounding, for two computations of the same quantity.

Two computations that agree in exact arithmetic (klest and a reference, a trainer and an
independent forward pass, a fast and a slow path, compiled and eager code, one CPU's vectorized
reduction order and another's) differ by their rounding errors. Each rounding moves a value by
at most ``eps / 2`` of its size, and the sizes that matter are those of the terms combined, not
that of the result: an entry near zero reached by cancellation carries the rounding of its
larger terms. A bare absolute tolerance (``atol=1e-6``) or a relative one on each entry ignores
this and fails on whichever entry happens to cancel on some machine. Hence the bound here::

    |actual - expected| <= ulps * eps(dtype) * scale        (elementwise)

``scale``: by default ``max |expected|`` over the tensor compared, a normwise bound (the largest
error against the largest entry) that does not depend on which entries cancel; where the result
is a sum or difference of larger terms, the size of those terms instead (a number, or a tensor
that broadcasts against the entries). ``ulps``: a count stated and justified at each call (a
sum of n terms rounds up to n times; two orders of the same sum: twice that).
"""

from __future__ import annotations

import math

import torch

from tests._reference import assert_verbose_close


def eps(*dtypes: torch.dtype) -> float:
    """The machine epsilon of the least precise floating dtype given (``2^-23`` for float32)."""
    floats = [d for d in dtypes if d.is_floating_point]
    return max(torch.finfo(d).eps for d in floats)


def max_abs(x: torch.Tensor) -> float:
    """The largest finite ``|x|`` (0 for an empty or all-infinite tensor)."""
    x = torch.as_tensor(x).detach().double()
    x = x[torch.isfinite(x)]
    return float(x.abs().max()) if x.numel() else 0.0


def rounding_tolerance(
    expected: torch.Tensor,
    *,
    ulps: float,
    dtype: torch.dtype | None = None,
    scale: float | torch.Tensor | None = None,
) -> float | torch.Tensor:
    """``ulps * eps(dtype) * scale``; ``scale`` defaults to ``max |expected|``, ``dtype`` to
    ``expected``'s."""
    expected = torch.as_tensor(expected)
    dtype = expected.dtype if dtype is None else dtype
    scale = max_abs(expected) if scale is None else scale
    if isinstance(scale, torch.Tensor):
        scale = scale.detach().double().cpu()
    return ulps * eps(dtype) * scale


def assert_close_to_rounding(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    ulps: float,
    dtype: torch.dtype | None = None,
    scale: float | torch.Tensor | None = None,
    what: str = "",
) -> None:
    """``|actual - expected| <= ulps * eps(dtype) * scale`` elementwise (module docstring), with
    equal infinities and no NaN. ``dtype``: the precision the computations ran in, by default
    the less precise of ``actual``'s and ``expected``'s; ``scale``: ``max |expected|`` unless
    given."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    dtype = dtype or max((actual.dtype, expected.dtype), key=lambda d: eps(d))
    atol = rounding_tolerance(expected, ulps=ulps, dtype=dtype, scale=scale)
    assert_verbose_close(actual, expected, atol=atol, what=what)


def logit_scale(*logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per row of ``[..., V]`` logits (a ``[...]`` tensor): ``1 + log V + sum max_v |x_v| / T``
    over the tensors given, float64: the size of what a row's float log-softmax arithmetic
    combines (each logit over T, and the row's log-sum-exp, within the largest of them plus
    ``log V``), at which its roundings, and those of a sum over the row, fall. Entries at -inf
    (outside the support) are left out."""
    v = logits[0].shape[-1]
    scale = torch.full(logits[0].shape[:-1], 1 + math.log(max(v, 1)), dtype=torch.float64)
    for x in logits:
        x = x.detach().double().cpu()
        scale = scale + torch.where(torch.isfinite(x), x.abs(), 0.0).amax(-1) / temperature
    return scale


def assert_logits_values_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *logits: torch.Tensor,
    ulps: float,
    temperature: float = 1.0,
    terms: int = 1,
    what: str = "",
) -> None:
    """Values computed from rows of ``[..., V]`` ``logits`` (a divergence, an entropy, a label's
    log-prob) within ``ulps`` roundings of each row's :func:`logit_scale`, in the arithmetic's
    precision: float64 for float64 logits, float32 for any other (klest upcasts bf16 / fp16).
    A reduction of the rows (``expected`` not of the rows' shape): the largest row's scale,
    times ``terms`` for a sum of that many rows' values (a mean: 1)."""
    dtype = torch.float64 if logits[0].dtype == torch.float64 else torch.float32
    scale = logit_scale(*logits, temperature=temperature)
    if expected.shape != scale.shape:
        scale = terms * scale.max()
    scale = scale.to(torch.as_tensor(expected).device)
    assert_close_to_rounding(actual, expected, ulps=ulps, dtype=dtype, scale=scale, what=what)
