r"""A Gaussian variational model: K importance samples per data point, exact bounds by quadrature.

pi = q(z) = N(mean, exp(log_std)^2) per dimension (the encoder, trainable, reparameterized) and
the unnormalized target ref(z) = p(x, z) = Z N(z; mean_ref, exp(log_std_ref)^2) (the joint,
``mean_ref`` trainable: the model's parameter theta), so the posterior is
N(mean_ref, exp(log_std_ref)^2) and the evidence Z. Each sample is one data point's K draws
:math:`z_1..z_K \sim \pi`, with the log-weights' inputs of :func:`klest.renyi_bound`.

Exact answers: the KLs between pi and the posterior in closed form (:meth:`exact_kl`;
:math:`\log Z - KL(\pi\|p(\cdot|x))` is the ELBO, the mean of every bound at K = 1), and the
mean of the K-sample Rényi bound :math:`E[\mathcal L_{\alpha,K}]` with its gradient by a
tensor-product Gauss-Hermite quadrature over the K D noises (:meth:`exact_bound`): small K D.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from klest._checks import check_direction
from klest.testbeds.base import Sample, Testbed
from klest.testbeds.gaussian import gaussian_log_density

__all__ = ["VariationalGaussian"]

MAX_QUADRATURE_POINTS = 4_000_000
"""The most points (``nodes^(K D)``) :meth:`VariationalGaussian.exact_bound` sums."""


class VariationalGaussian(Testbed):
    """A Gaussian encoder against an unnormalized Gaussian joint, K samples per data point.

    Args:
      k: K, the samples per data point.
      mean: pi's mean ``[D]`` (a scalar broadcasts to ``dim``).
      log_std: pi's log standard deviation.
      mean_ref: the joint's (and posterior's) mean, trainable (theta).
      log_std_ref: the posterior's log standard deviation (fixed).
      log_z: the log evidence :math:`\\log Z` (fixed).
      dim: D.

    Example:
      >>> tb = VariationalGaussian(k=2, mean=0.5, log_std=0.2)
      >>> s = tb.sample(4, generator=klest.testbeds.make_generator(0))
      >>> s.logp.shape, s.x.shape  # 4 data points, K = 2 samples each, D = 1
      (torch.Size([4, 2]), torch.Size([4, 2, 1]))
      >>> round(float(tb.exact_bound(1.0)), 6) == round(float(tb.elbo()), 6)
      True
    """

    name = "variational-gaussian"

    def __init__(
        self,
        *,
        k: int,
        mean: float = 0.0,
        log_std: float = 0.0,
        mean_ref: float = 0.0,
        log_std_ref: float = 0.0,
        log_z: float = math.log(3.0),
        dim: int = 1,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")

        def vector(x: float) -> Tensor:
            return torch.full((dim,), float(x), dtype=torch.float64)

        self.k = k
        self.dim = dim
        self.mean = vector(mean).requires_grad_(True)
        self.log_std = vector(log_std).requires_grad_(True)
        self.mean_ref = vector(mean_ref).requires_grad_(True)
        self.log_std_ref = vector(log_std_ref)
        self.log_z = float(log_z)

    def parameters(self) -> list[Tensor]:
        """The encoder's ``mean`` and ``log_std``, then the model's ``mean_ref`` (theta)."""
        return [self.mean, self.log_std, self.mean_ref]

    def _log_weights(self, z: Tensor, mean: Tensor, log_std: Tensor) -> Tensor:
        log_joint = gaussian_log_density(z, self.mean_ref, self.log_std_ref) + self.log_z
        return log_joint - gaussian_log_density(z, mean, log_std)

    def sample(self, n: int, *, generator: torch.Generator) -> Sample:
        """``n`` data points' K reparameterized samples: ``logp`` ``[n, K]`` (log pi),
        ``logp_ref`` (the log joint), ``logp_stl`` (pi's parameters stopped), ``x`` the samples
        ``[n, K, D]``."""
        eps = torch.randn(n, self.k, self.dim, generator=generator, dtype=torch.float64)
        z = self.mean + torch.exp(self.log_std) * eps
        return Sample(
            logp=gaussian_log_density(z, self.mean, self.log_std),
            logp_ref=gaussian_log_density(z, self.mean_ref, self.log_std_ref) + self.log_z,
            x=z,
            reparameterized=True,
            density=True,
            logp_stl=gaussian_log_density(z, self.mean.detach(), self.log_std.detach()),
        )

    def exact_kl(self, direction: str = "pi||ref") -> Tensor:
        """The KL between pi and the posterior (ref normalized), closed form."""
        check_direction(direction)
        var, var_ref = torch.exp(2 * self.log_std), torch.exp(2 * self.log_std_ref)
        sq = (self.mean - self.mean_ref) ** 2
        if direction == "pi||ref":
            per_dim = self.log_std_ref - self.log_std + (var + sq) / (2 * var_ref) - 0.5
        else:
            per_dim = self.log_std - self.log_std_ref + (var_ref + sq) / (2 * var) - 0.5
        return per_dim.sum()

    def elbo(self) -> Tensor:
        """:math:`\\log Z - KL(\\pi\\|p(\\cdot|x))`, closed form (differentiable)."""
        return self.log_z - self.exact_kl("pi||ref")

    def exact_bound(self, alpha: float, *, nodes: int = 60) -> Tensor:
        r""":math:`E[\mathcal L_{\alpha,K}]`, differentiable in :meth:`parameters`, by quadrature.

        .. math::
            E[\mathcal L_{\alpha,K}] = \int \frac{1}{1-\alpha}\log\frac1K\sum_k
            e^{(1-\alpha)\ell(g(\epsilon_k))}\,\prod_k N(\epsilon_k; 0, I)\,d\epsilon,

        :math:`\ell(z) = \log ref(z) - \log\pi(z)`, :math:`g(\epsilon) = mean + std\,\epsilon`:
        a ``nodes``-point Gauss-Hermite rule in each of the K D noise coordinates (the
        log-sum-exp is smooth, so the rule converges fast: compare two ``nodes``). ``alpha = 1``
        is the mean log-weight, whose mean is the ELBO. Autodiff of it gives the exact gradient
        of the mean bound (every estimator of :func:`klest.renyi_bound` claims it, or not).

        Args:
          alpha: the Rényi order (0: IWAE).
          nodes: points per noise coordinate.

        Returns:
          A scalar tensor with the graph to :meth:`parameters`.
        """
        dims = self.k * self.dim
        if nodes**dims > MAX_QUADRATURE_POINTS:
            raise ValueError(
                f"nodes^(K D) = {nodes}^{dims} quadrature points is too many (limit "
                f"{MAX_QUADRATURE_POINTS}): fewer nodes, or a smaller K D"
            )
        x, w = np.polynomial.hermite_e.hermegauss(nodes)
        x = torch.as_tensor(x, dtype=torch.float64)
        w = torch.as_tensor(w / math.sqrt(2 * math.pi), dtype=torch.float64)
        eps = torch.cartesian_prod(*([x] * dims)).reshape(-1, self.k, self.dim)
        weight = torch.cartesian_prod(*([w] * dims)).reshape(-1, dims).prod(-1)
        z = self.mean + torch.exp(self.log_std) * eps
        lw = self._log_weights(z, self.mean, self.log_std)  # [points, K]
        if alpha == 1.0:
            bound = lw.mean(-1)
        else:
            b = 1.0 - alpha
            bound = (torch.logsumexp(b * lw, -1) - math.log(self.k)) / b
        return (weight * bound).sum()

    def exact_bound_grad(self, alpha: float, *, nodes: int = 60) -> Tensor:
        """The gradient of :meth:`exact_bound` over :meth:`parameters`, flattened, float64."""
        with torch.enable_grad():
            grads = torch.autograd.grad(self.exact_bound(alpha, nodes=nodes), self.parameters())
        return torch.cat([g.reshape(-1) for g in grads])
