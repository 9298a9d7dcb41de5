"""Exact testbeds: distribution pairs whose KLs and KL gradients are known exactly.

Every testbed is a :class:`Testbed`; those that draw raw samples and score them separately
derive from :class:`SampledTestbed`.

- :class:`GaussianTestbed`: diagonal Gaussians, analytic KL and gradient, reparameterized samples.
- :class:`CategoricalTestbed`: one categorical distribution, exact by summation.
- :class:`TabularAutoregressive`: autoregressive policies over sequences, exact by enumeration
  or (Markov policies) dynamic programming.
- :class:`LanguageModelTestbed`: a small causal language model (policy and reference) whose
  completions up to a horizon are enumerated: exact sequence KLs and their gradients.
- :class:`OffPolicyTestbed`: samples from a behavior policy, answers of a target pair.
- :class:`ScoreFunctionGaussian`: Gaussians with non-reparameterized samples.
- :class:`GaussianMixtureTarget`: a fixed 1-D Gaussian mixture, KLs to a Gaussian by quadrature.
- :class:`VariationalGaussian`: a Gaussian encoder against an unnormalized Gaussian joint, K
  importance samples per data point; the K-sample bounds' means by quadrature.

:func:`tiny_causal_lm` and :func:`word_tokenizer` build a small ``transformers`` causal LM and a
tokenizer from a config (nothing downloaded), for :meth:`LanguageModelTestbed.tiny`, tests and
examples.
"""

from klest.testbeds._tiny_lm import tiny_causal_lm, word_tokenizer
from klest.testbeds.autoregressive import TabularAutoregressive
from klest.testbeds.base import Sample, SampledTestbed, Testbed, make_generator
from klest.testbeds.categorical import CategoricalTestbed
from klest.testbeds.gaussian import GaussianTestbed
from klest.testbeds.language_model import LanguageModelTestbed
from klest.testbeds.mixture import GaussianMixtureTarget
from klest.testbeds.variational import VariationalGaussian
from klest.testbeds.wrappers import OffPolicyTestbed, ScoreFunctionGaussian

__all__ = [
    "CategoricalTestbed",
    "GaussianMixtureTarget",
    "GaussianTestbed",
    "LanguageModelTestbed",
    "OffPolicyTestbed",
    "Sample",
    "SampledTestbed",
    "ScoreFunctionGaussian",
    "TabularAutoregressive",
    "Testbed",
    "VariationalGaussian",
    "make_generator",
    "tiny_causal_lm",
    "word_tokenizer",
]
