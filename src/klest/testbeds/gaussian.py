r"""Diagonal Gaussians: analytic KL in both directions and its analytic gradient.

pi = N(mean, diag(std^2)) is trainable (``mean`` and ``log_std``), ref = N(mean_ref,
diag(std_ref^2)) is fixed. Per dimension,

.. math::
    KL(\pi\|ref) = \log\frac{s_r}{s} + \frac{s^2 + (m - m_r)^2}{2 s_r^2} - \frac12, \qquad
    KL(ref\|\pi) = \log\frac{s}{s_r} + \frac{s_r^2 + (m - m_r)^2}{2 s^2} - \frac12,

summed over dimensions. Samples are reparameterized, ``x = mean + std * eps``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from klest._checks import check_direction
from klest.testbeds.base import Sample, Testbed

__all__ = ["GaussianTestbed", "gaussian_log_density"]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _as_vector(name: str, x: Tensor | float | list[float], dtype: torch.dtype) -> Tensor:
    t = torch.as_tensor(x, dtype=dtype).reshape(-1).clone()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite")
    return t


def gaussian_log_density(x: Tensor, mean: Tensor, log_std: Tensor) -> Tensor:
    """``log N(x; mean, diag(exp(log_std)^2))`` summed over the last dim."""
    z = (x - mean) * torch.exp(-log_std)
    return (-0.5 * z * z - log_std - _LOG_SQRT_2PI).sum(-1)


class GaussianTestbed(Testbed):
    """pi = N(mean, diag(exp(log_std)^2)) (trainable) against a fixed diagonal Gaussian ref.

    Args:
      mean: pi's initial mean, ``[D]`` (a scalar broadcasts to ``dim``).
      log_std: pi's initial log standard deviation, ``[D]``.
      mean_ref: ref's mean, ``[D]``.
      log_std_ref: ref's log standard deviation, ``[D]``.
      dim: D, when every argument is a scalar.
      dtype: float dtype of parameters and samples (float64 by default: exact tests).

    Example:
      >>> tb = GaussianTestbed(mean=[0.3, -0.2], log_std=0.1, mean_ref=0.0, log_std_ref=0.0)
      >>> s = tb.sample(4, generator=klest.testbeds.make_generator(0))  # x = mean + std * eps
      >>> s.reparameterized, s.density
      (True, True)
      >>> [g.shape for g in tb.exact_kl_grad("pi||ref")]  # analytic gradient w.r.t. mean, log_std
      [torch.Size([2]), torch.Size([2])]
    """

    name = "gaussian"

    def __init__(
        self,
        *,
        mean: Tensor | float = 0.0,
        log_std: Tensor | float = 0.0,
        mean_ref: Tensor | float = 0.0,
        log_std_ref: Tensor | float = 0.0,
        dim: int | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        vectors = [
            _as_vector(n, v, dtype)
            for n, v in (
                ("mean", mean),
                ("log_std", log_std),
                ("mean_ref", mean_ref),
                ("log_std_ref", log_std_ref),
            )
        ]
        d = dim if dim is not None else max(v.numel() for v in vectors)
        for name, v in zip(("mean", "log_std", "mean_ref", "log_std_ref"), vectors, strict=True):
            if v.numel() not in (1, d):
                raise ValueError(f"{name} has {v.numel()} entries; expected 1 or dim={d}")
        m, ls, mr, lsr = (v.expand(d).clone() for v in vectors)
        self.mean = m.requires_grad_(True)
        self.log_std = ls.requires_grad_(True)
        self.mean_ref = mr
        self.log_std_ref = lsr
        self.dim = d

    @classmethod
    def schulman(cls, mu: float, *, dtype: torch.dtype = torch.float64) -> GaussianTestbed:
        """Schulman's setting: samples from pi = N(0, 1), ref = N(mu, 1); KL(pi||ref) = mu^2/2."""
        return cls(mean=0.0, mean_ref=mu, dim=1, dtype=dtype)

    @classmethod
    def chimera(
        cls, dim: int, mu: float = 0.05, *, dtype: torch.dtype = torch.float64
    ) -> GaussianTestbed:
        """The Chimera essay's setting: pi = N(mu 1, I) in D dims, ref = N(0, I)."""
        return cls(mean=mu, mean_ref=0.0, dim=dim, dtype=dtype)

    def parameters(self) -> list[Tensor]:
        return [self.mean, self.log_std]

    def exact_kl(self, direction: str = "pi||ref") -> Tensor:
        check_direction(direction)
        var, var_ref = torch.exp(2 * self.log_std), torch.exp(2 * self.log_std_ref)
        sq = (self.mean - self.mean_ref) ** 2
        if direction == "pi||ref":
            per_dim = self.log_std_ref - self.log_std + (var + sq) / (2 * var_ref) - 0.5
        else:
            per_dim = self.log_std - self.log_std_ref + (var_ref + sq) / (2 * var) - 0.5
        return per_dim.sum()

    def exact_kl_grad(self, direction: str = "pi||ref") -> list[Tensor]:
        """Closed-form gradient w.r.t. ``(mean, log_std)`` (no autodiff)."""
        check_direction(direction)
        with torch.no_grad():
            var, var_ref = torch.exp(2 * self.log_std), torch.exp(2 * self.log_std_ref)
            diff = self.mean - self.mean_ref
            if direction == "pi||ref":
                return [diff / var_ref, var / var_ref - 1.0]
            return [diff / var, 1.0 - (var_ref + diff * diff) / var]

    def sample(self, n: int, *, generator: torch.Generator, reparameterize: bool = True) -> Sample:
        """Draw ``n`` points; ``reparameterize=False`` detaches x (score-function samples)."""
        eps = torch.randn(n, self.dim, generator=generator, dtype=self.mean.dtype)
        x = self.mean + torch.exp(self.log_std) * eps
        if not reparameterize:
            x = x.detach()
        return Sample(
            logp=gaussian_log_density(x, self.mean, self.log_std),
            logp_ref=gaussian_log_density(x, self.mean_ref, self.log_std_ref),
            x=x,
            reparameterized=reparameterize,
            density=True,
            logp_stl=gaussian_log_density(x, self.mean.detach(), self.log_std.detach())
            if reparameterize
            else None,
        )

    def log_ratio_moments(self) -> tuple[float, float]:
        """Mean and stdev of ``delta = log pi(x) - log ref(x)``, x ~ pi, when it is Gaussian.

        With equal standard deviations delta is affine in x, so it is exactly normal with mean
        ``sum (m - m_r)^2 / (2 s^2)`` and variance ``sum (m - m_r)^2 / s^2``.
        """
        if not torch.equal(self.log_std.detach(), self.log_std_ref):
            raise NotImplementedError(
                "the log-ratio is Gaussian only when pi and ref have equal standard deviations"
            )
        with torch.no_grad():
            sq = ((self.mean - self.mean_ref) ** 2 * torch.exp(-2 * self.log_std)).sum()
        return float(sq / 2), float(sq.sqrt())

    def expectation(self, fn: Callable[[Tensor], Tensor], *, nodes: int = 160) -> Tensor:
        """Exact (to quadrature precision) ``E_pi[fn(delta)]`` by Gauss-Hermite quadrature.

        Needs equal standard deviations (see :meth:`log_ratio_moments`). ``nodes`` points
        integrate polynomials up to degree ``2 nodes - 1`` exactly; fn must be smooth.
        """
        m, s = self.log_ratio_moments()
        z, w = np.polynomial.hermite_e.hermegauss(nodes)
        z = torch.as_tensor(z, dtype=torch.float64)
        w = torch.as_tensor(w / math.sqrt(2 * math.pi), dtype=torch.float64)
        return (w * fn(m + s * z)).sum()

    def sequence_expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """:meth:`expectation`: a sample is one point, whose log-ratio sums its dimensions."""
        return self.expectation(fn)
