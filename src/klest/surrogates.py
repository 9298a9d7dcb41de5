r"""Joining a value and a gradient, and baselines for score-function gradients.

:func:`decouple` is the one primitive every KL term in klest goes through: the forward pass
returns ``value`` and the backward pass the gradient of ``surrogate``,

.. math:: \mathrm{decouple}(v, s) = \mathrm{sg}(v) + s - \mathrm{sg}(s),

so a value estimator (k3, say) and a gradient estimator (k1's, say: the Chimera estimator of
seed 000) are chosen independently. A score-function surrogate ``log pi(y) * sg(A)`` may subtract
a baseline ``b`` from ``A`` without changing its expected gradient when ``b`` does not depend on
the sample it multiplies (``E[b * grad log pi(y)] = E[b] E[grad log pi(y)] = 0``):

- ``"loo"``: the mean of the other samples of the same group (leave-one-out; unbiased);
- ``"mean"``: the group mean *including* the sample itself: it scales the expected gradient by
  ``1 - 1/n`` (biased; offered because it is common);
- :class:`BaselineEMA`: a moving average of earlier batches (unbiased).

A baseline is not free: it adds the noise of its own estimate. See DESIGN.md section 3 and seed
002 (arXiv:2506.09477) for leave-one-out baselines in KL gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

BASELINES = ("loo", "mean")


def decouple(value: Tensor, surrogate: Tensor) -> Tensor:
    r"""``value`` in the forward pass, the gradient of ``surrogate`` in the backward pass.

    .. math:: \mathrm{sg}(value) + surrogate - \mathrm{sg}(surrogate)

    The forward result equals ``value`` exactly (``s - sg(s)`` is exactly 0 for finite ``s``);
    the gradient equals the gradient of ``surrogate`` exactly; ``value`` passes no gradient.

    Args:
      value: the reported value (any shape).
      surrogate: a tensor of the same shape whose gradient is the desired gradient; must be
        finite (``inf - inf`` would put NaN in the value).
    """
    if not isinstance(value, Tensor) or not isinstance(surrogate, Tensor):
        raise TypeError("decouple takes two tensors")
    if value.shape != surrogate.shape:
        raise ValueError(
            f"value has shape {tuple(value.shape)} but surrogate has shape "
            f"{tuple(surrogate.shape)}; they must match"
        )
    with torch.no_grad():
        if not bool(torch.isfinite(surrogate).all()):
            raise ValueError(
                "surrogate is not finite (overflowing importance weights or log-ratios?); "
                "its gradient would be NaN"
            )
    return value.detach() + (surrogate - surrogate.detach())


class BaselineEMA:
    """A baseline from an exponential moving average of earlier batches' targets.

    Per-sequence targets (score function) keep one average; per-position targets (cumulative)
    keep one per position. Each call uses the average of *previous* batches (independent of the
    current samples, so unbiased), then folds in the current batch. Before any update the
    baseline is 0.

    Args:
      decay: weight of the past, in [0, 1).
    """

    def __init__(self, *, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._sum: Tensor | None = None  # decayed sums per position (index 0 for scalars)
        self._weight: Tensor | None = None

    def __call__(self, targets: Tensor, valid: Tensor) -> Tensor:
        """The baseline for ``targets`` (``[rows, T]``, ``valid`` bool), then update."""
        t = targets.shape[-1]
        targets = targets.detach().double()
        if self._sum is None or self._sum.numel() < t:
            grow = t if self._sum is None else t - self._sum.numel()
            pad = torch.zeros(grow, dtype=torch.float64)
            self._sum = pad.clone() if self._sum is None else torch.cat([self._sum, pad])
            self._weight = pad.clone() if self._weight is None else torch.cat([self._weight, pad])
        known = self._weight[:t] > 0
        mean = torch.where(known, self._sum[:t] / self._weight[:t].clamp(min=1e-300), 0.0)
        baseline = mean.to(device=targets.device).expand_as(targets)
        count = valid.sum(0).double().cpu()
        batch_sum = torch.where(valid, targets, 0.0).sum(0).cpu()
        seen = count > 0
        batch_mean = torch.where(seen, batch_sum / count.clamp(min=1.0), 0.0)
        self._sum[:t] = torch.where(
            seen, self.decay * self._sum[:t] + (1 - self.decay) * batch_mean, self._sum[:t]
        )
        self._weight[:t] = torch.where(
            seen, self.decay * self._weight[:t] + (1 - self.decay), self._weight[:t]
        )
        return baseline

    def __repr__(self) -> str:
        return f"BaselineEMA(decay={self.decay})"


def group_baseline(targets: Tensor, valid: Tensor, kind: str, group: Tensor | None) -> Tensor:
    """Leave-one-out or mean baseline of ``targets`` ``[rows, T]`` within each group.

    Positions are averaged separately (over the rows where they are valid); a row's own value
    is excluded for ``"loo"``. Where no other row is valid at a position the baseline is 0.
    """
    rows = targets.shape[0]
    if group is None:
        group = torch.zeros(rows, dtype=torch.long, device=targets.device)
    _, group = torch.unique(group, return_inverse=True)
    n_groups = int(group.max()) + 1
    if kind == "loo":
        sizes = torch.bincount(group, minlength=n_groups)
        if int(sizes.min()) < 2:
            raise ValueError(
                "baseline='loo' needs at least 2 samples per group (leave-one-out over the "
                f"others); the smallest group has {int(sizes.min())}"
            )
    x = torch.where(valid, targets.detach().double(), 0.0)
    shape = (n_groups, targets.shape[-1])
    sums = torch.zeros(shape, dtype=torch.float64, device=x.device).index_add_(0, group, x)
    counts = torch.zeros(shape, dtype=torch.float64, device=x.device).index_add_(
        0, group, valid.double()
    )
    own_sum, own_count = sums[group], counts[group]
    if kind == "loo":
        own_sum, own_count = own_sum - x, own_count - valid.double()
    return torch.where(own_count > 0, own_sum / own_count.clamp(min=1.0), 0.0)
