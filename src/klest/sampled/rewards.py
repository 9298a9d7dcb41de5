r"""The KL as a per-token reward: PPO / RLOO reward shaping, on-policy distillation as an advantage.

A KL term can enter training two ways: in the loss (:func:`klest.kl_penalty`, which chooses its
gradient), or in the reward, as PPO does: ``rewards = task_rewards - beta * kl``, then a
policy-gradient method. In the reward, the KL reaches pi's parameters only through the score
function: for sequences :math:`y \sim \pi` with scores :math:`s_t = \nabla\log\pi(y_t|y_{<t})` and
per-token rewards :math:`-\beta v_t`, the REINFORCE gradient with rewards-to-go is

.. math::
    \hat g = -\beta \sum_t s_t \sum_{u \ge t} v_u .

Which per-token value :math:`v_t` belongs there (samples from pi, on-policy):

- **k1**, :math:`v_t = \rho_t = \log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t})`: unbiased,
  :math:`E[\hat g] = -\beta\,\nabla KL(\pi\|ref)` for the sequence KL. The KL's gradient is
  :math:`E[\sum_t s_t \sum_{u\ge t}\rho_u] + E[\sum_t \nabla\rho_t]`, and the second term is
  :math:`E[\sum_t s_t] = 0`: the reward carries all of it (a token cannot change the
  log-ratios before it, hence rewards-to-go).
- **k3**, :math:`v_t = (r_t - 1) - \log r_t` with :math:`r_t = ref/\pi` at token t: its value
  is an unbiased estimate of KL(pi||ref), but its score gradient is not that KL's. It adds
  :math:`r_u - 1` to k1; for :math:`u > t`, :math:`E[s_t (r_u - 1)] = 0` (given the prefix,
  :math:`E_{\pi}[r_u] = 1`), and for :math:`u = t`,
  :math:`E[s_t (r_t - 1)] = E_{y_{<t}\sim\pi}\big[\sum_y ref_t(y)\,\nabla\log\pi_t(y)\big]
  = -E_{y_{<t}\sim\pi}[\nabla KL(ref_t\|\pi_t)]`. So

  .. math::
      E[\hat g_{k3}] = -\beta\Big(\nabla KL(\pi\|ref)
          - \sum_t E_{y_{<t}\sim\pi}\big[\nabla KL(ref_t\|\pi_t)\big]\Big),

  with the second gradient taken with the prefixes held fixed (for one-token samples it is
  :math:`\nabla KL(ref\|\pi)`). The policy is pulled toward ref in KL(pi||ref) and pushed away
  in KL(ref||pi): near ref the two gradients agree to first order, so the pull of a k3 reward
  is of second order in pi - ref, where k1's is of first order (on a tabular policy, V = 3,
  T = 3, its mean gradient's norm is 4.8% of k1's at KL(pi||ref) = 0.0014, 40% at 0.096).
  ``estimator="k3"`` is allowed (its value is a fine non-negative KL estimate to log) but warns
  with a :class:`~klest.KLGradientWarning`; so do ``"k2"`` and ``"abs"``, whose values are
  biased too.
- **KL(ref||pi)** cannot be a reward of pi's samples: a reward's gradient is its score term
  only, while :math:`\nabla KL(ref\|\pi) = -E_\pi[\sum_t s_t R_{\le t}]` (prefix ratios
  :math:`R_{\le t} = \prod_{u\le t} ref/\pi`) comes from differentiating the ratios themselves;
  per-token KL(ref||pi) values as rewards give neither. ``direction="ref||pi"`` is refused: put
  that KL in the loss with ``klest.kl_penalty(..., direction="ref||pi", grad="cumulative")``.
- **rb** (exact per-position KLs from logits) is refused too: :math:`KL_n` depends on the prefix
  only, so as a reward it misses the :math:`\sum_n \nabla KL_n` part of the gradient that
  ``kl_penalty(estimator="rb", grad="rb")`` has.

A discount :math:`\gamma < 1` (PPO's ``gamma``) weights later tokens by :math:`\gamma^{u-t}`:
lower variance, but the result is no longer the gradient of the sequence KL (``discount=1``
is).

See "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi
Munos (2025, https://arxiv.org/abs/2506.09477) and "Approximating KL Divergence" by John
Schulman (2020, http://joschu.net/blog/kl-approx.html).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klest._checks import (
    ArgumentNames,
    ValueChecks,
    check_choice,
    check_direction,
    check_flag,
    check_tensor,
    resolve_validate,
    warn_at_caller,
)
from klest._types import Direction, Estimator
from klest.sampled.context_parallel import ContextParallel, local_columns, whole_sequences
from klest.sampled.log_ratios import prepare_log_ratios
from klest.sampled.penalty import KLGradientWarning
from klest.sampled.sequence import discounted_sum_from_here, sum_from_here
from klest.sampled.terms import per_token_values

__all__ = ["kl_reward"]


def _check_discount(discount: object) -> float:
    if isinstance(discount, bool) or not isinstance(discount, int | float):
        raise TypeError(f"discount must be a float in (0, 1], got {type(discount).__name__}")
    if not (math.isfinite(discount) and 0.0 < discount <= 1.0):
        raise ValueError(f"discount must be in (0, 1], got {discount!r}")
    return float(discount)


def kl_reward(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    mask: Tensor | None = None,
    estimator: Estimator = "k1",
    direction: Direction = "pi||ref",
    discount: float = 1.0,
    reward_to_go: bool = False,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    context_parallel: ContextParallel | None = None,
    validate: bool | None = None,
) -> Tensor:
    r"""Per-token KL values to subtract from a reward (``rewards - beta * kl_reward(...)``),
    without gradient; 0 at padding.

    .. math::
        v_t = \log\pi(y_t|y_{<t}) - \log ref(y_t|y_{<t}) \ (\text{k1}), \qquad
        \text{with } \texttt{reward\_to\_go}:\ G_t = \sum_{u \ge t} \gamma^{u-t}\, v_u

    Samples: sequences :math:`y \sim \pi` (on-policy: the log-probs of pi's own completions).
    With k1 and ``discount=1``, :math:`E[-\beta \sum_t s_t G_t] = -\beta\,\nabla KL(\pi\|ref)`,
    the gradient of the sequence KL (see :mod:`klest.sampled.rewards`). Other estimators
    warn (k3's score gradient is :math:`\nabla KL(\pi\|ref)` minus the per-position
    :math:`\nabla KL(ref_t\|\pi_t)`); ``direction="ref||pi"`` and ``"rb"`` / ``"cv"`` are refused.

    The per-token values are :func:`klest.kl_estimate`'s (``reduction="none"``), so a reward's
    token sum is the sequence's KL estimate.

    See "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi
    Munos (2025, https://arxiv.org/abs/2506.09477).

    Args:
      logp: log pi of the sampled tokens ``[..., T]`` (or ``[N]`` one-token samples); any
        float dtype; detached here.
      logp_ref: log ref of the same tokens, same shape.
      mask: bool or 0/1 ``[..., T]``: True at tokens that count; padding (left, right or
        inside) gets 0 and adds nothing to the sums.
      estimator: ``"k1"`` (default: the one whose reward gradient is the KL's), or ``"k3"``,
        ``"k2"``, ``"abs"`` (allowed with a :class:`~klest.KLGradientWarning`).
      direction: ``"pi||ref"`` only (``"ref||pi"`` is refused: see the module docstring).
      discount: :math:`\gamma \in (0, 1]` of the reward-to-go (per token column); needs
        ``reward_to_go=True``.
      reward_to_go: return :math:`G_t = \sum_{u\ge t}\gamma^{u-t} v_u` (the return from token t
        on) instead of :math:`v_t`; needs sequences ``[..., T]``.
      cu_seqlens: packed sequences: offsets ``[S + 1]`` of the sequences whose tokens
        ``logp`` (``[total]`` or ``[1, total]``) holds one after another (:mod:`klest.layout`);
        the reward-to-go stops at each sequence's end.
      max_seqlen: with ``cu_seqlens``, the longest sequence's length, if known (no host read).
      context_parallel: each rank of a context-parallel group holds part of every sequence
        (:class:`~klest.ContextParallel`): the rewards-to-go sum over the whole sequences.
      validate: run the value checks of :func:`klest.kl_estimate` (None: the global default).

    Returns:
      ``[..., T]`` (the input's shape), no graph, 0 at masked positions; float32 for
      bf16/fp16/fp32 inputs, float64 for float64.

    Raises:
      ValueError: ``direction="ref||pi"``, ``estimator`` ``"rb"`` or ``"cv"``, a discount outside
        (0, 1] or without ``reward_to_go``, ``reward_to_go`` on 1-D input, and bad log-probs or
        masks (as :func:`klest.kl_estimate`).
      TypeError: non-tensor or non-float inputs, a non-bool ``reward_to_go``.

    Example:
      >>> logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.9, -0.1]])
      >>> logp_ref = torch.tensor([[-1.2, -0.4, -1.5], [-0.5, -0.7, -0.2]])
      >>> mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
      >>> kl_reward(logp, logp_ref, mask=mask)  # log pi - log ref per token, 0 at padding
      tensor([[ 0.2000, -0.1000, -0.5000],
              [ 0.2000, -0.2000,  0.0000]])
      >>> kl_reward(logp, logp_ref, mask=mask, reward_to_go=True)  # the KL from token t on
      tensor([[-0.4000, -0.6000, -0.5000],
              [ 0.0000, -0.2000,  0.0000]])
    """
    check_direction(direction)
    check_choice("estimator", estimator, Estimator)
    if direction == "ref||pi":
        raise ValueError(
            "kl_reward(direction='ref||pi') is refused: a reward of samples from pi enters the "
            "gradient only through the score function, and no per-token reward gives the "
            "gradient of KL(ref||pi), -E_pi[sum_t s_t R_<=t] with the prefix ratios "
            "R_<=t = prod ref/pi; put it in the loss: klest.kl_penalty(logp, logp_ref, "
            "direction='ref||pi', grad='cumulative')"
        )
    if estimator in ("rb", "cv"):
        raise ValueError(
            f"kl_reward(estimator={estimator!r}) is refused: "
            + (
                "the exact per-position KLs depend on the prefix only, so as rewards they miss "
                "the sum_n grad KL_n part of the gradient; use klest.kl_penalty(..., "
                "estimator='rb', grad='rb', logits=..., logits_ref=...)"
                if estimator == "rb"
                else "the control variate needs a coefficient (kl_estimate's alpha); use "
                "estimator='k1', the reward whose score gradient is grad KL(pi||ref)"
            )
        )
    check_flag("reward_to_go", reward_to_go)
    gamma = _check_discount(discount)
    if gamma != 1.0 and not reward_to_go:
        raise ValueError(
            f"discount={discount} applies to the reward-to-go: pass reward_to_go=True (or "
            "leave discounting to the trainer's returns)"
        )
    if reward_to_go and cu_seqlens is None and check_tensor("logp", logp).ndim < 2:
        raise ValueError(
            f"reward_to_go needs sequences [..., T]; logp has shape {tuple(logp.shape)} "
            "(1-D input holds independent one-token samples). For one sequence pass logp[None]"
        )
    if estimator != "k1":
        warn_at_caller(
            f"kl_reward(estimator={estimator!r}): as a reward (whose gradient is its score "
            "term), only k1 gives the gradient of KL(pi||ref); "
            + (
                "k3's gives grad KL(pi||ref) minus the per-position grad KL(ref_t||pi_t), which "
                "nearly cancel near ref (a second-order pull). Its value is still an unbiased "
                "KL(pi||ref) estimate to log; reward with estimator='k1'"
                if estimator == "k3"
                else f"{estimator}'s value is biased too; reward with estimator='k1'"
            ),
            KLGradientWarning,
        )
    with torch.no_grad():
        # kl_estimate's per-token values (reduction="none"), by its own steps: the log-ratios
        # (0 at masked positions, where k1, k2, k3 and abs are 0), then the estimator.
        checks = ValueChecks(resolve_validate(validate))
        ratios = prepare_log_ratios(
            check_tensor("logp", logp).detach(),
            check_tensor("logp_ref", logp_ref).detach(),
            logp_behavior=None,
            mask=mask,
            checks=checks,
            names=ArgumentNames(density_option=False),  # a reward is on tokens
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
        )
        checks.run()
        local, columns = ratios, None
        if reward_to_go and context_parallel is not None:  # sums to go over whole sequences
            ratios, _, columns, _ = whole_sequences(context_parallel, ratios, None)
        rows = per_token_values(ratios.delta, estimator, direction)
        if reward_to_go:
            rows = sum_from_here(rows) if gamma == 1.0 else discounted_sum_from_here(rows, gamma)
            if ratios.valid is not None:
                rows = torch.where(ratios.valid, rows, 0.0)
        if columns is not None:
            rows = local_columns(rows, columns)
            rows = rows if local.valid is None else torch.where(local.valid, rows, 0.0)
        return local.layout.tokens(rows)
