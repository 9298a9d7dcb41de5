"""The per-row quantities that flow between the logits engine, its kernels and its front ends.

A leaf module: the chunked PyTorch engines (:mod:`klest.logits._rows`,
:mod:`klest.logits._divergence_rows`), the Triton kernels (:mod:`klest.logits.kernels`) and the
autograd Functions all speak in these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor


class KLRowStats(NamedTuple):
    """Per-row statistics of two logit tensors; every field is ``[N]``, float32 (float64 for
    float64 logits on the PyTorch path)."""

    lse_z: Tensor
    """``logsumexp(z / tau)``."""
    lse_y: Tensor
    """``logsumexp(y / tau)``."""
    kl_pi_ref: Tensor
    """``KL(softmax(z / tau) || softmax(y / tau))``."""
    kl_ref_pi: Tensor
    """``KL(softmax(y / tau) || softmax(z / tau))``."""
    entropy: Tensor
    """``H(softmax(z / tau))``."""
    logp_label: Tensor
    """``z[label] / tau - lse_z``; 0 where the label is outside ``[0, V)`` or ``labels`` is None."""
    logp_ref_label: Tensor
    """``y[label] / tau - lse_y``; 0 where the label is outside ``[0, V)`` or ``labels`` is None."""


class Grads(NamedTuple):
    """Upstream gradients ``g1..g5`` of the five per-row outputs (``None``: no term)."""

    kl_pi_ref: Tensor | None = None
    kl_ref_pi: Tensor | None = None
    entropy: Tensor | None = None
    logp_label: Tensor | None = None
    logp_ref_label: Tensor | None = None

    def any_z(self) -> bool:
        return any(
            g is not None for g in (self.kl_pi_ref, self.kl_ref_pi, self.entropy, self.logp_label)
        )

    def any_y(self) -> bool:
        return any(g is not None for g in (self.kl_pi_ref, self.kl_ref_pi, self.logp_ref_label))


@dataclass(frozen=True)
class Divergence:
    """Which per-row divergence beyond the KL (:mod:`klest.logits._divergence_rows`).

    ``kind="mixture"``: ``c_q KL(q||m) + c_p KL(p||m)`` with ``m = w p + (1 - w) q``,
    ``0 < w < 1`` (``q`` pi's distribution, ``p`` ref's); ``kind="tv"``: the total variation
    (``w``, ``c_q``, ``c_p`` unused).
    """

    kind: str
    w: float = 0.5
    c_q: float = 0.0
    c_p: float = 0.0
