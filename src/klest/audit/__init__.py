"""Measure estimators against a testbed's exact answers: bias, spread and significance.

- :mod:`klest.audit.core`: the audits (:func:`audit_value`, :func:`audit_grad`), their results,
  the estimator names they parse (:class:`EstimatorSpec`, :class:`GradSpec`) and the statistics
  behind them (:func:`gradient_draws`, :func:`mean_shift_z`).
- :mod:`klest.audit.suite`: the library's audit plan, what ``klest audit`` prints
  (:func:`run_audit_suite`), including the top-k distillation estimators, the divergences
  between a policy and its rollout policy and the K-sample variational bounds.

Every public name is exported here: ``klest.audit.audit_grad`` is
``klest.audit.core.audit_grad``.
"""

# The public surface is one import per line (an isort merge would undo that).
# ruff: noqa: I001
from klest.audit.core import EstimateFn
from klest.audit.core import EstimatorSpec
from klest.audit.core import GradAudit
from klest.audit.core import GradSpec
from klest.audit.core import ValueAudit
from klest.audit.core import WEIGHT_RULES
from klest.audit.core import audit_grad
from klest.audit.core import audit_value
from klest.audit.core import format_grad_audits
from klest.audit.core import format_value_audits
from klest.audit.core import gradient_draws
from klest.audit.core import mean_shift_z
from klest.audit.suite import GRAD_AUDIT
from klest.audit.suite import GRAD_AUDIT_BOTH
from klest.audit.suite import GRAD_AUDIT_ONLY
from klest.audit.suite import REPARAMETERIZED_GRAD_AUDIT
from klest.audit.suite import SEQUENCE_VALUE_AUDIT
from klest.audit.suite import TOPK_AUDIT
from klest.audit.suite import TRUST_REGION_AUDIT
from klest.audit.suite import VALUE_AUDIT
from klest.audit.suite import VARIATIONAL_AUDIT
from klest.audit.suite import bound_loss_fn
from klest.audit.suite import run_audit_suite
from klest.audit.suite import sampler_testbed
from klest.audit.suite import topk_audit_section
from klest.audit.suite import topk_estimate_fn
from klest.audit.suite import trust_region_audit_section
from klest.audit.suite import trust_region_estimate_fn
from klest.audit.suite import variational_audit_section

__all__ = [
    "GRAD_AUDIT",
    "GRAD_AUDIT_BOTH",
    "GRAD_AUDIT_ONLY",
    "REPARAMETERIZED_GRAD_AUDIT",
    "SEQUENCE_VALUE_AUDIT",
    "TOPK_AUDIT",
    "TRUST_REGION_AUDIT",
    "VALUE_AUDIT",
    "VARIATIONAL_AUDIT",
    "WEIGHT_RULES",
    "EstimateFn",
    "EstimatorSpec",
    "GradAudit",
    "GradSpec",
    "ValueAudit",
    "audit_grad",
    "audit_value",
    "bound_loss_fn",
    "format_grad_audits",
    "format_value_audits",
    "gradient_draws",
    "mean_shift_z",
    "run_audit_suite",
    "sampler_testbed",
    "topk_audit_section",
    "topk_estimate_fn",
    "trust_region_audit_section",
    "trust_region_estimate_fn",
    "variational_audit_section",
]
