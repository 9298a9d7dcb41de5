r"""Importance-weighted and Rényi variational bounds, with pathwise, STL and DReG gradients.

Variational inference in klest's notation: pi = q(z|x) is the trainable distribution the samples
come from, reparameterized (:math:`z = g_\phi(\epsilon)`, :math:`\epsilon` free of
:math:`\phi`), and ref is the *unnormalized* target :math:`p_\theta(x, z)`, whose normalizer is
the evidence :math:`Z = p_\theta(x)`. With K samples :math:`z_1..z_K \sim \pi` i.i.d. per data
point and the log-weights :math:`\ell_k = \log ref(z_k) - \log\pi(z_k)`:

.. math::
    \mathcal L_{\alpha, K} = \frac{1}{1-\alpha}\log\frac1K\sum_{k=1}^K e^{(1-\alpha)\ell_k},
    \qquad \mathcal L_{0, K} = \mathrm{IWAE}_K = \log\frac1K\sum_k e^{\ell_k},
    \qquad \mathcal L_{1, K} = \frac1K\sum_k \ell_k .

:math:`E[\mathrm{IWAE}_1] = E[\mathcal L_{1,K}] = \mathrm{ELBO} = \log Z - KL(\pi\|p(\cdot|x))`
(the ELBO is minus k1 of :func:`klest.kl_estimate` with ref the joint);
:math:`E[\mathrm{IWAE}_K] \le \log Z`, increasing in K toward it, and :math:`e^{\mathrm{IWAE}_K}`
is unbiased for Z (Burda, Grosse and Salakhutdinov 2016). As K grows :math:`\mathcal
L_{\alpha,K}` tends to :math:`\log Z - D_\alpha(\pi\|p(\cdot|x))`, the Rényi divergence of
order :math:`\alpha`, and :math:`e^{(1-\alpha)\mathcal L_{\alpha,K}}` is unbiased for
:math:`E_\pi[e^{(1-\alpha)\ell}] = Z^{1-\alpha} e^{-(1-\alpha) D_\alpha}` at every K (Li and
Turner 2016). The value is computed as
:math:`\bar\ell + \frac{1}{1-\alpha}\log(1 + \frac1K\sum_k \mathrm{expm1}((1-\alpha)(\ell_k -
\bar\ell)))` where that cannot overflow, so it is accurate as :math:`\alpha \to 1`.

Gradient estimators (``grad=``), with :math:`\tilde w = \mathrm{softmax}_k((1-\alpha)\ell)`
(stopped), :math:`\ell^{stl}_k` the log-weight with pi's distribution parameters stopped
(``logp_stl``; only the path through :math:`z_k` is left), :math:`\theta` ref's parameters
(reached through ``logp_ref`` directly) and :math:`\phi` pi's (reached through the samples):

- ``pathwise``: :math:`\sum_k \tilde w_k \nabla\ell_k`, autodiff of the bound; mean: the
  gradient.
- ``stl``: :math:`\sum_k \tilde w_k \nabla\ell^{stl}_k` ("sticking the landing"); mean: the
  gradient for K = 1 or alpha = 1 only, biased otherwise.
- ``dreg``: w.r.t. :math:`\theta`, :math:`\sum_k \tilde w_k \nabla_\theta\ell_k`; w.r.t.
  :math:`\phi`, :math:`\sum_k c_k \frac{\partial\ell^{stl}_k}{\partial z_k}
  \frac{\partial z_k}{\partial\phi}` with :math:`c_k = \alpha\tilde w_k + (1-\alpha)\tilde
  w_k^2`; mean: the gradient.

"the gradient" is :math:`\nabla E[\mathcal L_{\alpha,K}]` with respect to both
:math:`\theta` and :math:`\phi`. The three agree on :math:`\theta`. On :math:`\phi`, pathwise
carries the score term :math:`-\tilde w_k\nabla_\phi\log\pi(z_k)`; STL drops it, which removes a
term of mean zero only when every :math:`\tilde w_k` is a constant (K = 1, or alpha = 1). DReG
rewrites its mean instead: :math:`E_{z_k}[f(z_k)\nabla_\phi\log\pi(z_k)] =
E[\frac{\partial f}{\partial z_k}\frac{\partial z_k}{\partial\phi}]` with :math:`f = \tilde w_k`
and :math:`\partial\tilde w_k/\partial z_k = (1-\alpha)\tilde w_k(1-\tilde w_k)
\partial\ell_k/\partial z_k`, which turns the score term into a pathwise one and gives the
weights above (:math:`\tilde w_k^2` for IWAE, Tucker et al.; :math:`1/K`, the STL average, at
alpha = 1). At the optimum :math:`\pi = p(\cdot|x)`, :math:`\ell^{stl}` is the constant
:math:`\log Z`, so STL's and DReG's gradients with respect to :math:`\phi` are exactly zero
for every sample, where pathwise's are not (Roeder et al.).

DReG needs the samples :math:`z` themselves (``samples``): its :math:`\phi` weights differ
from its :math:`\theta` weights, so it adds :math:`\sum_k \mathrm{sg}((c_k - \tilde w_k)
\partial\ell^{stl}_k/\partial z_k) \cdot z_k` to STL's surrogate, with
:math:`\partial\ell^{stl}_k/\partial z_k` from one ``torch.autograd.grad`` through the part of
the graph between the samples and the log-weights. Each log-weight must depend on its own
sample only (no statistics across samples). With K = 1 or alpha = 1 the weights agree and
DReG is STL.

References:
  "Importance Weighted Autoencoders" by Yuri Burda, Roger Grosse and Ruslan Salakhutdinov
  (ICLR 2016, https://arxiv.org/abs/1509.00519): IWAE.
  "Rényi Divergence Variational Inference" by Yingzhen Li and Richard E. Turner (NeurIPS 2016,
  https://arxiv.org/abs/1602.02311): the Rényi (VR) bound.
  "Sticking the Landing: Simple, Lower-Variance Gradient Estimators for Variational Inference"
  by Geoffrey Roeder, Yuhuai Wu and David Duvenaud (NeurIPS 2017,
  https://arxiv.org/abs/1703.09194): STL.
  "Doubly Reparameterized Gradient Estimators for Monte Carlo Objectives" by George Tucker,
  Dieterich Lawson, Shixiang Gu and Chris J. Maddison (ICLR 2019,
  https://arxiv.org/abs/1810.04152): DReG.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klest._checks import (
    ValueChecks,
    check_choice,
    check_float_tensor,
    check_log_probs,
    check_same_shape,
    compute_dtype,
    resolve_validate,
)
from klest._types import BoundGrad, BoundReduction
from klest.surrogates import join

__all__ = ["iwae_bound", "renyi_bound"]

_EXPM1_LIMIT = 30.0
"""Rows whose largest scaled, centred log-weight stays below this use the expm1 form (K e^30
is far below float32's largest value); others use log-sum-exp."""


def _bound(lw: Tensor, alpha: float) -> Tensor:
    """The Rényi bound of each row of log-weights ``[..., K]`` (autodiff gives pathwise).

    Rows whose log-weights are all finite and whose scaled, centred spread stays below
    ``_EXPM1_LIMIT`` take the expm1 form (accurate near alpha = 1); the others log-sum-exp
    (a weight 0, ref(z) = 0, counts as 0). The branch not taken is kept finite (clamps), so
    ``torch.where`` passes no NaN into the gradient."""
    mean = lw.mean(-1)
    if alpha == 1.0:
        return mean
    eps = 1.0 - alpha
    finite = torch.isfinite(mean)
    centre = torch.where(finite, mean, torch.zeros_like(mean))
    s = eps * (lw - centre.unsqueeze(-1))
    near_ok = finite & (s.detach().amax(-1) < _EXPM1_LIMIT)
    near = centre + torch.log1p(torch.expm1(s.clamp(max=_EXPM1_LIMIT)).mean(-1)) / eps
    far = (torch.logsumexp(eps * lw, -1) - math.log(lw.shape[-1])) / eps
    return torch.where(near_ok, near, far)


def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise TypeError(f"alpha must be a real number, got {type(alpha).__name__}")
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha}")
    return float(alpha)


