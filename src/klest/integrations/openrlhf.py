r"""OpenRLHF's ``compute_approx_kl``, with OpenRLHF's signature and values, and a choice of
gradient.

OpenRLHF (https://github.com/OpenRLHF/OpenRLHF, https://openrlhf.readthedocs.io) computes its
KL per token with ``openrlhf.models.utils.compute_approx_kl``: in the reward (the default) and,
with ``--algo.kl.use_loss``, as a loss term weighted by ``--algo.kl.init_coef``; the estimator is
``--algo.kl.estimator`` (k1, k2, k3; these flags were ``--use_kl_loss``, ``--init_kl_coef`` and
``--kl_estimator`` in earlier versions). This module has the function under that name,
signature and option names (as of OpenRLHF 0.11.2), and :func:`install`, which puts it into
OpenRLHF's actor loss.

Samples: responses y from the rollout policy pi_old (``log_probs_old``). With
:math:`\delta_t = \log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t})` and the score
:math:`s_t = \nabla\log\pi(y_t|y_{<t})`, each estimator's value (every value is clipped to
[-10, 10]), what it estimates, and the mean of OpenRLHF's gradient (autodiff of the value):

- ``"k1"``: :math:`\delta_t`, unbiased for KL(pi_t||ref_t); gradient mean :math:`E[s_t] = 0`:
  no signal.
- ``"k2"``: :math:`\delta_t^2/2`, biased (second order); gradient mean
  :math:`\sum_t E_{y_{<t}}[\nabla KL(\pi_t\|ref_t)]` with the prefixes held fixed: biased for
  sequences (it misses each token's effect on the later ones).
- ``"k3"``: :math:`e^{-x} - 1 + x` with :math:`x = \max(\delta_t, -10)`, unbiased for
  KL(pi_t||ref_t) below the clips; gradient mean
  :math:`\sum_t E_{y_{<t}}[\nabla KL(ref_t\|\pi_t)]`: the *other* KL, token by token.

``unbiased_gradient=True`` (``--algo.kl.unbiased_gradient``) keeps the value and takes the
gradient of :math:`w_t\delta_t^2/2` with :math:`w_t = \min(\pi_t/\pi_{old,t}, 10)` detached:
:math:`w_t\delta_t s_t`, the per-token gradient (k2's, importance weighted token by token). Its
mean is the k2 row's (clipping aside): unbiased for one token, *biased* for sequences, because
it misses each token's effect on the later ones.

The keyword-only ``grad=`` replaces OpenRLHF's gradient by one of klest's
(:func:`klest.kl_penalty`, per-token losses with ``reduction="none"``) and keeps OpenRLHF's
value: ``"cumulative"``, ``"score"`` or ``"rb"``, unbiased for :math:`\nabla KL(\pi\|ref)` of the
sequences, with ``log_probs_old`` as the sampling policy (importance weights per prefix,
unclipped). OpenRLHF reduces the per-token losses by the mean over tokens (``--actor.loss_agg_mode
token-mean``), which gives the mean sequence KL's gradient times the batch's
sequences over its tokens, or by ``"seq-mean-token-mean"``, which weighs each sequence by one
over its length and is not the gradient of a KL.

References: J. Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html): k1, k2, k3. Y. Tang and R. Munos, "On a few pitfalls in
KL divergence gradient estimation for RL" (2025, https://arxiv.org/abs/2506.09477): the biases
of these gradients, cumulative and leave-one-out estimators.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from klest._checks import ArgumentNames, check_choice, check_flag
from klest._numerics import exp_tail
from klest._types import Baseline
from klest.integrations._patch import Installed, replace_function
from klest.integrations._peer_gradient import (
    KlestOptions,
    PeerGrad,
    peer_log_ratios,
    with_klest_gradient,
)
from klest.sampled.baselines import BaselineEMA
from klest.surrogates import join

__all__ = ["Installed", "KLEstimatorName", "compute_approx_kl", "install"]

KLEstimatorName = Literal["k1", "k2", "k3"]
"""OpenRLHF's names of its per-token KL estimators (``--algo.kl.estimator``)."""

# OpenRLHF's clips: every value, k3's log-ratio before the exponential, and the importance
# weight of unbiased_gradient.
_VALUE_CLIP = 10.0
_K3_LOG_RATIO_MIN = -10.0
_WEIGHT_CLIP = 10.0


def _k1(delta: Tensor) -> Tensor:
    return delta.clamp(-_VALUE_CLIP, _VALUE_CLIP)


def _k2(delta: Tensor) -> Tensor:
    return (0.5 * delta * delta).clamp(-_VALUE_CLIP, _VALUE_CLIP)


def _k3(delta: Tensor) -> Tensor:
    """OpenRLHF's k3 with its clips, computed without cancellation near r = 1."""
    return exp_tail(-delta.clamp(min=_K3_LOG_RATIO_MIN)).clamp(-_VALUE_CLIP, _VALUE_CLIP)


