r"""verl's KL functions, with verl's names and values, and a choice of gradient.

verl (https://github.com/volcengine/verl, https://verl.readthedocs.io) computes both its KL
loss (``actor_rollout_ref.actor.use_kl_loss``, estimator ``kl_loss_type``) and its KL reward
penalty (``algorithm.use_kl_in_reward``, estimator ``algorithm.kl_penalty``) per token with
``kl_penalty(logprob, ref_logprob, kl_penalty)``, and reduces every loss with
``agg_loss(loss_mat, loss_mask, loss_agg_mode)``. This module has both functions under those
names, signatures and option names (as of verl 0.9.1), and :func:`install`, which puts klest's
``kl_penalty`` into verl's actor loss.

Samples: responses y from the rollout policy (pi itself at a batch's first update, an older pi
after that). With :math:`\delta_t = \log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t})`
(``logprob - ref_logprob``) and the score :math:`s_t = \nabla\log\pi(y_t|y_{<t})`, each
option's value, what it estimates, and the mean of verl's gradient (autodiff of the value):

- ``"kl"``, ``"k1"``: :math:`\delta_t`, unbiased for KL(pi_t||ref_t); gradient mean
  :math:`E[s_t] = 0`: no signal.
- ``"abs"``: :math:`|\delta_t|`, biased upward; gradient :math:`\mathrm{sign}(\delta_t) s_t`,
  the gradient of no KL.
- ``"mse"``, ``"k2"``: :math:`\delta_t^2/2`, biased (second order); gradient mean
  :math:`\sum_t E_{y_{<t}}[\nabla KL(\pi_t\|ref_t)]` with the prefixes held fixed: biased for
  sequences (it misses each token's effect on the later ones).
- ``"low_var_kl"``, ``"k3"``: :math:`\min(e^x - 1 - x, 10)` with
  :math:`x = \mathrm{clip}(-\delta_t, -20, 20)`, unbiased for KL(pi_t||ref_t) where the clips
  are inactive; gradient mean :math:`\sum_t E_{y_{<t}}[\nabla KL(ref_t\|\pi_t)]`: the *other*
  KL, token by token.
- ``"full"``: :math:`KL(\pi_t\|ref_t)` exactly, from the full-vocabulary logits; gradient: each
  position's own KL gradient, the prefixes held fixed (k2's mean, with less noise).
- an option with a ``"+"`` suffix: the option's value, k2's gradient (straight-through): biased
  for sequences.

Summed over a sequence, the unbiased per-token values estimate the sequence-level KL(pi||ref).
None of verl's gradients is the gradient of that KL for sequences longer than one token. The
keyword-only ``grad=`` replaces verl's gradient by one of klest's (:func:`klest.kl_penalty`,
per-token losses with ``reduction="none"``) and keeps verl's value: ``"cumulative"``,
``"score"`` or ``"rb"``, each unbiased for :math:`\nabla KL(\pi\|ref)` of the sequences. verl
then reduces the per-token losses with ``loss_agg_mode``: ``"seq-mean-token-sum"`` gives exactly
the gradient of the mean sequence KL, ``"seq-mean-token-sum-norm"`` the same divided by a
constant, ``"token-mean"`` (verl's default) the same times the batch's sequences over its tokens.

References: J. Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html): k1, k2, k3. Y. Tang and R. Munos, "On a few pitfalls in
KL divergence gradient estimation for RL" (2025, https://arxiv.org/abs/2506.09477): the biases
of these gradients, cumulative and leave-one-out estimators. A. Amini, T. Vieira and R.
Cotterell, "Better Estimation of the Kullback-Leibler Divergence Between Language Models"
(NeurIPS 2025, https://arxiv.org/abs/2504.10637): ``"full"`` and ``grad="rb"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, cast

import torch
from torch import Tensor

from klest._checks import (
    ArgumentNames,
    ValueChecks,
    check_choice,
    check_float_tensor,
    check_mask,
    check_positive_int,
    resolve_validate,
)
from klest._numerics import exp_tail
from klest._types import Baseline, Reduction
from klest.aggregation import GlobalCounts, aggregate
from klest.integrations._patch import Installed, replace_function
from klest.integrations._peer_gradient import (
    KlestOptions,
    PeerGrad,
    peer_log_ratios,
    with_klest_gradient,
)
from klest.logits import kl_from_logits
from klest.sampled.baselines import BaselineEMA
from klest.surrogates import join

__all__ = ["Installed", "KLPenaltyName", "LossAggMode", "agg_loss", "install", "kl_penalty"]

KLPenaltyName = Literal[
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "full",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
]
"""verl's names of its per-token KL estimators (``kl_loss_type``, ``algorithm.kl_penalty``);
a ``"+"`` suffix keeps the value and takes k2's gradient (straight-through)."""

LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
"""verl's ``loss_agg_mode`` values."""

# verl's clips of k3: the log-ratio before the exponential, and the value.
_K3_LOG_RATIO_CLIP = 20.0
_K3_VALUE_CLIP = 10.0


def _k1(delta: Tensor) -> Tensor:
    return delta


def _abs(delta: Tensor) -> Tensor:
    return delta.abs()


def _k2(delta: Tensor) -> Tensor:
    return 0.5 * delta * delta


def _k3(delta: Tensor) -> Tensor:
    """verl's k3 with its clips, computed without cancellation near r = 1."""
    x = (-delta).clamp(-_K3_LOG_RATIO_CLIP, _K3_LOG_RATIO_CLIP)
    return exp_tail(x).clamp(-_K3_VALUE_CLIP, _K3_VALUE_CLIP)


_NAMES = ArgumentNames("logprob", "ref_logprob", "logp_behavior", "mask", density_option=False)
"""The drop-in's names of the log-probs and mask, for the messages."""

_VALUES: dict[str, Callable[[Tensor], Tensor]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}


def kl_penalty(
    logprob: Tensor,
    ref_logprob: Tensor,
    kl_penalty: KLPenaltyName,
    *,
    grad: PeerGrad = "peer",
    mask: Tensor | None = None,
    labels: Tensor | None = None,
    baseline: Baseline | BaselineEMA | None = None,
    group: Tensor | None = None,
    logp_behavior: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""verl's per-token KL estimate (same name, arguments and value), with a choice of gradient.

    .. math::
        \text{k1} = \delta_t, \quad \text{k2} = \delta_t^2/2, \quad
        \text{k3} = \min\bigl(e^{x} - 1 - x,\ 10\bigr),\ x = \mathrm{clip}(-\delta_t, -20, 20),
        \quad \text{full} = KL(\pi_t\|ref_t)

    with :math:`\delta_t = \log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t})`; each estimates the
    per-token KL(pi_t||ref_t) (k1, k3 and full unbiased; k3 where its clips are inactive; k2 and
    abs biased), and their sums over a sequence the sequence-level KL(pi||ref). The table of
    :mod:`klest.integrations.verl` says what verl's gradient of each has for mean.

    Samples: the tokens y ~ pi (or ~ behavior, with ``logp_behavior`` for klest's gradients).

    ``grad="peer"`` is verl's gradient: autodiff of the value, or of k2 for the ``"+"``
    options. ``"cumulative"``, ``"score"`` and ``"rb"`` keep the value and take the gradient of
    ``klest.kl_penalty(logprob, ref_logprob, grad=grad, reduction="none")``: per-token losses
    that sum, per sequence, to an unbiased estimator of :math:`\nabla KL(\pi\|ref)` of that
    sequence, for verl's ``agg_loss`` (``"seq-mean-token-sum"``: the mean sequence KL's
    gradient).

    ``"full"``: ``logprob`` and ``ref_logprob`` are pi's and ref's full-vocabulary logits (or
    log-probs) ``[..., T, V]``, and the result is :func:`klest.kl_from_logits` per position
    ``[..., T]`` (verl 0.9.1 names this option but raises ``NotImplementedError``). Its
    ``"peer"`` gradient is each position's own; klest's gradients need the sampled token ids
    ``labels`` ``[..., T]``.

    Values equal verl's up to rounding: k3 is computed without cancellation (verl's
    ``exp(x) - x - 1`` in float32 is off by up to ~1e-7 near 0, and can be slightly negative);
    bf16 / fp16 inputs are computed in float32 (verl computes in the input dtype) and the result
    is float32. Differences from verl on bad input: unknown names raise ``ValueError`` (verl:
    ``NotImplementedError``), and NaN, +inf or positive log-probs raise ``ValueError``.

    See J. Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html)
    and Y. Tang and R. Munos, "On a few pitfalls in KL divergence gradient estimation for RL"
    (2025, https://arxiv.org/abs/2506.09477).

    Args:
      logprob: log pi of the sampled tokens ``[..., T]``, with the trainable graph (``"full"``:
        pi's logits ``[..., T, V]``).
      ref_logprob: log ref of the same tokens (``"full"``: ref's logits).
      kl_penalty: verl's estimator name (:data:`KLPenaltyName`).
      grad: ``"peer"`` (verl's gradient), ``"cumulative"``, ``"score"`` or ``"rb"``.
      mask: bool ``[..., T]`` (verl's ``response_mask``): the result is 0 with no gradient
        where False. verl passes none; its padding holds log-probs 0 under both models, which
        gives 0 there as well.
      labels: the sampled token ids ``[..., T]``, for ``"full"`` with klest's gradients.
      baseline: for klest's gradients: ``"loo"``, ``"mean"`` or a :class:`klest.BaselineEMA`.
      group: integer prompt ids ``[...]`` for the baseline (default: the whole batch).
      logp_behavior: log-probs of the tokens under the policy that sampled them, when it is not
        pi (klest's gradients then use importance weights).
      logits: for ``grad="rb"`` (not ``"full"``): pi's logits along the samples
        ``[..., T, V]``, with graph.
      logits_ref: ref's logits, same shape.
      cu_seqlens: packed sequences (:mod:`klest.layout`) for klest's gradients: the
        log-probs are ``[total]``, the sequences' tokens one after another.
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known.
      validate: run the value checks (None: the global default).

    Returns:
      The per-token values ``[..., T]`` (0 where masked), float32 (float64 for float64 inputs).

    Raises:
      ValueError: an unknown name, a ``"+"`` option with klest's ``grad`` (the ``"+"`` already
        chooses the gradient), ``"full+"``, mismatched shapes, bad log-probs, or what a
        gradient needs missing (``labels`` for ``"full"``, ``logits`` for ``"rb"``).

    Example:
      >>> logprob = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.9, 0.0]], requires_grad=True)
      >>> ref_logprob = torch.tensor([[-1.2, -0.4, -1.5], [-0.5, -0.7, 0.0]])
      >>> mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
      >>> kld = kl_penalty(logprob, ref_logprob, "low_var_kl", grad="cumulative", mask=mask)
      >>> kld.shape
      torch.Size([2, 3])
      >>> agg_loss(kld, mask, "seq-mean-token-sum").backward()  # the sequence KL's gradient
    """
    check_choice("kl_penalty", kl_penalty, KLPenaltyName)
    check_choice("grad", grad, PeerGrad)
    base = kl_penalty.removesuffix("+")
    straight_through = kl_penalty.endswith("+")
    options = KlestOptions(
        mask=mask,
        baseline=baseline,
        group=group,
        logp_behavior=logp_behavior,
        logits=logits,
        logits_ref=logits_ref,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        validate=validate,
    )
    if base == "full":
        if straight_through:
            raise ValueError(
                "kl_penalty='full+' is not an option: k2's straight-through gradient needs "
                "sampled-token log-probs, not logits; use 'full' with grad='rb'"
            )
        if logits is not None or logits_ref is not None:
            raise ValueError(
                "kl_penalty='full' takes the logits as logprob and ref_logprob; do not pass "
                "logits / logits_ref as well"
            )
        return _full(logprob, ref_logprob, grad=grad, labels=labels, options=options)
    if labels is not None:
        raise ValueError(f"labels applies to kl_penalty='full' only, not {kl_penalty!r}")
    value_of = _VALUES[base]
    if grad != "peer":
        if straight_through:
            raise ValueError(
                f"kl_penalty={kl_penalty!r} chooses k2's gradient (the '+' suffix) and "
                f"grad={grad!r} chooses klest's: pass {base!r} with grad={grad!r}, or "
                f"{kl_penalty!r} with grad='peer'"
            )
        return with_klest_gradient(
            value_of, logprob, ref_logprob, grad=grad, options=options, names=_NAMES
        )
    options.refuse_for_peer()
    delta = peer_log_ratios(logprob, ref_logprob, mask=mask, validate=validate, names=_NAMES).delta
    if straight_through:
        return join(value_of(delta), _k2(delta))
    return value_of(delta)


def _full(
    logits: Tensor, logits_ref: Tensor, *, grad: str, labels: Tensor | None, options: KlestOptions
) -> Tensor:
    """``"full"``: the exact per-position KL(pi_t||ref_t) from logits ``[..., T, V]``."""
    if grad == "peer":
        options.refuse_for_peer(labels=labels)
        kl = kl_from_logits(
            logits, logits_ref, mask=options.mask, reduction="none", validate=options.validate
        )
        assert isinstance(kl, Tensor)
        return kl
    if labels is None:
        raise ValueError(
            f"kl_penalty='full' with grad={grad!r} needs labels: the sampled token ids "
            f"{tuple(logits.shape[:-1])} (klest's gradients are those of the sampled sequences)"
        )
    _, details = kl_from_logits(
        logits, logits_ref, mask=options.mask, labels=labels, reduction="none", return_details=True
    )
    keep = labels != -100  # kl_from_logits' ignore_index
    keep = keep if options.mask is None else keep & options.mask.bool()
    with_logits = dataclasses.replace(options, mask=keep, logits=logits, logits_ref=logits_ref)
    penalty = with_logits.per_token(
        details.logp, details.logp_ref, grad=grad, names=_NAMES, estimator="rb"
    )
    if options.logp_behavior is None:
        return penalty  # rb's on-policy value is the exact per-position KL itself
    with torch.no_grad():  # off-policy rb weights its value; verl's value is unweighted
        kl = kl_from_logits(logits, logits_ref, mask=keep, reduction="none", validate=False)
    assert isinstance(kl, Tensor)
    return join(kl.to(penalty.dtype), penalty)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: LossAggMode,
    dp_size: int = 1,
    batch_num_tokens: int | float | Tensor | None = None,
    global_batch_size: int | float | Tensor | None = None,
    loss_scale_factor: int | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""verl's loss aggregation (same name, arguments and values), by klest's reduction rule.

    .. math::
        \text{token-mean} = \frac{\sum_{b,t} m_{bt} l_{bt}}{\sum_{b,t} m_{bt}}, \quad
        \text{seq-mean-token-sum} = \frac{1}{|\{b: n_b > 0\}|}\sum_b \sum_t m_{bt} l_{bt},
        \quad \text{-norm} = \frac{\text{seq-mean-token-sum}}{\text{loss\_scale\_factor}}

    with :math:`m` the mask and :math:`n_b` the valid tokens of row :math:`b`. Modes and klest's
    reductions (:func:`klest.aggregate`):

    - ``"token-mean"``, ``"seq-mean-token-sum"``, ``"seq-mean-token-mean"``: klest's reductions
      of the same names (verl divides each row by ``n_b + 1e-8`` in ``"seq-mean-token-mean"``,
      klest by ``n_b``: the same in float32, 1e-8 relative in float64);
    - ``"token-sum"``: klest's ``"sum"``;
    - ``"seq-mean-token-sum-norm"``: not a klest reduction: ``"seq-mean-token-sum"`` divided by
      ``loss_scale_factor`` (default ``T = loss_mask.shape[-1]``), as verl does.

    With the global counts of data parallelism (``batch_num_tokens`` for ``"token-mean"``,
    ``global_batch_size`` for the ``"seq-mean-*"`` modes) the local sum is divided by the count
    and multiplied by ``dp_size``, as in verl. Rows with no valid token count for nothing. A
    batch with no valid token gives 0 with a zero gradient (verl: 0 / 0 = NaN); a count below 1
    is taken as 1 for the same reason.

    With klest's per-token losses (:func:`kl_penalty` with ``grad="cumulative"``, ...) the
    ``"seq-mean-token-sum"`` mode gives the gradient of the mean sequence-level KL(pi||ref).
    Samples: the rows of ``loss_mat`` (responses y ~ pi).

    Args:
      loss_mat: per-token losses ``[B, T]``.
      loss_mask: bool or 0/1 ``[B, T]``: the tokens that count. Rows may be empty.
      loss_agg_mode: one of :data:`LossAggMode`.
      dp_size: data-parallel world size; above 1 the global count must be given.
      batch_num_tokens: valid tokens in the global batch (``"token-mean"``).
      global_batch_size: non-empty sequences in the global batch (``"seq-mean-*"``).
      loss_scale_factor: the divisor of ``"seq-mean-token-sum-norm"`` (default ``T``; needed
        with ``cu_seqlens``).
      cu_seqlens: packed sequences (:mod:`klest.layout`): ``loss_mat`` and ``loss_mask`` are
        ``[total]``, the sequences' tokens one after another.
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known.
      validate: check the mask holds only 0/1 (None: the global default).

    Returns:
      The scalar loss, in ``loss_mat``'s dtype.

    Raises:
      ValueError: an unknown mode, a mask of another shape or not 0/1, ``dp_size > 1``
        without the global count, a non-positive ``dp_size`` or ``loss_scale_factor``.

    Example:
      >>> loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
      >>> loss_mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
      >>> agg_loss(loss_mat, loss_mask, "seq-mean-token-sum")  # (6 + 4) / 2
      tensor(5.)
      >>> agg_loss(loss_mat, loss_mask, "seq-mean-token-sum-norm")  # 5 / T
      tensor(1.6667)
    """
    check_choice("loss_agg_mode", loss_agg_mode, LossAggMode)
    dp = check_positive_int("dp_size", dp_size, allow_none=False)
    scale = check_positive_int("loss_scale_factor", loss_scale_factor)
    # The mask is checked here, by its verl name (aggregate would call it "mask").
    check_float_tensor("loss_mat", loss_mat, what="per-token losses")
    checks = ValueChecks(resolve_validate(validate))
    loss_mask = check_mask(
        loss_mask, loss_mat.shape, loss_mat.device, checks, of="the losses", name="loss_mask"
    )
    checks.run()
    if loss_agg_mode == "token-sum":
        return aggregate(loss_mat, mask=loss_mask, reduction="sum", validate=validate) * dp
    token_level = loss_agg_mode == "token-mean"
    count = batch_num_tokens if token_level else global_batch_size
    if count is None and dp > 1 and loss_agg_mode != "token-sum":
        needed = "batch_num_tokens" if token_level else "global_batch_size"
        raise ValueError(
            f"loss_agg_mode={loss_agg_mode!r} with dp_size={dp} needs {needed}, the global count "
            "(each rank's local mean would be averaged again across ranks)"
        )
    if loss_agg_mode.endswith("-norm") and cu_seqlens is not None and scale is None:
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' with cu_seqlens needs "
            "loss_scale_factor (verl's maximum response length)"
        )
    reduction = {"token-sum": "sum", "seq-mean-token-sum-norm": "seq-mean-token-sum"}.get(
        loss_agg_mode, loss_agg_mode
    )
    counts = None
    if count is not None or loss_agg_mode == "token-sum":
        counts = GlobalCounts(1 if count is None else count, 1 if count is None else count, dp)
    loss = aggregate(
        loss_mat,
        mask=loss_mask,
        reduction=cast(Reduction, reduction),
        counts=counts,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        validate=validate,
    )
    if loss_agg_mode.endswith("-norm"):
        loss = loss / (loss_mask.shape[-1] if scale is None else scale)
    return loss


def install(
    *,
    grad: Literal["cumulative", "score"] = "cumulative",
    baseline: Baseline | BaselineEMA | None = None,
) -> Installed:
    r"""Make verl's actor loss use klest's gradient for its KL loss; verl's config is unchanged.

    .. math::
        \nabla\,\text{kl\_loss} = \nabla\,\mathrm{agg}_t\bigl(S_t\bigr), \qquad
        E\Bigl[\nabla\sum_t S_t\Bigr] = \nabla KL(\pi\|ref) \text{ of each sequence}

    where :math:`S_t` are the per-token losses of :func:`kl_penalty` with ``grad``. verl 0.9.1's
    actor loss (``verl.workers.utils.losses.ppo_loss``) calls ``kl_penalty(logprob=...,
    ref_logprob=..., kl_penalty=kl_loss_type)`` directly: no registry or config key selects the
    function, and its policy-loss registry (``register_policy_loss``) does not receive the
    reference log-probs. So this rebinds the name ``kl_penalty`` in that module to
    ``kl_penalty(..., grad=grad, baseline=baseline)`` of this module: the same values, klest's
    gradient. Nothing else in verl changes; the KL in the reward (``use_kl_in_reward``) has no
    gradient, and this module's values are verl's there anyway.

    It must run in each process that computes the loss: verl's workers are Ray actors, so
    pass it as Ray's ``worker_process_setup_hook``, e.g. the verl override
    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=klest.integrations.verl.install``
    (with the defaults; a hook of your own can pass options). verl's padding holds log-probs 0
    under both models, which klest's gradients see as tokens that contribute nothing, so no mask
    is needed; the baseline (if any) is taken over the micro-batch, where padding counts as
    tokens with log-ratio 0 (an empty row as a sample of KL 0): still unbiased, but not the
    gradient of a masked call with the same baseline. For the gradient of the
    sequence KL itself set ``actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum``.

    Samples: verl's rollouts, responses y ~ pi.

    See Y. Tang and R. Munos, "On a few pitfalls in KL divergence gradient estimation for RL"
    (2025, https://arxiv.org/abs/2506.09477).

    Args:
      grad: ``"cumulative"`` (default) or ``"score"``; ``"rb"`` needs logits, which verl's
        call does not pass.
      baseline: ``"loo"``, ``"mean"``, a :class:`klest.BaselineEMA`, or None.

    Returns:
      An :class:`Installed`; its ``uninstall()`` (or a ``with`` block) restores verl's function.

    Raises:
      ImportError: verl does not import in this process.
      RuntimeError: this verl has no ``verl.workers.utils.losses.kl_penalty``.

    Example:
      >>> try:
      ...     with install(grad="cumulative"):
      ...         pass  # verl's training here
      ... except ImportError:
      ...     pass  # verl is not installed in this process
    """
    check_choice("grad", grad, ("cumulative", "score"))

    def kl_penalty_with_klest_gradient(
        logprob: Tensor, ref_logprob: Tensor, kl_penalty: KLPenaltyName
    ) -> Tensor:
        return _drop_in(logprob, ref_logprob, kl_penalty, grad=grad, baseline=baseline)

    return replace_function(
        "verl.workers.utils.losses", "kl_penalty", kl_penalty_with_klest_gradient, peer="verl"
    )


_drop_in = kl_penalty
