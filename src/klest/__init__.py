"""klest: KL divergence estimators and their gradients, correct and low-variance.

Every KL is named by its arguments: ``KL(pi||ref) = E_pi[log pi - log ref]`` (the RLHF penalty,
"reverse" KL in VI) and ``KL(ref||pi)`` (maximum likelihood, "forward" KL in VI). ``pi`` is the
trainable distribution that samples come from; ``ref`` is fixed.
"""

from klest.aggregation import KLDiagnostics
from klest.aggregation import aggregate
from klest.audit import GradAudit
from klest.audit import ValueAudit
from klest.audit import audit_grad
from klest.audit import audit_value
from klest.control_variates import AlphaEMA
from klest.estimators import cv
from klest.estimators import f_divergence
from klest.estimators import k1
from klest.estimators import k2
from klest.estimators import k3
from klest.estimators import k_abs
from klest.estimators import kl_estimate
from klest.logits import LogitsKL
from klest.logits import categorical_kl
from klest.logits import kl_from_hidden
from klest.logits import kl_from_logits
from klest.logits import kl_from_logits_vocab_parallel
from klest.penalty import KLGradientWarning
from klest.penalty import PenaltyDetails
from klest.penalty import kl_penalty
from klest.surrogates import BaselineEMA
from klest.surrogates import decouple

__version__ = "0.1.0"

__all__ = [
    "AlphaEMA",
    "BaselineEMA",
    "GradAudit",
    "KLDiagnostics",
    "KLGradientWarning",
    "LogitsKL",
    "PenaltyDetails",
    "ValueAudit",
    "aggregate",
    "audit_grad",
    "audit_value",
    "categorical_kl",
    "cv",
    "decouple",
    "f_divergence",
    "k1",
    "k2",
    "k3",
    "k_abs",
    "kl_estimate",
    "kl_from_hidden",
    "kl_from_logits",
    "kl_from_logits_vocab_parallel",
    "kl_penalty",
]
