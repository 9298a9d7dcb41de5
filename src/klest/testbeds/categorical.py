r"""A single categorical distribution over K outcomes: exact KL and gradients by summation.

pi = softmax(logits) (trainable), ref = softmax(logits_ref) (fixed). With q = pi, p = ref:

.. math::
    \frac{\partial KL(\pi\|ref)}{\partial z} = q \odot (\log q - \log p - KL(\pi\|ref)), \qquad
    \frac{\partial KL(ref\|\pi)}{\partial z} = q - p.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from klest._checks import check_direction
from klest.logits.reference import categorical_kl
from klest.testbeds.base import Sample, SampledTestbed

__all__ = ["CategoricalTestbed"]


class CategoricalTestbed(SampledTestbed):
    """pi = softmax(logits) against ref = softmax(logits_ref), both ``[K]``.

    Samples are outcome indices; ``Sample.logits`` holds pi's full log-probs ``[n, K]`` (one
    position per sample), so Rao-Blackwellized estimators apply.

    Example:
      >>> tb = CategoricalTestbed.random(6, seed=1)
      >>> s = tb.sample(10_000, generator=klest.testbeds.make_generator(0))
      >>> mc = klest.k3(s.logp.detach(), s.logp_ref)
      >>> abs(float(mc) - float(tb.exact_kl())) < 0.05  # Monte Carlo against the exact sum
      True
    """

    name = "categorical"

    def __init__(self, logits: Tensor, logits_ref: Tensor) -> None:
        if logits.ndim != 1 or logits.shape != logits_ref.shape:
            raise ValueError(
                f"logits and logits_ref must both be [K]; got {tuple(logits.shape)} and "
                f"{tuple(logits_ref.shape)}"
            )
        self.logits = logits.detach().clone().requires_grad_(True)
        self.logits_ref = logits_ref.detach().clone()

    @classmethod
    def random(
        cls, k: int, *, scale: float = 1.0, seed: int = 0, dtype: torch.dtype = torch.float64
    ) -> CategoricalTestbed:
        """Logits of pi and ref drawn i.i.d. N(0, scale^2) from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(2, k, generator=g, dtype=dtype) * scale
        return cls(z[0], z[1])

    def parameters(self) -> list[Tensor]:
        return [self.logits]

    def exact_kl(self, direction: str = "pi||ref") -> Tensor:
        return categorical_kl(self.logits, self.logits_ref, direction=direction)

    def exact_kl_grad(self, direction: str = "pi||ref") -> list[Tensor]:
        """Closed-form gradient w.r.t. the logits (no autodiff)."""
        check_direction(direction)
        with torch.no_grad():
            log_q = torch.log_softmax(self.logits, -1)
            log_p = torch.log_softmax(self.logits_ref, -1)
            q, p = log_q.exp(), log_p.exp()
            if direction == "pi||ref":
                kl = (q * (log_q - log_p)).sum()
                return [q * (log_q - log_p - kl)]
            return [q - p]

    def draw(self, n: int, *, generator: torch.Generator) -> Tensor:
        """Outcome indices ``[n]`` from pi."""
        probs = torch.softmax(self.logits.detach(), -1)
        return torch.multinomial(probs, n, replacement=True, generator=generator)

    def evaluate(self, idx: Tensor) -> Sample:
        """Log-probs of pi and ref at the outcomes ``idx`` and their full distributions."""
        log_q = torch.log_softmax(self.logits, -1)
        log_p = torch.log_softmax(self.logits_ref, -1)
        n = idx.shape[0]
        return Sample(
            logp=log_q[idx],
            logp_ref=log_p[idx],
            x=idx,
            logits=log_q.expand(n, -1),
            logits_ref=log_p.expand(n, -1),
        )

    def expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        with torch.no_grad():
            log_q = torch.log_softmax(self.logits, -1)
            log_p = torch.log_softmax(self.logits_ref, -1)
            return (log_q.exp() * fn(log_q - log_p)).sum()

    def sequence_expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """:meth:`expectation`: a sample is one outcome, a sequence of one token."""
        return self.expectation(fn)
