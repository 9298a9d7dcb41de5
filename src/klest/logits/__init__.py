"""Exact divergences between next-token distributions, from logits, at language-model scale.

In the order data flows: :mod:`~klest.logits.reference` (plain PyTorch, small V, the reference
the rest is tested against), the row statistics and the chunked engine, the Triton kernels
(:mod:`klest.logits.kernels`), then three front ends: :func:`kl_from_logits`,
:func:`kl_from_hidden` (fused with the LM head), :func:`kl_from_logits_vocab_parallel` and
:func:`kl_from_hidden_vocab_parallel`
(vocabulary shards over ``torch.distributed``); the generalized JSD, skew KL and total
variation (:mod:`~klest.logits.divergences`, and from sharded heads
:mod:`~klest.logits.vocab_parallel_divergences`); :func:`token_log_probs`, the sampled
tokens' log-probs from logits, memory-bounded; and :func:`kl_from_topk`, the KL to a teacher
known by its top-k log-probs (:mod:`~klest.logits.topk`); the weighted or routed KLs to several
teachers (:mod:`~klest.logits.multi_teacher`).
"""

# The public surface is one import per line (an isort merge would undo that).
# ruff: noqa: I001
from klest.logits.reference import categorical_kl
from klest.logits._stats import KLRowStats
from klest.logits._call import LogitsDetails
from klest.logits.dtensor import kl_from_logits
from klest.logits.dtensor import kl_from_hidden
from klest.logits.dtensor import jsd_from_logits
from klest.logits.dtensor import jsd_from_hidden
from klest.logits.dtensor import skew_kl_from_logits
from klest.logits.dtensor import skew_kl_from_hidden
from klest.logits.dtensor import tv_from_logits
from klest.logits.dtensor import tv_from_hidden
from klest.logits.vocab_parallel import kl_from_logits_vocab_parallel
from klest.logits.vocab_parallel_hidden import kl_from_hidden_vocab_parallel
from klest.logits.vocab_parallel_divergences import jsd_from_hidden_vocab_parallel
from klest.logits.vocab_parallel_divergences import jsd_from_logits_vocab_parallel
from klest.logits.vocab_parallel_divergences import skew_kl_from_hidden_vocab_parallel
from klest.logits.vocab_parallel_divergences import skew_kl_from_logits_vocab_parallel
from klest.logits.vocab_parallel_divergences import tv_from_hidden_vocab_parallel
from klest.logits.vocab_parallel_divergences import tv_from_logits_vocab_parallel
from klest.logits.sampled_log_probs import token_log_probs
from klest.logits.topk import TopKDetails
from klest.logits.topk import TopKEstimator
from klest.logits.topk import kl_from_topk
from klest.logits.multi_teacher import MultiTeacherDetails
from klest.logits.multi_teacher import multi_teacher_kl_from_hidden
from klest.logits.multi_teacher import multi_teacher_kl_from_logits

__all__ = [
    "KLRowStats",
    "LogitsDetails",
    "MultiTeacherDetails",
    "TopKDetails",
    "TopKEstimator",
    "categorical_kl",
    "jsd_from_hidden",
    "jsd_from_hidden_vocab_parallel",
    "jsd_from_logits",
    "jsd_from_logits_vocab_parallel",
    "kl_from_hidden",
    "kl_from_hidden_vocab_parallel",
    "kl_from_logits",
    "kl_from_logits_vocab_parallel",
    "kl_from_topk",
    "multi_teacher_kl_from_hidden",
    "multi_teacher_kl_from_logits",
    "skew_kl_from_hidden",
    "skew_kl_from_hidden_vocab_parallel",
    "skew_kl_from_logits",
    "skew_kl_from_logits_vocab_parallel",
    "token_log_probs",
    "tv_from_hidden",
    "tv_from_hidden_vocab_parallel",
    "tv_from_logits",
    "tv_from_logits_vocab_parallel",
]