def _check_inputs(
    logp: Tensor,
    logp_ref: Tensor,
    grad: str,
    samples: Tensor | None,
    logp_stl: Tensor | None,
    reduction: str,
) -> None:
    check_choice("grad", grad, BoundGrad)
    check_choice("reduction", reduction, BoundReduction)
    check_float_tensor("logp", logp, what="log-densities")
    check_float_tensor("logp_ref", logp_ref, what="log-densities")
    if logp_stl is not None:
        check_float_tensor("logp_stl", logp_stl, what="log-densities")
    check_same_shape(logp=logp, logp_ref=logp_ref, logp_stl=logp_stl)
    if logp.dim() == 0 or logp.shape[-1] == 0:
        raise ValueError(
            f"logp has shape {tuple(logp.shape)}; expected [..., K] with K >= 1 samples per "
            "data point in the last dimension"
        )
    if grad in ("stl", "dreg") and logp_stl is None:
        raise ValueError(
            f"grad={grad!r} needs logp_stl: log pi of the samples with pi's distribution "
            "parameters detached (the samples themselves still differentiable)"
        )
    if samples is not None:
        check_float_tensor("samples", samples, what="the reparameterized samples z")
        if samples.shape[: logp.dim()] != logp.shape:
            raise ValueError(
                f"samples has shape {tuple(samples.shape)} but logp has shape "
                f"{tuple(logp.shape)}; samples must be [..., K, *event] with logp's shape first"
            )


