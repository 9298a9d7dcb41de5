"""Testbeds built from other testbeds: off-policy sampling, score-function Gaussian samples."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from klest.testbeds.base import Sample, SampledTestbed, Testbed
from klest.testbeds.gaussian import GaussianTestbed

__all__ = ["OffPolicyTestbed", "ScoreFunctionGaussian"]


class OffPolicyTestbed(Testbed):
    """Samples drawn from ``behavior``, scored under ``target``'s pi and ref.

    The exact KLs and gradients are ``target``'s; each :class:`Sample` carries
    ``logp_behavior`` so estimators can importance-weight. ``target`` and ``behavior`` are
    testbeds derived from :class:`SampledTestbed`, of the same kind (categorical, or
    autoregressive with the same V, T and eos); only ``behavior``'s pi is used.
    """

    def __init__(self, target: SampledTestbed, behavior: SampledTestbed) -> None:
        for tb in (target, behavior):
            if not isinstance(tb, SampledTestbed):
                raise TypeError(
                    f"{type(tb).__name__} cannot draw and evaluate samples (it is not a "
                    "SampledTestbed)"
                )
        self.target = target
        self.behavior = behavior
        self.name = f"{target.name} (off-policy)"

    def parameters(self) -> list[Tensor]:
        return self.target.parameters()

    def exact_kl(self, direction: str = "pi||ref") -> Tensor:
        return self.target.exact_kl(direction)

    def exact_kl_grad(self, direction: str = "pi||ref") -> list[Tensor]:
        return self.target.exact_kl_grad(direction)

    def sample(self, n: int, *, generator: torch.Generator) -> Sample:
        x = self.behavior.draw(n, generator=generator)
        sample = self.target.evaluate(x)
        with torch.no_grad():
            sample.logp_behavior = self.behavior.evaluate(x).logp.detach()
        return sample


class ScoreFunctionGaussian(Testbed):
    """A :class:`GaussianTestbed` whose samples are not reparameterized (x detached).

    Gradients can then only come from the score ``grad log pi(x)``: the setting of sampled
    tokens, on a testbed with analytic answers.
    """

    def __init__(self, gaussian: GaussianTestbed) -> None:
        self.gaussian = gaussian
        self.name = "gaussian (score function)"

    def parameters(self) -> list[Tensor]:
        return self.gaussian.parameters()

    def exact_kl(self, direction: str = "pi||ref") -> Tensor:
        return self.gaussian.exact_kl(direction)

    def exact_kl_grad(self, direction: str = "pi||ref") -> list[Tensor]:
        return self.gaussian.exact_kl_grad(direction)

    def sample(self, n: int, *, generator: torch.Generator) -> Sample:
        return self.gaussian.sample(n, generator=generator, reparameterize=False)

    def expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return self.gaussian.expectation(fn)

    def sequence_expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        return self.gaussian.sequence_expectation(fn)
