"""klest: KL divergence estimators and their gradients, correct and low-variance.

Every KL is named by its arguments: ``KL(pi||ref) = E_pi[log pi - log ref]`` (the RLHF penalty,
"reverse" KL in VI) and ``KL(ref||pi)`` (maximum likelihood, "forward" KL in VI). ``pi`` is the
trainable distribution that samples come from; ``ref`` is fixed.
"""

from klest.aggregation import KLDiagnostics, aggregate
from klest.audit import ValueAudit, audit_value
from klest.categorical import categorical_kl
from klest.control_variates import AlphaEMA
from klest.estimators import cv, f_divergence, k1, k2, k3, k_abs, kl_estimate

__version__ = "0.1.0"

__all__ = [
    "AlphaEMA",
    "KLDiagnostics",
    "ValueAudit",
    "aggregate",
    "audit_value",
    "categorical_kl",
    "cv",
    "f_divergence",
    "k1",
    "k2",
    "k3",
    "k_abs",
    "kl_estimate",
]