_NAMES = ArgumentNames(
    "log_probs", "log_probs_base", "log_probs_old", "action_mask", density_option=False
)
"""OpenRLHF's names of the log-probs and mask, for the messages."""

_VALUES: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def compute_approx_kl(
    log_probs: Tensor,
    log_probs_base: Tensor,
    log_probs_old: Tensor | None = None,
    kl_estimator: KLEstimatorName = "k1",
    unbiased_gradient: bool = False,
    *,
    action_mask: Tensor | None = None,
    grad: PeerGrad = "peer",
    baseline: Baseline | BaselineEMA | None = None,
    group: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""OpenRLHF's per-token KL estimate (same name, arguments and value), with a choice of
    gradient.

    .. math::
        \text{k1} = \mathrm{clip}(\delta_t), \quad \text{k2} = \mathrm{clip}(\delta_t^2/2),
        \quad \text{k3} = \mathrm{clip}(e^{-x} - 1 + x),\ x = \max(\delta_t, -10)

    with :math:`\delta_t = \log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t})` and clip to
    [-10, 10]. k1 and k3 estimate the per-token KL(pi_t||ref_t) without bias while the clips are
    inactive (k2 is biased), and their sums over a sequence the sequence-level KL(pi||ref). The
    table of :mod:`klest.integrations.openrlhf` says what OpenRLHF's gradients have for mean.

    Samples: the tokens y ~ pi_old, the policy of ``log_probs_old`` (pi itself on-policy).

    ``grad="peer"`` is OpenRLHF's gradient: autodiff of the value, or with
    ``unbiased_gradient=True`` the gradient of :math:`w_t\delta_t^2/2`,
    :math:`w_t = \min(e^{\log\pi_t - \log\pi_{old,t}}, 10)` detached (1 without
    ``log_probs_old``). ``"cumulative"``, ``"score"`` and ``"rb"`` keep the value and take the
    gradient of ``klest.kl_penalty(log_probs, log_probs_base, grad=grad, reduction="none",
    logp_behavior=log_probs_old)``: per-token losses that sum, per sequence, to an unbiased
    estimator of :math:`\nabla KL(\pi\|ref)` of that sequence.

    Values equal OpenRLHF's up to rounding: k3 is computed without cancellation; OpenRLHF
    computes in float32 (``.float()``), this function in float32 for float32 / bf16 / fp16
    inputs and in float64 for float64 ones. Bad input (NaN, +inf or positive log-probs,
    mismatched shapes) raises ``ValueError``.

    See J. Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html)
    and Y. Tang and R. Munos, "On a few pitfalls in KL divergence gradient estimation for RL"
    (2025, https://arxiv.org/abs/2506.09477).

    Args:
      log_probs: log pi of the sampled tokens ``[..., T]``, with the trainable graph.
      log_probs_base: log ref of the same tokens.
      log_probs_old: log pi_old of the same tokens, the policy that sampled them.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      unbiased_gradient: OpenRLHF's per-token importance-weighted gradient (``grad="peer"``
        only).
      action_mask: bool ``[..., T]``: the result is 0 with no gradient where False. OpenRLHF
        0.11.2 passes none; its log-probs are 0 under both models at padding, which gives 0
        there as well (earlier versions took ``action_mask`` as the third argument: pass it by
        name here).
      grad: ``"peer"`` (OpenRLHF's gradient), ``"cumulative"``, ``"score"`` or ``"rb"``.
      baseline: for klest's gradients: ``"loo"``, ``"mean"`` or a :class:`klest.BaselineEMA`.
      group: integer prompt ids ``[...]`` for the baseline (default: the whole batch).
      logits: for ``grad="rb"``: pi's logits along the samples ``[..., T, V]``, with graph.
      logits_ref: ref's logits, same shape.
      cu_seqlens: packed sequences (:mod:`klest.layout`) for klest's gradients: the
        log-probs are ``[total]``, the sequences' tokens one after another.
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known.
      validate: run the value checks (None: the global default).

    Returns:
      The per-token values ``[..., T]`` (0 where masked), float32 (float64 for float64 inputs).

    Raises:
      ValueError: an unknown estimator, ``unbiased_gradient=True`` with klest's ``grad`` (both
        choose the gradient), mismatched shapes, bad log-probs, ``"rb"`` without logits.

    Example:
      >>> log_probs = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.9, 0.0]], requires_grad=True)
      >>> log_probs_base = torch.tensor([[-1.2, -0.4, -1.5], [-0.5, -0.7, 0.0]])
      >>> kl = compute_approx_kl(log_probs, log_probs_base, kl_estimator="k3",
      ...                        grad="cumulative")
      >>> kl.shape
      torch.Size([2, 3])
      >>> kl.sum(-1).mean().backward()  # the sequence KL's gradient
    """
    check_choice("kl_estimator", kl_estimator, KLEstimatorName)
    check_choice("grad", grad, PeerGrad)
    check_flag("unbiased_gradient", unbiased_gradient)
    value_of = _VALUES[kl_estimator]
    options = KlestOptions(
        mask=action_mask,
        baseline=baseline,
        group=group,
        logp_behavior=log_probs_old,
        logits=logits,
        logits_ref=logits_ref,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        validate=validate,
    )
    if grad != "peer":
        if unbiased_gradient:
            raise ValueError(
                f"unbiased_gradient=True chooses OpenRLHF's per-token gradient and "
                f"grad={grad!r} chooses klest's: pass one (with klest's gradient, turn "
                "--algo.kl.unbiased_gradient off)"
            )
        return with_klest_gradient(
            value_of, log_probs, log_probs_base, grad=grad, options=options, names=_NAMES
        )
    dataclasses.replace(options, logp_behavior=None).refuse_for_peer()  # log_probs_old is used
    ratios = peer_log_ratios(
        log_probs,
        log_probs_base,
        logp_behavior=log_probs_old,
        mask=action_mask,
        validate=validate,
        names=_NAMES,
    )
    value = value_of(ratios.delta)
    if not unbiased_gradient:
        return value
    w: Tensor | float = 1.0
    if ratios.log_w is not None:
        w = torch.exp(ratios.log_w.detach()).clamp(max=_WEIGHT_CLIP)
    return join(value, w * (0.5 * ratios.delta * ratios.delta))


def install(
    *,
    grad: Literal["cumulative", "score"] = "cumulative",
    baseline: Baseline | BaselineEMA | None = None,
) -> Installed:
    r"""Make OpenRLHF's actor loss use klest's gradient for its KL loss; its flags are unchanged.

    .. math::
        E\Bigl[\nabla\sum_t S_t\Bigr] = \nabla KL(\pi\|ref) \text{ of each sequence}

    where :math:`S_t` are the per-token losses of :func:`compute_approx_kl` with ``grad``.
    OpenRLHF 0.11.2's actor (``openrlhf.trainer.ray.ppo_actor``) calls ``compute_approx_kl``
    directly (no registry or flag selects the function), so this rebinds that name in that
    module to ``compute_approx_kl(..., grad=grad, baseline=baseline)`` of this module: the same
    values, klest's gradient, with the rollout log-probs OpenRLHF passes as the sampling policy.
    The KL in the reward (``openrlhf.trainer.ppo_utils.experience_maker``) has no gradient and
    is left alone; this module's values are OpenRLHF's there anyway.

    It must run in each process that computes the loss: OpenRLHF's actors are Ray actors, so
    pass it as Ray's ``worker_process_setup_hook`` (``"klest.integrations.openrlhf.install"``,
    with the defaults) in the ``runtime_env`` of ``ray.init`` before OpenRLHF's entry point
    runs (it calls ``ray.init`` only when Ray is not initialised). Keep
    ``--algo.kl.unbiased_gradient`` off: it chooses OpenRLHF's gradient. OpenRLHF's
    log-probs are 0 under both models at padding, which klest's gradients see as tokens that
    contribute nothing, so no mask is needed; the baseline (if any) is taken over the
    micro-batch, where padding counts as tokens with log-ratio 0 (an empty row as a sample of
    KL 0): still unbiased, but not the gradient of a masked call with the same baseline.

    Samples: OpenRLHF's rollouts, responses y ~ pi_old.

    See Y. Tang and R. Munos, "On a few pitfalls in KL divergence gradient estimation for RL"
    (2025, https://arxiv.org/abs/2506.09477).

    Args:
      grad: ``"cumulative"`` (default) or ``"score"``; ``"rb"`` needs logits, which OpenRLHF's
        call does not pass.
      baseline: ``"loo"``, ``"mean"``, a :class:`klest.BaselineEMA`, or None.

    Returns:
      An :class:`Installed`; its ``uninstall()`` (or a ``with`` block) restores OpenRLHF's
      function.

    Raises:
      ImportError: OpenRLHF's actor module does not import in this process.
      RuntimeError: this OpenRLHF has no ``openrlhf.trainer.ray.ppo_actor.compute_approx_kl``.

    Example:
      >>> try:
      ...     with install(grad="cumulative"):
      ...         pass  # OpenRLHF's training here
      ... except ImportError:
      ...     pass  # OpenRLHF is not installed in this process
    """
    check_choice("grad", grad, ("cumulative", "score"))

    def compute_approx_kl_with_klest_gradient(
        log_probs: Tensor,
        log_probs_base: Tensor,
        log_probs_old: Tensor | None = None,
        kl_estimator: KLEstimatorName = "k1",
        unbiased_gradient: bool = False,
    ) -> Tensor:
        return compute_approx_kl(
            log_probs,
            log_probs_base,
            log_probs_old,
            kl_estimator,
            unbiased_gradient,
            grad=grad,
            baseline=baseline,
        )

    return replace_function(
        "openrlhf.trainer.ray.ppo_actor",
        "compute_approx_kl",
        compute_approx_kl_with_klest_gradient,
        peer="openrlhf",
    )