def renyi_bound(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    alpha: float,
    grad: BoundGrad = "pathwise",
    samples: Tensor | None = None,
    logp_stl: Tensor | None = None,
    reduction: BoundReduction = "mean",
    validate: bool | None = None,
) -> Tensor:
    r"""The Rényi (VR) bound of K importance samples per data point, with a chosen gradient.

    .. math::
        \mathcal L_{\alpha, K} = \frac{1}{1-\alpha}\log\frac1K\sum_{k=1}^K
        \Big(\frac{ref(z_k)}{\pi(z_k)}\Big)^{1-\alpha}

    (:math:`\alpha = 0`: IWAE; :math:`\alpha = 1`: the mean log-weight, whose mean is the ELBO;
    :math:`\alpha < 1`: a lower bound on :math:`\log Z` in expectation). The forward value is
    the bound; the gradient is ``grad``'s (the module :mod:`klest.sampled.importance_weighted`
    derives each one). Maximize it: the loss is ``-renyi_bound(...)``.

    Samples: :math:`z_k = g_\phi(\epsilon_k) \sim \pi`, K i.i.d. per data point,
    reparameterized; ref may be unnormalized (a joint :math:`p_\theta(x, z)`).

    See "Rényi Divergence Variational Inference" by Yingzhen Li and Richard E. Turner (NeurIPS
    2016, https://arxiv.org/abs/1602.02311) and "Doubly Reparameterized Gradient Estimators for
    Monte Carlo Objectives" by George Tucker, Dieterich Lawson, Shixiang Gu and Chris J. Maddison
    (ICLR 2019, https://arxiv.org/abs/1810.04152).

    Args:
      logp: log pi of the samples, ``[..., K]`` (K samples of each data point last), carrying
        the graph to pi's parameters both directly and through the samples.
      logp_ref: log ref of the same samples (the model's joint log-density), ``[..., K]``,
        carrying the graph to ref's parameters and through the samples.
      alpha: the order, a finite real number (1: the ELBO's limit, computed exactly).
      grad: ``"pathwise"`` (autodiff of the bound), ``"stl"`` (sticking the landing: unbiased
        only for K = 1 or alpha = 1) or ``"dreg"`` (doubly reparameterized: unbiased, and zero
        with respect to pi's parameters at the optimum).
      samples: the reparameterized samples ``[..., K, *event]`` that ``logp``, ``logp_ref`` and
        ``logp_stl`` were computed from (the tensor itself, carrying its graph to pi's
        parameters): needed by ``"dreg"`` when K > 1 and alpha != 1.
      logp_stl: log pi of the samples with pi's distribution parameters detached (the samples
        still differentiable), ``[..., K]``: needed by ``"stl"`` and ``"dreg"``.
      reduction: ``"mean"`` (default) or ``"sum"`` over the data points, or ``"none"`` (one
        bound per data point, ``logp.shape[:-1]``). The mean of no data points is 0.
      validate: run the value checks (NaN, +inf, a sample pi gives density 0) at one host
        synchronisation (None: the global default).

    Returns:
      The bound, in the compute dtype (the inputs' promoted dtype, at least float32): a scalar,
      or ``logp.shape[:-1]`` for ``reduction="none"``.

    Raises:
      TypeError: a non-tensor or non-float input, a non-numeric ``alpha``.
      ValueError: shapes that disagree, no sample dimension, an unknown ``grad`` or
        ``reduction``, ``logp_stl`` or ``samples`` missing where ``grad`` needs them, samples
        the log-weights do not depend on, or (``validate``) NaN / +inf log-densities.

    Example:
      >>> logp = torch.tensor([[-1.0, -1.5, -0.7]], requires_grad=True)
      >>> logp_ref = torch.tensor([[-2.0, -1.0, -1.2]])
      >>> round(renyi_bound(logp, logp_ref, alpha=1.0).item(), 4)  # the mean log-weight
      -0.3333
      >>> round(renyi_bound(logp, logp_ref, alpha=0.0).item(), 4)  # IWAE: log mean weight
      -0.1342
    """
    alpha = _check_alpha(alpha)
    _check_inputs(logp, logp_ref, grad, samples, logp_stl, reduction)
    checks = ValueChecks(resolve_validate(validate))
    role = "a sample pi gives density 0 (pi cannot produce it)"
    check_log_probs("logp", logp, checks, allow_neg_inf=False, role=role, density=True)
    check_log_probs("logp_ref", logp_ref, checks, allow_neg_inf=True, density=True)
    if logp_stl is not None:
        check_log_probs("logp_stl", logp_stl, checks, allow_neg_inf=False, role=role, density=True)
    checks.run()

    dtype = compute_dtype(logp, logp_ref, logp_stl)
    lw = logp_ref.to(dtype) - logp.to(dtype)
    value = _bound(lw, alpha)
    if grad != "pathwise" and torch.is_grad_enabled():
        value = join(value, _surrogate(lw, alpha, grad, samples, logp_ref, logp_stl, dtype))
    if reduction == "none":
        return value
    total = value.sum()
    return total / max(value.numel(), 1) if reduction == "mean" else total


