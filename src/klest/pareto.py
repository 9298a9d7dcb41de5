r"""The Pareto shape k-hat of a sample's largest ratios: the tail diagnostic of importance ratios.

An estimate that averages ratios :math:`r_i` (k3's and the control variate's ``r - 1`` with
:math:`r = ref/\pi`, importance weights :math:`w = \pi/behavior` off-policy, the sampled tail of
:func:`klest.kl_from_topk`) is unbiased, but when the ratios' distribution has a heavy upper
tail the part of the mean that lives in the tail comes from samples a batch almost never holds.
Then a typical batch's estimate is below the true value, by an amount its standard error does
not show (the standard error is computed from the same missing tail). The upper tail of almost
any distribution is close to a generalized Pareto distribution with shape :math:`k`: moments of
order :math:`1/k` and above are infinite. :func:`pareto_k` estimates :math:`k` from the largest
ratios of one sample, as Pareto smoothed importance sampling does:

- the tail is the :math:`M = \lceil\min(n/5,\ 3\sqrt n)\rceil` largest of the :math:`n` ratios
  (those above the :math:`(M+1)`-th largest), shifted by it;
- the generalized Pareto distribution is fitted to them by the empirical-Bayes estimator of
  Zhang and Stephens (a posterior mean over a grid of :math:`30 + \lfloor\sqrt M\rfloor` values
  of its profile parameter), and the shape estimate is shrunk towards 0.5 with the weak prior
  of PSIS: :math:`\hat k = (M k + 5) / (M + 10)`.

Reading it (Vehtari et al., section 3): :math:`\hat k < 0.5`, the ratios have a finite variance
and the central limit theorem holds; :math:`0.5 \le \hat k < 0.7`, the variance is infinite
but the mean converges at a usable rate; :math:`\hat k \ge 0.7` (``PARETO_K_THRESHOLD``),
"the bias starts to dominate the error" and no practical batch gives a trustworthy mean. (The
paper tightens 0.7 to :math:`1 - 1/\log_{10} n` for :math:`n < 2200` samples; klest warns at
0.7.) For the Gaussian pair :math:`\pi = N(\mu, \sigma^2 I)`, :math:`ref = N(0, I)` the ratio
:math:`r = ref/\pi` has the tail shape :math:`1 - \sigma^2` exactly (:math:`E_\pi[r^a]` is finite
for :math:`a < 1/(1 - \sigma^2)`), so :math:`\sigma < 1/\sqrt 2` is where k3's variance is
infinite, and :math:`\sigma \approx 0.55` where :math:`k = 0.7`.

Few samples fit no tail: with fewer than ``MIN_SAMPLES`` (50) valid ratios, or when fewer than
5 ratios lie strictly above the cut (ties: a constant ratio, say), :func:`pareto_k` returns NaN,
and klest gives no warning. With 50 ratios the tail holds 10.

The whole computation runs on the tensors' device (a ``topk`` of the largest ratios and a few
reductions, float64), with no host synchronisation: klest queues the comparison with 0.7 on the
one read of its value checks (:class:`klest._checks.ValueChecks`), and computes nothing when
validation is off and no details are asked for.

References:
  A. Vehtari, D. Simpson, A. Gelman, Y. Yao and J. Gabry, "Pareto Smoothed Importance
  Sampling", Journal of Machine Learning Research 25(72):1-58, 2024
  (https://jmlr.org/papers/v25/19-556.html). J. Zhang and M. A. Stephens, "A New and Efficient
  Estimation Method for the Generalized Pareto Distribution", Technometrics 51(3):316-325, 2009.
  ArviZ's ``psislw`` (https://github.com/arviz-devs/arviz) is the reference the tests compare
  with.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klest._checks import check_float_tensor, check_positive_int

__all__ = ["MIN_SAMPLES", "PARETO_K_THRESHOLD", "pareto_k"]

PARETO_K_THRESHOLD = 0.7
"""Above this k-hat a sample mean of the ratios is not trustworthy (Vehtari et al., 2024)."""

MIN_SAMPLES = 50
"""Fewer valid ratios than this give no k-hat (NaN): the tail would hold fewer than 10."""

_PRIOR_B = 3.0  # Zhang and Stephens' scale of the profile grid (over the first quartile)
_PRIOR_K = 10.0  # PSIS's weak prior: k-hat = (M k + 5) / (M + 10)
_MIN_TAIL = 5  # a fit needs at least this many tail values (arviz: "not enough tail samples")


def _tail_size(n: Tensor | int) -> Tensor | int:
    """``ceil(min(n / 5, 3 sqrt(n)))``: how many of ``n`` ratios form the tail."""
    if isinstance(n, int):
        return math.ceil(min(n / 5.0, 3.0 * n**0.5))
    return torch.ceil(torch.minimum(n / 5.0, 3.0 * n.sqrt()))


def pareto_k(
    log_ratios: Tensor, *, mask: Tensor | None = None, min_samples: int = MIN_SAMPLES
) -> Tensor:
    r"""The Pareto shape estimate k-hat of the upper tail of ``exp(log_ratios)`` (PSIS).

    .. math::
        P(r > u + t \mid r > u) \approx \Big(1 + \frac{k t}{\sigma}\Big)^{-1/k}, \qquad
        \hat k = \frac{M \hat k_{ZS} + 5}{M + 10}

    with :math:`\hat k_{ZS}` Zhang and Stephens' estimate from the :math:`M =
    \lceil\min(n/5, 3\sqrt n)\rceil` largest of the :math:`n` ratios (:mod:`klest.pareto`).
    Moments of :math:`r` of order :math:`1/k` and above are infinite; above
    ``PARETO_K_THRESHOLD`` (0.7) a sample mean of the ratios is not trustworthy.

    Samples: the ratios are one independent sample of a distribution (e.g. :math:`r =
    ref(x)/\pi(x)` at :math:`x \sim \pi`); the last dimension holds them, every leading index is
    a separate sample with its own estimate. Only the ratios' logarithms are needed (no
    overflow), and only their order and spacing above the cut matter: k-hat does not change when
    every ratio is multiplied by the same constant.

    Args:
      log_ratios: ``[..., n]`` log-ratios, any float dtype (computed in float64, except on
        devices without it). ``-inf`` is a ratio of 0.
      mask: bool ``[..., n]``: True where a ratio belongs to the sample (None: all do).
      min_samples: fewer valid ratios than this give NaN (default ``MIN_SAMPLES``, 50).

    Returns:
      ``[...]`` k-hat in the computation dtype, detached: NaN with fewer than ``min_samples``
      ratios, when fewer than 5 lie strictly above the tail's cut (ties), or with a NaN or
      ``+inf`` log-ratio.

    See A. Vehtari, D. Simpson, A. Gelman, Y. Yao and J. Gabry, "Pareto Smoothed Importance
    Sampling" (JMLR 2024, https://jmlr.org/papers/v25/19-556.html), and J. Zhang and M. A.
    Stephens (Technometrics 2009) for the fit.

    Example:
      >>> g = torch.Generator().manual_seed(0)
      >>> bounded = torch.rand(4000, generator=g).log()     # r ~ U(0, 1): k = -1
      >>> heavy = torch.rand(4000, generator=g).log().neg()  # r = 1/U, Pareto: k = 1
      >>> [round(float(pareto_k(x)), 1) for x in (bounded, heavy)]
      [-1.0, 1.1]
    """
    check_float_tensor("log_ratios", log_ratios, what="log-ratios")
    if log_ratios.dim() < 1:
        raise ValueError(f"log_ratios must be [..., n], got shape {tuple(log_ratios.shape)}")
    check_positive_int("min_samples", min_samples, allow_none=False)
    device = log_ratios.device
    dtype = torch.float64 if device.type != "mps" else torch.float32
    with torch.no_grad():
        x = log_ratios.detach()
        size = x.shape[-1]
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != x.shape:
                raise ValueError(
                    f"mask must be a bool tensor of log_ratios' shape {tuple(x.shape)}, got "
                    f"{getattr(mask, 'dtype', type(mask).__name__)} "
                    f"{tuple(getattr(mask, 'shape', ()))}"
                )
            x = x.masked_fill(~mask, -math.inf)
            n: Tensor | int = mask.sum(-1).to(dtype)
        else:
            n = size
        lead = x.shape[:-1]
        if size < max(min_samples, 2) or (isinstance(n, int) and n < min_samples):
            return torch.full(lead, math.nan, dtype=dtype, device=device)
        m_cap = _tail_size(size)  # the largest tail any count of valid ratios gives
        # The largest ratios, descending (m_cap + 1 <= size for size >= 2), selected in the
        # input's dtype (cheaper than converting every ratio) and converted exactly.
        top = x.topk(m_cap + 1, dim=-1).values.to(dtype)
        m = _tail_size(n)
        if isinstance(m, int):
            cut = top[..., m]
        else:
            cut = top.gather(-1, m.long().clamp(max=m_cap)[..., None])[..., 0]
        # Shift by the largest ratio (exp of the tail never overflows); the cut is the
        # (M+1)-th largest, at least the smallest normal number (arviz's cutoffmin).
        largest = top[..., :1]
        shifted = top - largest
        cut = torch.clamp(cut - largest[..., 0], min=math.log(torch.finfo(dtype).tiny))
        # Those above the cut (the M largest, or fewer with ties): a prefix of the order.
        in_tail = shifted > cut[..., None]
        tail = torch.where(in_tail, torch.exp(shifted) - torch.exp(cut)[..., None], 0.0)
        length = in_tail.sum(-1).to(dtype)
        k = _zhang_stephens(tail, in_tail, length, m_cap)
        k = (length * k + _PRIOR_K * 0.5) / (length + _PRIOR_K)
        ok = (length >= _MIN_TAIL) & torch.isfinite(largest[..., 0])
        if isinstance(n, Tensor):
            ok = ok & (n >= min_samples)
        return torch.where(ok, k, math.nan)


def _zhang_stephens(tail: Tensor, in_tail: Tensor, length: Tensor, m_cap: int) -> Tensor:
    """Zhang and Stephens' shape estimate of the generalized Pareto distribution from the
    exceedances ``tail`` ``[..., K]`` (descending, the first ``length`` valid, flagged by
    ``in_tail``); ``m_cap`` bounds ``length``. As arviz's ``_gpdfit``, before the prior."""
    dtype, device = tail.dtype, tail.device
    grid = 30 + torch.floor(length.sqrt())  # grid points of this sample
    grid_cap = 30 + math.floor(math.sqrt(m_cap))
    j = torch.arange(1, grid_cap + 1, dtype=dtype, device=device)
    on_grid = j <= grid[..., None]
    largest = tail[..., :1]
    # The first quartile of the ascending tail: index int(M / 4 + 0.5) - 1 from the smallest.
    q = (length - torch.floor(length / 4 + 0.5)).long().clamp(0, tail.shape[-1] - 1)
    quartile = tail.gather(-1, q[..., None])
    b = 1 - torch.sqrt(grid[..., None] / (j - 0.5))
    b = b / (_PRIOR_B * quartile) + 1 / largest  # [..., G]
    logs = torch.log1p(-b[..., :, None] * tail[..., None, :])  # [..., G, K]
    count = length.clamp(min=1)[..., None]
    k_grid = torch.where(in_tail[..., None, :], logs, 0.0).sum(-1) / count
    profile = length[..., None] * (torch.log(-(b / k_grid)) - k_grid - 1)
    profile = torch.where(on_grid & ~torch.isnan(profile), profile, -math.inf)
    # weight_i = 1 / sum_j exp(L_j - L_i), as arviz writes it (a softmax of the profile).
    diff = torch.where(
        on_grid[..., None, :], profile[..., None, :] - profile[..., :, None], -math.inf
    )
    weights = torch.where(on_grid, 1 / torch.exp(diff).sum(-1), 0.0)
    weights = torch.where(weights >= 10 * torch.finfo(dtype).eps, weights, 0.0)
    weights = weights / weights.sum(-1, keepdim=True)
    b_post = (b * weights).sum(-1, keepdim=True)
    logs = torch.where(in_tail, torch.log1p(-b_post * tail), 0.0)
    return logs.sum(-1) / count[..., 0]
