"""Fitting the control-variate coefficient alpha of ``naive + alpha * u`` (``E[u] = 0``).

The variance-optimal coefficient is ``alpha* = -Cov(naive, u) / Var(u)``. Fitting it on the same
samples it is applied to correlates alpha with the samples and biases the estimate; fitting it on
*other* samples keeps ``E[alpha * u] = E[alpha] E[u] = 0``. So klest fits alpha

- ``"loo"``: for each row from all the other rows (leave-one-out),
- ``"crossfit"``: for even rows from the odd rows and vice versa (two folds),
- within groups of rows when ``group`` ids are given (e.g. the samples of one prompt),
- with :class:`AlphaEMA`: from an exponential moving average of earlier batches' moments,

and offers ``"in-sample"`` (the seed's recipe, slightly biased) for comparison.

A *row* is the unit left out: one sample of a 1-D input, one sequence (all its tokens) of an
input shaped ``[..., T]``. Tokens of one sequence depend on each other, so leaving out single
tokens would not make alpha independent of the tokens it multiplies.

See "A control variate that actually helps" (seed 001 in ``shared/seeds``) and Schulman,
"Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klest._checks import check_choice

ALPHA_FITS = ("loo", "crossfit", "in-sample")


@dataclass(frozen=True)
class _Sums:
    """Sums of the valid values (centred on their group's mean) per row or per group."""

    n: Tensor
    a: Tensor
    b: Tensor
    ab: Tensor
    bb: Tensor

    def fields(self) -> tuple[Tensor, ...]:
        return (self.n, self.a, self.b, self.ab, self.bb)

    def minus(self, other: _Sums) -> _Sums:
        return _Sums(*(x - y for x, y in zip(self.fields(), other.fields(), strict=True)))

    def pool(self, index: Tensor, size: int) -> _Sums:
        """Sum rows into ``size`` bins by ``index``."""
        return _Sums(
            *(
                torch.zeros(size, dtype=x.dtype, device=x.device).index_add_(0, index, x)
                for x in self.fields()
            )
        )

    def take(self, index: Tensor) -> _Sums:
        return _Sums(*(x[index] for x in self.fields()))


# Relative size below which a set's variance is rounding noise (float64 sums).
_VAR_RTOL = 1e-10


def _alpha(s: _Sums) -> Tensor:
    """``-Cov(a, b) / Var(b)`` from sums over a set; 0 where the set cannot define it.

    A set whose ``b`` values are all equal has variance 0, but computed from sums centred on
    a mean that includes the left-out row it comes out as rounding noise that depends on that
    row; noise/noise would make alpha depend on the row and bias the estimate. So a variance
    below ``_VAR_RTOL`` times the set's own sum of squares counts as 0.
    """
    n = s.n.clamp(min=1.0)
    cov = s.ab - s.a * s.b / n
    var = s.bb - s.b * s.b / n
    ok = (s.n >= 2) & (var > _VAR_RTOL * s.bb)
    return torch.where(ok, -cov / torch.where(ok, var, 1.0), 0.0)


def _position_in_group(group: Tensor) -> Tensor:
    """0, 1, 2, ... for the rows of each group, in row order."""
    sorted_group, order = torch.sort(group, stable=True)
    first = torch.searchsorted(sorted_group, sorted_group, right=False)
    pos = torch.empty_like(group)
    pos[order] = torch.arange(group.numel(), device=group.device) - first
    return pos


def fit_alpha(
    a: Tensor, b: Tensor, valid: Tensor, method: str, *, group: Tensor | None = None
) -> Tensor:
    """Coefficient per row, shape ``[rows]``, detached, float64.

    Args:
      a: naive per-token estimates, ``[rows, T]``.
      b: zero-mean control variate per token, ``[rows, T]``.
      valid: bool ``[rows, T]``, True where a token counts.
      method: ``"loo"``, ``"crossfit"`` or ``"in-sample"``.
      group: optional integer ids ``[rows]``: alpha is fitted within each group separately
        (e.g. the samples of one prompt); by default all rows form one group.
    """
    check_choice("alpha", method, ALPHA_FITS)
    rows = a.shape[0]
    if group is None:
        group = torch.zeros(rows, dtype=torch.long, device=a.device)
    _, group = torch.unique(group, return_inverse=True)
    n_groups = int(group.max()) + 1
    if method in ("loo", "crossfit"):
        sizes = torch.bincount(group, minlength=n_groups)
        if int(sizes.min()) < 2:
            raise ValueError(
                f"alpha={method!r} fits alpha on other rows of the same group and needs at least "
                f"2 rows per group; the smallest group has {int(sizes.min())}"
            )
    a, b = a.detach().double(), b.detach().double()
    # Infinite values (a KL that is truly infinite) carry no information about alpha.
    keep = valid & torch.isfinite(a) & torch.isfinite(b)
    a, b = torch.where(keep, a, 0.0), torch.where(keep, b, 0.0)
    raw = _Sums(keep.sum(-1).double(), a.sum(-1), b.sum(-1), a.new_zeros(rows), b.new_zeros(rows))
    pooled = raw.pool(group, n_groups)
    count = pooled.n.clamp(min=1.0)
    ac = torch.where(keep, a - (pooled.a / count)[group].unsqueeze(-1), 0.0)
    bc = torch.where(keep, b - (pooled.b / count)[group].unsqueeze(-1), 0.0)
    per_row = _Sums(raw.n, ac.sum(-1), bc.sum(-1), (ac * bc).sum(-1), (bc * bc).sum(-1))
    totals = per_row.pool(group, n_groups).take(group)
    if method == "in-sample":
        return _alpha(totals)
    if method == "loo":
        return _alpha(totals.minus(per_row))
    key = group * 2 + _position_in_group(group) % 2
    own_fold = per_row.pool(key, 2 * n_groups).take(key)
    return _alpha(totals.minus(own_fold))


class AlphaEMA:
    """Control-variate coefficient from an exponential moving average over earlier batches.

    Each call of an estimator with ``alpha=ema`` uses the coefficient fitted on *previous*
    batches (so it is independent of the current samples and the estimate stays unbiased),
    then folds the current batch into the average. Before the first update it returns ``init``.

    Args:
      decay: weight of the past in the moving average, in [0, 1).
      init: coefficient used before any batch has been seen (1.0 gives k3).
    """

    def __init__(self, *, decay: float = 0.9, init: float = 1.0) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.init = float(init)
        self._weight = 0.0
        self._moments = torch.zeros(4, dtype=torch.float64)  # E[a], E[b], E[ab], E[bb]

    @property
    def alpha(self) -> float:
        """The coefficient the next batch will use."""
        if self._weight == 0.0:
            return self.init
        ea, eb, eab, ebb = (self._moments / self._weight).tolist()
        var = ebb - eb * eb
        return -(eab - ea * eb) / var if var > _VAR_RTOL * ebb else self.init

    def update(self, a: Tensor, b: Tensor, valid: Tensor) -> None:
        """Fold one batch (``a``, ``b``, ``valid`` as in :func:`fit_alpha`) into the average."""
        a, b = a.detach().double().cpu(), b.detach().double().cpu()
        keep = valid.cpu() & torch.isfinite(a) & torch.isfinite(b)
        if not bool(keep.any()):
            return
        a, b = a[keep], b[keep]
        batch = torch.stack([a.mean(), b.mean(), (a * b).mean(), (b * b).mean()])
        self._moments = self.decay * self._moments + (1.0 - self.decay) * batch
        # Bias correction as in Adam: weight = 1 - decay^steps.
        self._weight = self.decay * self._weight + (1.0 - self.decay)

    def __repr__(self) -> str:
        return f"AlphaEMA(decay={self.decay}, alpha={self.alpha:.4g})"