def _surrogate(
    lw: Tensor,
    alpha: float,
    grad: str,
    samples: Tensor | None,
    logp_ref: Tensor,
    logp_stl: Tensor,
    dtype: torch.dtype,
) -> Tensor:
    """STL's or DReG's surrogate per data point (its value is not the bound: only its gradient
    is used)."""
    w = torch.softmax((1.0 - alpha) * lw.detach(), -1)
    lw_stl = logp_ref.to(dtype) - logp_stl.to(dtype)
    # A sample ref gives density 0 has weight 0 (and log-weight -inf): it adds nothing.
    surrogate = torch.where(w > 0, w * lw_stl, torch.zeros_like(w)).sum(-1)
    k = lw.shape[-1]
    if grad == "stl" or k == 1 or alpha == 1.0 or not lw_stl.requires_grad:
        return surrogate
    if samples is None:
        raise ValueError(
            "grad='dreg' with K > 1 and alpha != 1 needs samples: the reparameterized samples "
            "z [..., K, *event] that logp, logp_ref and logp_stl were computed from"
        )
    (dz,) = torch.autograd.grad(lw_stl.sum(), samples, retain_graph=True, allow_unused=True)
    if dz is None:
        raise ValueError(
            "samples is not an input of logp_ref - logp_stl: pass the tensor z itself (with "
            "its graph to pi's parameters) that the log-densities were computed from"
        )
    # pi's weights minus STL's: (alpha w + (1 - alpha) w^2) - w = -(1 - alpha) w (1 - w).
    extra = -(1.0 - alpha) * w * (1.0 - w)
    extra = extra.reshape(extra.shape + (1,) * (samples.dim() - lw.dim()))
    push = (extra * dz.detach().to(dtype) * samples.to(dtype)).flatten(lw.dim()).sum(-1)
    return surrogate + push.sum(-1)


