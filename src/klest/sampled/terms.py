r"""Stage 2 of the sampled-token path: the elementwise estimator terms of one direction.

At log-ratios :math:`\delta = \log\pi(x) - \log ref(x)` of samples :math:`x \sim \pi`,
with :math:`r = e^{-\delta} = ref(x)/\pi(x)`:

=========  ==========================================  ==========================================
estimator  ``direction="pi||ref"``: KL(pi||ref)         ``direction="ref||pi"``: KL(ref||pi)
=========  ==========================================  ==========================================
``k1``     :math:`\delta = -\log r` (unbiased)          :math:`r \log r` (unbiased)
``k2``     :math:`\delta^2 / 2` (biased; 2nd order)     :math:`\delta^2 / 2` (biased; 2nd order)
``k3``     :math:`(r - 1) - \log r` (unbiased, >= 0)    :math:`r \log r - (r - 1)` (unbiased, >= 0)
``abs``    :math:`|\delta|` (biased)                    :math:`|r \log r|` (biased)
``cv``     ``k1 + alpha (r - 1)``                       ``k1 - alpha (r - 1)``
=========  ==========================================  ==========================================

Each is computed without cancellation near r = 1 and without ``inf - inf`` where r overflows
(:mod:`klest._numerics`). No validation or masking here: the callers' stages do that.

See "Approximating KL Divergence" by John Schulman (2020, http://joschu.net/blog/kl-approx.html).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klest._numerics import exp_neg_tail, times_exp, x_exp, xexp_tail

__all__ = [
    "RatioTerms",
    "control_term",
    "control_variate",
    "k3_term",
    "naive_term",
    "per_token_values",
    "ratio_terms",
    "weighted",
]


@dataclass(frozen=True)
class RatioTerms:
    """Per-element pieces of one direction: ``naive`` (k1), ``k3`` and the zero-mean ``u``.

    ``cv(alpha) = naive + alpha * u = k3 + (alpha - 1) * u``; ``E_pi[u] = 0``.
    """

    naive: Tensor
    k3: Tensor
    u: Tensor


def naive_term(delta: Tensor, direction: str) -> Tensor:
    """k1 of ``direction``: ``delta`` (KL(pi||ref)) or ``r log r`` (KL(ref||pi))."""
    return delta if direction == "pi||ref" else x_exp(-delta)


def k3_term(delta: Tensor, direction: str) -> Tensor:
    """k3 of ``direction``, without cancellation near r = 1."""
    return exp_neg_tail(delta) if direction == "pi||ref" else xexp_tail(-delta)


def control_term(delta: Tensor, direction: str) -> Tensor:
    """The zero-mean control variate of ``direction``: ``r - 1`` or ``-(r - 1)``."""
    u = torch.expm1(-delta)
    return u if direction == "pi||ref" else -u


def ratio_terms(delta: Tensor, direction: str) -> RatioTerms:
    """The k1 / k3 / control-variate terms of ``direction`` at log-ratios ``delta``."""
    return RatioTerms(
        naive_term(delta, direction), k3_term(delta, direction), control_term(delta, direction)
    )


def control_variate(delta: Tensor, direction: str, coef: Tensor) -> Tensor:
    r"""``naive + coef * u``, to a few ulps of its terms, and never ``inf - inf``.

    Two exact forms: ``k3 + (coef - 1) u`` (k3 is computed without cancellation, so this is
    exact near r = 1 for coef near 1) and ``naive + coef * u``. Each element uses the one whose
    terms are smaller in magnitude (its rounding error is a few ulps of them); e.g. coef = 0 at
    small r takes the second, which is k1 itself rather than ``k3 - u``.

    Where neither is finite, r = e^{-delta} (or a product with it) has overflowed; the first
    form is then ``inf - inf`` for coef < 1. There the value is written with one exponential,
    with :math:`x = \log r = -\delta`:

    - KL(pi||ref): :math:`\alpha e^x - x - \alpha`,
    - KL(ref||pi): :math:`(x - \alpha) e^x + \alpha`,

    whose ``c e^x`` term (:func:`~klest._numerics.times_exp`) is finite when the product is and
    the correctly signed infinity otherwise: so the result is the true value, or the true
    value's infinite limit once it is past the dtype's range; never NaN.
    """

    def near_forms(t: RatioTerms) -> Tensor:
        bregman = t.k3 + (coef - 1.0) * t.u
        plain = t.naive + coef * t.u
        with torch.no_grad():
            use_plain = t.naive.abs() + coef.abs() * t.u.abs() < (
                t.k3.abs() + (coef - 1.0).abs() * t.u.abs()
            )
        return torch.where(use_plain, plain, bregman)

    near = near_forms(ratio_terms(delta, direction))
    with torch.no_grad():
        far = ~torch.isfinite(near)
    zero = torch.zeros_like(delta)
    if torch.is_grad_enabled() and (delta.requires_grad or coef.requires_grad):
        # Recompute each form with inputs valid for it, so neither backward sees inf * 0.
        near = near_forms(ratio_terms(torch.where(far, zero, delta), direction))
    # Both forms for every element (no host synchronisation to ask whether any is far).
    x = -torch.where(far, delta, zero)
    if direction == "pi||ref":
        far_value = times_exp(coef, x) - x - coef
    else:
        far_value = times_exp(x - coef, x) + coef
    return torch.where(far, far_value, near)


def per_token_values(
    delta: Tensor, estimator: str, direction: str, *, alpha: float | Tensor | None = None
) -> Tensor:
    """Elementwise on-policy estimator values at log-ratios ``delta`` (fixed alpha for ``cv``).

    No validation or masking: the building block that :func:`klest.kl_estimate` and exact
    expectations (``Testbed.expectation``) share. Each estimator evaluates only its own terms
    (k1 and k2 no exponential).
    """
    if estimator == "k2":
        return 0.5 * delta * delta
    if estimator in ("k1", "abs"):
        naive = naive_term(delta, direction)
        return naive.abs() if estimator == "abs" else naive
    if estimator == "k3":
        return k3_term(delta, direction)
    if estimator != "cv":
        raise ValueError(f"per_token_values computes k1, k2, k3, abs and cv, not {estimator!r}")
    if not isinstance(alpha, int | float | Tensor):
        raise ValueError(f"per_token_values needs a fixed alpha for 'cv', got {alpha!r}")
    if isinstance(alpha, Tensor):
        coef = alpha.to(dtype=delta.dtype, device=delta.device)
    else:  # a fill, not a copy from the host (which waits for the GPU)
        coef = torch.full((), float(alpha), dtype=delta.dtype, device=delta.device)
    return control_variate(delta, direction, coef)


def weighted(x: Tensor, log_w: Tensor | None) -> Tensor:
    """``w x`` with ``w = e^{log_w}``; a zero value stays 0 when ``w`` overflows (no inf * 0)."""
    return x if log_w is None else times_exp(x, log_w)
