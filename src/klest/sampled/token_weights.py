r"""Per-token weights of the KL(pi||ref) objective, computed from the batch, for
:func:`klest.kl_penalty`'s ``weights=``.

IW-OPD ("On the Position Bias of On-Policy Distillation", Xie, Zhu, Wen, Chen and Wang, 2026,
https://arxiv.org/abs/2606.22600) weights each sampled token's log-ratio by how much of its
sequence's total absolute log-ratio comes after it: the first token gets :math:`1 + g`, the
last about 1. TRL ships it as ``trl.experimental.iw_opd.IWOPDTrainer``
(``distillation_objective="iw_opd"``, ``iw_opd_gamma=0.5``, ``iw_opd_epsilon=1e-8``).
The weights read the whole sequence's log-ratios, later tokens included, so no gradient
estimator's mean with them is the gradient of a divergence (:func:`klest.kl_penalty`,
``weights=``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_float_tensor,
    check_mask,
    check_same_shape,
    first_bad,
    resolve_validate,
)

__all__ = ["iw_opd_weights"]


def iw_opd_weights(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    mask: Tensor | None = None,
    gain: float = 0.5,
    epsilon: float = 1e-8,
    validate: bool | None = None,
) -> Tensor:
    r"""IW-OPD's per-token weights of the log-ratios, detached:

    .. math::
        w_t = 1 + g\left(1 - \frac{\sum_{u<t} |\rho_u|}{\max(\sum_u |\rho_u|, \epsilon)}\right),
        \qquad \rho_t = \log\pi(y_t\mid y_{<t}) - \log ref(y_t\mid y_{<t}),

    the sums over each sequence's valid tokens: :math:`1 + g` at the first token, down to
    :math:`1 + g\,|\rho_T| / \sum_u|\rho_u|` at the last. Pass them to
    :func:`klest.kl_penalty` as ``weights=`` (``grad="token"``, ``estimator="k1"`` and
    ``reduction="token-mean"`` give the loss of TRL's ``IWOPDTrainer``, in value its logged
    ``-iw_opd/mean_advantage``).

    Samples: on-policy sequences y ~ pi (the student's rollouts); the weights read every token
    of their sequence, so the mean gradient of a loss they weight is the gradient of no
    divergence.

    See "On the Position Bias of On-Policy Distillation" by Yan Xie, Sijie Zhu, Tiansheng Wen,
    Bo Chen and Yifei Wang (2026, https://arxiv.org/abs/2606.22600), and TRL's
    ``trl/experimental/iw_opd/iw_opd_trainer.py`` (``IWOPDTrainer._compute_iw_opd_loss``).

    Args:
      logp: log pi of the sampled tokens ``[..., T]`` (the rollout policy's, when the trainer
        has them: TRL uses the sampler's log-probs).
      logp_ref: log ref (the teacher) of the same tokens, same shape.
      mask: bool ``[..., T]``: valid tokens (None: all). Invalid tokens count in no sum and get
        weight 0.
      gain: :math:`g \ge 0`, TRL's ``iw_opd_gamma`` (0.5 by default there and here).
      epsilon: :math:`\epsilon > 0`, the floor of the total (TRL's ``iw_opd_epsilon``).
      validate: check the values (NaN, infinite log-probs, a non-0/1 mask) once for the call
        (None: the global default).

    Returns:
      The weights ``[..., T]``, detached, in the promoted dtype of the log-probs.

    Raises:
      TypeError: non-tensor or non-float log-probs.
      ValueError: shapes that differ, a negative gain, a non-positive epsilon, non-finite
        log-probs at valid tokens.

    Example:
      >>> logp = torch.tensor([[-1.0, -0.5, -2.0]])
      >>> logp_ref = torch.tensor([[-1.5, -0.5, -1.0]])
      >>> iw_opd_weights(logp, logp_ref, gain=0.5)  # |rho| = 0.5, 0, 1
      tensor([[1.5000, 1.3333, 1.3333]])
    """
    logp = check_float_tensor("logp", logp)
    logp_ref = check_float_tensor("logp_ref", logp_ref)
    check_same_shape(logp=logp, logp_ref=logp_ref)
    if logp.ndim == 0:
        raise ValueError("logp must have a token dimension [..., T], got a 0-dim tensor")
    for name, value in (("gain", gain), ("epsilon", epsilon)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(gain) and gain >= 0.0):
        raise ValueError(f"gain must be a finite float >= 0, got {gain!r}")
    if not (math.isfinite(epsilon) and epsilon > 0.0):
        raise ValueError(f"epsilon must be a finite float > 0, got {epsilon!r}")
    checks = ValueChecks(resolve_validate(validate))
    valid = None
    if mask is not None:
        valid = check_mask(mask, logp.shape, logp.device, checks, of="logp and logp_ref")
    dtype = torch.promote_types(logp.dtype, logp_ref.dtype)
    rho = logp.detach().to(dtype) - logp_ref.detach().to(dtype)
    bad = ~torch.isfinite(rho)
    checks.add(
        bad if valid is None else bad & valid,
        lambda flags: f"logp - logp_ref is NaN or infinite at {first_bad(flags)}",
    )
    checks.run()
    a = rho.abs() if valid is None else torch.where(valid, rho, 0.0).abs()
    before = a.cumsum(-1) - a
    total = a.sum(-1, keepdim=True).clamp_min(epsilon)
    weights = 1.0 + gain * (1.0 - before / total)
    return weights if valid is None else torch.where(valid, weights, 0.0)
