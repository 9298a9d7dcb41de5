r"""A one-dimensional Gaussian mixture as a fixed target ("ref") for fitting one Gaussian pi.

ref is an equal-weight mixture of K Gaussians with means :math:`m_k` and a shared standard
deviation :math:`s`:

.. math::
    ref(x) = \frac1K \sum_k N(x; m_k, s^2).

Its KLs to a Gaussian pi = N(mu, sigma^2) have no closed form:
:meth:`GaussianMixtureTarget.exact_kls` integrates them by the trapezoid rule on a fine grid (by
default 24001 points on [-12, 12]). Over Gaussians pi, KL(ref||pi) is minimized by moment
matching, :math:`\mu = \bar m`, :math:`\sigma^2 = s^2 + \overline{m^2} - \bar m^2`
(:attr:`GaussianMixtureTarget.moment_matching`); with well-separated modes, KL(pi||ref) has a
local minimum near each mode instead.
Used by the ``mode-seeking`` experiment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from klest.testbeds.gaussian import gaussian_log_density

__all__ = ["GaussianMixtureTarget"]


class GaussianMixtureTarget:
    """An equal-weight mixture of 1-D Gaussians with a shared standard deviation (float64).

    Args:
      means: the components' means, at least one.
      std: their shared standard deviation, > 0.
      grid: ``(low, high, points)`` of the quadrature grid of :meth:`exact_kls`.
    """

    def __init__(
        self,
        means: Sequence[float] = (-2.0, 2.0),
        std: float = 0.6,
        *,
        grid: tuple[float, float, int] = (-12.0, 12.0, 24001),
    ) -> None:
        means = tuple(float(m) for m in means)
        if not means or not all(math.isfinite(m) for m in means):
            raise ValueError(f"means must be one or more finite numbers, got {means!r}")
        if not (math.isfinite(std) and std > 0):
            raise ValueError(f"std must be finite and > 0, got {std!r}")
        self.means = means
        self.std = float(std)
        self.grid = torch.linspace(grid[0], grid[1], grid[2], dtype=torch.float64)

    def log_density(self, x: Tensor) -> Tensor:
        """``log ref(x)`` for points ``x`` of any shape (elementwise)."""
        parts = [
            gaussian_log_density(
                x.unsqueeze(-1),
                torch.tensor([m], dtype=x.dtype),
                torch.tensor([math.log(self.std)], dtype=x.dtype),
            )
            for m in self.means
        ]
        return torch.logsumexp(torch.stack(parts), 0) - math.log(len(self.means))

    def sample(self, n: int, *, generator: torch.Generator) -> Tensor:
        """``n`` float64 points from ref: a component uniformly at random, then its noise."""
        which = torch.randint(0, len(self.means), (n,), generator=generator)
        centres = torch.tensor(self.means, dtype=torch.float64)[which]
        return centres + self.std * torch.randn(n, generator=generator, dtype=torch.float64)

    def exact_kls(self, mean: float, std: float) -> dict[str, float]:
        """KL(pi||ref) and KL(ref||pi) for pi = N(mean, std^2), by the trapezoid rule on the grid.

        Returns:
          ``{"pi||ref": ..., "ref||pi": ...}``.
        """
        x = self.grid
        lp = gaussian_log_density(
            x.unsqueeze(-1),
            torch.tensor(mean, dtype=torch.float64).reshape(1),
            torch.tensor(math.log(std), dtype=torch.float64).reshape(1),
        )
        lt = self.log_density(x)
        pi_ref = torch.trapezoid(lp.exp() * (lp - lt), x)
        ref_pi = torch.trapezoid(lt.exp() * (lt - lp), x)
        return {"pi||ref": float(pi_ref), "ref||pi": float(ref_pi)}

    @property
    def moment_matching(self) -> tuple[float, float]:
        """``(mean, std)`` of ref: the Gaussian pi minimizing KL(ref||pi)."""
        k = len(self.means)
        mean = sum(self.means) / k
        var = self.std**2 + (sum(m * m for m in self.means) / k - mean**2)
        return mean, math.sqrt(var)
