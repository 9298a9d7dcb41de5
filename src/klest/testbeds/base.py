"""The interface every exact testbed implements, and the batch of samples it returns.

:class:`Testbed` is the interface; :class:`SampledTestbed` is a testbed whose sampling splits in
two, drawing raw samples from pi (:meth:`~SampledTestbed.draw`) and scoring given samples
(:meth:`~SampledTestbed.evaluate`), so samples drawn from one testbed can be scored by another
(:class:`~klest.testbeds.OffPolicyTestbed`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from klest._checks import check_direction

__all__ = ["Sample", "SampledTestbed", "Testbed", "make_generator"]


@dataclass
class Sample:
    """A batch drawn from pi, with what estimators need.

    Attributes:
      logp: log pi of each sample (``[n]``) or of each token (``[n, T]``); carries the graph to
        the testbed's parameters.
      logp_ref: log ref of the same samples / tokens (no graph to pi's parameters).
      mask: ``[n, T]`` bool, False after the end of a sequence; None when all count.
      x: the samples: points ``[n, D]`` or tokens ``[n, T]``.
      reparameterized: True when ``x`` itself is a differentiable function of pi's parameters
        (``x = g(theta, eps)``), so pathwise gradients apply.
      logits: full next-token log-probabilities of pi along each sample, ``[n, T, V]``, when the
        testbed has them (categorical, autoregressive); graph to the parameters.
      logits_ref: the same for ref.
      logp_stl: log pi(x) with pi's distribution parameters stopped but x still differentiable
        (reparameterized testbeds): the "sticking the landing" surrogate.
      logp_behavior: log behavior of the samples when they were drawn from a behavior
        distribution rather than pi (:class:`~klest.testbeds.OffPolicyTestbed`).
      density: True when ``logp`` / ``logp_ref`` are log-densities of continuous samples
        (which may exceed 0), False for log-probabilities of discrete ones.
    """

    logp: Tensor
    logp_ref: Tensor
    mask: Tensor | None = None
    x: Tensor | None = None
    reparameterized: bool = False
    logits: Tensor | None = None
    logits_ref: Tensor | None = None
    logp_stl: Tensor | None = None
    logp_behavior: Tensor | None = None
    density: bool = False


class Testbed(ABC):
    """A pair (pi, ref) whose KLs in both directions, and their gradients, are known exactly.

    ``pi`` is trainable: :meth:`parameters` are leaf tensors with ``requires_grad``; ``ref`` is
    fixed. Estimators are audited against :meth:`exact_kl` and :meth:`exact_kl_grad`.
    """

    name: str = "testbed"

    @abstractmethod
    def parameters(self) -> list[Tensor]:
        """pi's trainable parameters."""

    @abstractmethod
    def exact_kl(self, direction: str = "pi||ref") -> Tensor:
        """The exact KL as a scalar tensor, differentiable w.r.t. :meth:`parameters`."""

    @abstractmethod
    def sample(self, n: int, *, generator: torch.Generator) -> Sample:
        """Draw ``n`` samples from pi."""

    def exact_kl_grad(self, direction: str = "pi||ref") -> list[Tensor]:
        """The exact gradient of the KL w.r.t. :meth:`parameters` (autodiff of the exact value)."""
        check_direction(direction)
        with torch.enable_grad():
            return list(torch.autograd.grad(self.exact_kl(direction), self.parameters()))

    def expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """Exact ``E_{y~pi}[sum_t fn(delta_t)]``, ``delta_t = logp_t - logp_ref_t``.

        A token sum for sequences, a single term for points: the exact mean of any per-token
        estimator that is a function of the log-ratio (biased ones included), for testbeds that
        can enumerate or integrate it; others raise NotImplementedError.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot compute exact expectations")

    def sequence_expectation(self, fn: Callable[[Tensor], Tensor]) -> Tensor:
        """Exact ``E_{y~pi}[fn(sum_t delta_t)]``: ``fn`` of the whole sample's log-ratio.

        The exact mean of an estimator applied with ``level="sequence"``. For testbeds whose
        samples are single points it equals :meth:`expectation`; testbeds that cannot compute it
        raise NotImplementedError.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot compute exact sequence-level expectations"
        )


class SampledTestbed(Testbed):
    """A testbed that samples in two steps: :meth:`draw` raw samples, then :meth:`evaluate` them.

    ``evaluate`` scores any samples of the right kind, not only the testbed's own, which is what
    off-policy sampling needs (:class:`~klest.testbeds.OffPolicyTestbed`).
    """

    @abstractmethod
    def draw(self, n: int, *, generator: torch.Generator) -> Tensor:
        """``n`` raw samples from pi (outcome indices, token sequences...), without graph."""

    @abstractmethod
    def evaluate(self, x: Tensor) -> Sample:
        """The :class:`Sample` of given raw samples ``x``: log pi (with graph), log ref, ..."""

    def sample(self, n: int, *, generator: torch.Generator) -> Sample:
        """``evaluate(draw(n))``."""
        return self.evaluate(self.draw(n, generator=generator))


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A seeded ``torch.Generator``: every klest experiment and test draws through one.

    Args:
      seed: the seed.
      device: the generator's device.

    Returns:
      A ``torch.Generator`` seeded with ``seed``.

    Example:
      >>> torch.equal(torch.rand(3, generator=make_generator(7)),
      ...             torch.rand(3, generator=make_generator(7)))
      True
    """
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