def iwae_bound(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    grad: BoundGrad = "pathwise",
    samples: Tensor | None = None,
    logp_stl: Tensor | None = None,
    reduction: BoundReduction = "mean",
    validate: bool | None = None,
) -> Tensor:
    r"""The importance-weighted bound (IWAE) of K samples per data point, with a chosen gradient.

    .. math::
        \mathrm{IWAE}_K = \log\frac1K\sum_{k=1}^K \frac{ref(z_k)}{\pi(z_k)},
        \qquad E[\mathrm{IWAE}_1] = \mathrm{ELBO} \le E[\mathrm{IWAE}_K]
        \le E[\mathrm{IWAE}_{K+1}] \le \log Z

    :func:`renyi_bound` at ``alpha=0``: the same arguments, samples and shapes. With
    ``grad="dreg"`` the gradient with respect to pi's parameters weights each sample's
    pathwise gradient by its squared normalized weight, :math:`\tilde w_k^2` (Tucker et al.);
    with respect to ref's, by :math:`\tilde w_k`. Maximize it: the loss is ``-iwae_bound(...)``.

    See "Importance Weighted Autoencoders" by Yuri Burda, Roger Grosse and Ruslan
    Salakhutdinov (ICLR 2016, https://arxiv.org/abs/1509.00519) and "Doubly Reparameterized
    Gradient Estimators for Monte Carlo Objectives" by George Tucker, Dieterich Lawson,
    Shixiang Gu and Chris J. Maddison (ICLR 2019, https://arxiv.org/abs/1810.04152).

    Args:
      logp: log pi of the samples ``[..., K]`` (see :func:`renyi_bound`).
      logp_ref: log ref (the joint) of the same samples, ``[..., K]``.
      grad: ``"pathwise"``, ``"stl"`` (biased for K > 1) or ``"dreg"``.
      samples: the samples ``[..., K, *event]``, for ``"dreg"`` with K > 1.
      logp_stl: log pi with pi's distribution parameters detached, for ``"stl"`` / ``"dreg"``.
      reduction: ``"mean"``, ``"sum"`` or ``"none"``.
      validate: run the value checks (None: the global default).

    Returns:
      The bound: a scalar, or ``logp.shape[:-1]`` for ``reduction="none"``.

    Raises:
      TypeError, ValueError: as :func:`renyi_bound`.

    Example:
      At the optimum, pi = N(0.5, 1) against ref = 3 N(0.5, 1) (Z = 3), DReG's gradient is
      exactly 0 and pathwise's is not:

      >>> mean = torch.full((2,), 0.5, requires_grad=True)
      >>> z = mean + torch.randn(4, 8, 2, generator=torch.Generator().manual_seed(0))  # K = 8
      >>> normal = torch.distributions.Normal
      >>> logp_ref = normal(0.5, 1.0).log_prob(z).sum(-1) + math.log(3)
      >>> logp = normal(mean, 1.0).log_prob(z).sum(-1)
      >>> logp_stl = normal(mean.detach(), 1.0).log_prob(z).sum(-1)
      >>> bound = iwae_bound(logp, logp_ref, grad="dreg", samples=z, logp_stl=logp_stl)
      >>> round(bound.item(), 4), torch.autograd.grad(bound, mean, retain_graph=True)
      (1.0986, (tensor([0., 0.]),))
      >>> bool(torch.autograd.grad(iwae_bound(logp, logp_ref), mean)[0].abs().max() > 0)
      True
    """
    return renyi_bound(
        logp,
        logp_ref,
        alpha=0.0,
        grad=grad,
        samples=samples,
        logp_stl=logp_stl,
        reduction=reduction,
        validate=validate,
    )
