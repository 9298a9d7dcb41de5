"""klest: KL divergence estimators and their gradients, correct and low-variance.

Every KL is named by its arguments: ``KL(pi||ref) = E_pi[log pi - log ref]`` (the RLHF penalty,
"reverse" KL in variational inference) and ``KL(ref||pi)`` (maximum likelihood, "forward" KL in
variational inference). ``pi`` is the trainable distribution that samples come from; ``ref`` is
fixed.

The public API is this module, :mod:`klest.nn`, :mod:`klest.testbeds`, :mod:`klest.audit` and
:mod:`klest.logits`; modules whose names start with an underscore are internal.
"""

# The public surface is one import per line (an isort merge would undo that).
from klest._checks import get_default_validate
from klest._checks import set_default_validate
from klest._types import AlphaFit
from klest._types import Backend
from klest._types import Baseline
from klest._types import BoundGrad
from klest._types import BoundReduction
from klest._types import Direction
from klest._types import Estimator
from klest._types import Grad
from klest._types import Level
from klest._types import Reduction
from klest.aggregation import GlobalCounts
from klest.aggregation import KLDiagnostics
from klest.aggregation import WithDetails
from klest.aggregation import aggregate
from klest.audit import GradAudit
from klest.audit import ValueAudit
from klest.audit import audit_grad
from klest.audit import audit_value
from klest.sampled.control_variates import AlphaEMA
from klest.sampled.estimators import EstimateDetails
from klest.sampled.estimators import cv
from klest.sampled.estimators import f_divergence
from klest.sampled.estimators import k1
from klest.sampled.estimators import k2
from klest.sampled.estimators import k3
from klest.sampled.estimators import k_abs
from klest.sampled.estimators import kl_estimate
from klest.logits import LogitsDetails
from klest.logits import categorical_kl
from klest.logits import jsd_from_hidden
from klest.logits import jsd_from_logits
from klest.logits import kl_from_hidden
from klest.logits import kl_from_logits
from klest.logits import kl_from_logits_vocab_parallel
from klest.logits import kl_from_hidden_vocab_parallel
from klest.logits import jsd_from_hidden_vocab_parallel
from klest.logits import jsd_from_logits_vocab_parallel
from klest.logits import skew_kl_from_hidden_vocab_parallel
from klest.logits import skew_kl_from_logits_vocab_parallel
from klest.logits import tv_from_hidden_vocab_parallel
from klest.logits import tv_from_logits_vocab_parallel
from klest.logits import skew_kl_from_logits
from klest.logits import skew_kl_from_hidden
from klest.logits import tv_from_logits
from klest.logits import tv_from_hidden
from klest.logits import token_log_probs
from klest.logits.topk import TopKDetails
from klest.logits.topk import TopKEstimator
from klest.logits.topk import kl_from_topk
from klest.logits.multi_teacher import MultiTeacherDetails
from klest.logits.multi_teacher import multi_teacher_kl_from_hidden
from klest.logits.multi_teacher import multi_teacher_kl_from_logits
from klest.sampled.penalty import GRADIENT_ESTIMATORS
from klest.sampled.penalty import GradientEstimator
from klest.sampled.penalty import KLGradientWarning
from klest.sampled.penalty import PenaltyDetails
from klest.sampled.penalty import kl_penalty
from klest.sampled.context_parallel import ContextParallel
from klest.sampled.penalty import PenaltyTargets
from klest.sampled.penalty import penalty_targets
from klest.sampled.baselines import group_baselines
from klest.layout import cu_seqlens_from_position_ids
from klest.layout import cu_seqlens_from_sequence_ids
from klest.sampled.rewards import kl_reward
from klest.sampled.token_weights import iw_opd_weights
from klest.sampled.importance_weighted import iwae_bound
from klest.sampled.importance_weighted import renyi_bound
from klest.sampled.baselines import BaselineEMA
from klest.sampled.baselines import LooScaleEMA
from klest.surrogates import decouple
from klest._types import SamplerDirection
from klest._types import SamplerDivergence
from klest.sampled.trust_region import TrustRegionDetails
from klest.sampled.trust_region import binary_kl
from klest.sampled.trust_region import binary_tv
from klest.sampled.trust_region import dppo_mask
from klest.sampled.trust_region import icepop_mask
from klest.sampled.trust_region import kpop_mask
from klest.sampled.trust_region import log_ratio_mask
from klest.sampled.trust_region import squared_log_ratio
from klest.sampled.trust_region import squared_prob_shift
from klest.sampled.trust_region import topk_kl
from klest.sampled.trust_region import topk_tv
from klest.pareto import pareto_k
import klest.nn
import klest.distributed  # noqa: F401 (public: klest.distributed.global_counts)

__version__ = "0.1.0"

__all__ = [
    "GRADIENT_ESTIMATORS",
    "AlphaEMA",
    "AlphaFit",
    "Backend",
    "Baseline",
    "BaselineEMA",
    "BoundGrad",
    "BoundReduction",
    "ContextParallel",
    "Direction",
    "EstimateDetails",
    "Estimator",
    "GlobalCounts",
    "Grad",
    "GradAudit",
    "GradientEstimator",
    "KLDiagnostics",
    "KLGradientWarning",
    "Level",
    "LogitsDetails",
    "LooScaleEMA",
    "MultiTeacherDetails",
    "PenaltyDetails",
    "PenaltyTargets",
    "Reduction",
    "SamplerDirection",
    "SamplerDivergence",
    "TopKDetails",
    "TopKEstimator",
    "TrustRegionDetails",
    "ValueAudit",
    "WithDetails",
    "aggregate",
    "audit_grad",
    "audit_value",
    "binary_kl",
    "binary_tv",
    "categorical_kl",
    "cu_seqlens_from_position_ids",
    "cu_seqlens_from_sequence_ids",
    "cv",
    "decouple",
    "dppo_mask",
    "f_divergence",
    "get_default_validate",
    "group_baselines",
    "icepop_mask",
    "iw_opd_weights",
    "iwae_bound",
    "jsd_from_hidden",
    "jsd_from_hidden_vocab_parallel",
    "jsd_from_logits",
    "jsd_from_logits_vocab_parallel",
    "k1",
    "k2",
    "k3",
    "k_abs",
    "kl_estimate",
    "kl_from_hidden",
    "kl_from_hidden_vocab_parallel",
    "kl_from_logits",
    "kl_from_logits_vocab_parallel",
    "kl_from_topk",
    "kl_penalty",
    "kl_reward",
    "kpop_mask",
    "log_ratio_mask",
    "multi_teacher_kl_from_hidden",
    "multi_teacher_kl_from_logits",
    "pareto_k",
    "penalty_targets",
    "renyi_bound",
    "set_default_validate",
    "skew_kl_from_hidden",
    "skew_kl_from_hidden_vocab_parallel",
    "skew_kl_from_logits",
    "skew_kl_from_logits_vocab_parallel",
    "squared_log_ratio",
    "squared_prob_shift",
    "token_log_probs",
    "topk_kl",
    "topk_tv",
    "tv_from_hidden",
    "tv_from_hidden_vocab_parallel",
    "tv_from_logits",
    "tv_from_logits_vocab_parallel",
]
