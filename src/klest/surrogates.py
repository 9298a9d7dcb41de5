r"""Joining a value and a gradient: the one primitive every KL term in klest goes through.

The forward pass returns ``value`` and the backward pass the gradient of ``surrogate``,

.. math:: \mathrm{decouple}(v, s) = \mathrm{sg}(v) + s - \mathrm{sg}(s),

so a value estimator (k3, say) and a gradient estimator (k1's pathwise gradient, say: the
Chimera estimator) are chosen independently, as TFP and Pyro build a reported value and a
gradient surrogate apart. See "The Chimera Estimator" by Kirato Yoshihara (2026,
https://kiratoyoshihara.github.io/essays/chimera-kl.html).
"""

from __future__ import annotations

import torch
from torch import Tensor

from klest._checks import ValueChecks, check_tensor, resolve_validate

__all__ = ["decouple", "join"]


def decouple(value: Tensor, surrogate: Tensor, *, validate: bool | None = None) -> Tensor:
    r"""``value`` in the forward pass, the gradient of ``surrogate`` in the backward pass.

    .. math:: \mathrm{sg}(value) + surrogate - \mathrm{sg}(surrogate)

    The forward result equals ``value`` exactly (``s - sg(s)`` is exactly 0 for finite ``s``);
    the gradient equals the gradient of ``surrogate`` exactly; ``value`` passes no gradient.

    Args:
      value: the reported value (any shape).
      surrogate: a tensor of the same shape whose gradient is the desired gradient; it must be
        finite (``inf - inf`` would put NaN in the value).
      validate: check that ``surrogate`` is finite (None: the global default).

    Returns:
      A tensor equal to ``value`` whose gradient is ``surrogate``'s.

    Example:
      >>> x = torch.tensor(2.0, requires_grad=True)
      >>> y = decouple(x**3, 5 * x)  # value 8, gradient 5
      >>> y.backward()
      >>> y.item(), x.grad.item()
      (8.0, 5.0)
    """
    check_tensor("value", value)
    check_tensor("surrogate", surrogate)
    if value.shape != surrogate.shape:
        raise ValueError(
            f"value has shape {tuple(value.shape)} but surrogate has shape "
            f"{tuple(surrogate.shape)}; they must match"
        )
    checks = ValueChecks(resolve_validate(validate))
    checks.add(
        ~torch.isfinite(surrogate),
        lambda _: (
            "surrogate is not finite (overflowing importance weights or log-ratios?); "
            "its gradient would be NaN"
        ),
    )
    checks.run()
    return join(value, surrogate)


def join(value: Tensor, surrogate: Tensor) -> Tensor:
    """:func:`decouple` without checks (for callers that validated already)."""
    return value.detach() + (surrogate - surrogate.detach())
