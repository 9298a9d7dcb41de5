"""Exact testbeds: distribution pairs whose KLs and KL gradients are known exactly.

- :class:`GaussianTestbed`: diagonal Gaussians, analytic KL and gradient, reparameterized samples.
- :class:`CategoricalTestbed`: one categorical distribution, exact by summation.
- :class:`TabularAutoregressive`: autoregressive policies over sequences, exact by enumeration
  or (Markov policies) dynamic programming.
- :class:`OffPolicyTestbed`: samples from a behavior policy, answers of a target pair.
- :class:`ScoreFunctionGaussian`: Gaussians with non-reparameterized samples.
"""

from klest.testbeds.autoregressive import TabularAutoregressive
from klest.testbeds.base import Sample, Testbed, make_generator
from klest.testbeds.categorical import CategoricalTestbed
from klest.testbeds.gaussian import GaussianTestbed
from klest.testbeds.wrappers import OffPolicyTestbed, ScoreFunctionGaussian

__all__ = [
    "CategoricalTestbed",
    "GaussianTestbed",
    "OffPolicyTestbed",
    "Sample",
    "ScoreFunctionGaussian",
    "TabularAutoregressive",
    "Testbed",
    "make_generator",
]
