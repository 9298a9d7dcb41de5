"""Fitting the control-variate coefficient alpha of ``naive + alpha * u`` (``E[u] = 0``).

The variance-optimal coefficient is ``alpha* = -Cov(naive, u) / Var(u)``. Fitting it on the same
samples it is applied to correlates alpha with the samples and biases the estimate; fitting it on
*other* samples keeps ``E[alpha * u] = E[alpha] E[u] = 0``. So klest fits alpha

- ``"loo"``: for each row from all the other rows (leave-one-out),
- ``"crossfit"``: for even rows from the odd rows and vice versa (two folds; rows with no
  valid token are not counted, so padding rows change no other row's fold),
- within groups of rows when ``group`` ids are given (e.g. the samples of one prompt),
- with :class:`AlphaEMA`: from an exponential moving average of earlier batches' moments,

and offers ``"in-sample"`` (fitted on the same rows: biased) for comparison. A group of one row
has no other rows to fit on: its coefficient is 0 (k1 itself), which keeps it unbiased.

A *row* is the unit left out: one sample of a 1-D input, one sequence (all its tokens) of an
input shaped ``[..., T]``. Tokens of one sequence depend on each other, so leaving out single
tokens would not make alpha independent of the tokens it multiplies.

The control variate is ``u = r - 1`` (``E_pi[u] = 0`` because ``E_pi[ref/pi] = 1``), as in an AI
Tech Inspire article on KL divergence and its Monte Carlo estimation; ``alpha = 1`` is k3 of
"Approximating KL Divergence" by John Schulman (2020, http://joschu.net/blog/kl-approx.html).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from klest._checks import ValueChecks, check_choice, check_decay, first_bad
from klest._state import keep_float64
from klest._types import AlphaFit
from klest.sampled.groups import position_in_group
from klest.sampled.log_ratios import LogRatios
from klest.sampled.terms import control_term, naive_term, weighted

__all__ = ["Alpha", "AlphaEMA", "fit_alpha", "resolve_alpha"]


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


def fit_alpha(
    a: Tensor, b: Tensor, valid: Tensor, method: AlphaFit, *, keys: Tensor | None = None
) -> Tensor:
    """Coefficient per row, shape ``[rows]``, detached, float64.

    Args:
      a: naive per-token estimates, ``[rows, T]``.
      b: zero-mean control variate per token, ``[rows, T]``.
      valid: bool ``[rows, T]``, True where a token counts.
      method: ``"loo"``, ``"crossfit"`` or ``"in-sample"``.
      keys: ``[rows]`` group keys (:func:`klest.aggregation.group_keys`): alpha is fitted within
        each group separately (e.g. the samples of one prompt); None: all rows are one group.
    """
    check_choice("alpha", method, AlphaFit)
    rows = a.shape[0]
    if keys is None:
        keys = torch.zeros(rows, dtype=torch.int64, device=a.device)
    a, b = a.detach().double(), b.detach().double()
    # Infinite values (a KL that is truly infinite) carry no information about alpha.
    keep = valid & torch.isfinite(a) & torch.isfinite(b)
    a, b = torch.where(keep, a, 0.0), torch.where(keep, b, 0.0)
    raw = _Sums(keep.sum(-1).double(), a.sum(-1), b.sum(-1), a.new_zeros(rows), b.new_zeros(rows))
    pooled = raw.pool(keys, rows)
    count = pooled.n.clamp(min=1.0)
    ac = torch.where(keep, a - (pooled.a / count)[keys].unsqueeze(-1), 0.0)
    bc = torch.where(keep, b - (pooled.b / count)[keys].unsqueeze(-1), 0.0)
    per_row = _Sums(raw.n, ac.sum(-1), bc.sum(-1), (ac * bc).sum(-1), (bc * bc).sum(-1))
    totals = per_row.pool(keys, rows).take(keys)
    if method == "in-sample":
        return _alpha(totals)
    if method == "loo":
        return _alpha(totals.minus(per_row))
    fold = keys * 2 + position_in_group(keys, valid.any(-1)) % 2
    own_fold = per_row.pool(fold, 2 * rows).take(fold)
    return _alpha(totals.minus(own_fold))


class AlphaEMA(nn.Module):
    r"""Control-variate coefficient from an exponential moving average over earlier batches.

    .. math::
        \alpha_k = -\frac{\widehat{Cov}_{k-1}(k_1, u)}{\widehat{Var}_{k-1}(u)}, \qquad
        m_k = \gamma\, m_{k-1} + (1 - \gamma)\, \bar m(\text{batch } k)

    for the moments :math:`m = (E[a], E[b], E[ab], E[b^2])` (``a`` = k1, ``b = u``), bias-corrected
    as in Adam. Each call of an estimator with ``alpha=ema`` uses the coefficient fitted on
    *previous* batches (independent of the current samples, so the estimate stays unbiased),
    then folds the current batch in (a batch with no valid sample leaves the state as it was).
    Before the first batch, and while the batches' ``u`` has no variance, it is ``init``.

    The state lives in float64 buffers (``moments``, ``weight``) on the tensors' device, so it
    moves with ``.to()`` (staying float64 when a model is cast to bf16), is saved in
    ``state_dict`` (a resumed run keeps it) and costs no host copy. In ``eval()`` mode it is used
    but not updated. Each process updates its own state from the batches it sees (no collective
    call): under data parallelism the states differ between processes.

    Args:
      decay: :math:`\gamma`, the weight of the past, in [0, 1).
      init: coefficient used before any batch has been seen (1.0 gives k3).

    Example:
      >>> ema = AlphaEMA(decay=0.9)
      >>> logp, logp_ref = torch.randn(64).clamp(max=0), torch.randn(64).clamp(max=0)
      >>> kl = klest.cv(logp, logp_ref, alpha=ema)  # uses init = 1.0, then learns
      >>> float(ema.alpha) != 1.0
      True
    """

    moments: Tensor
    weight: Tensor

    def __init__(self, *, decay: float = 0.9, init: float = 1.0) -> None:
        super().__init__()
        self.decay = check_decay(decay)
        self.init = float(init)
        self.register_buffer("moments", torch.zeros(4, dtype=torch.float64))
        self.register_buffer("weight", torch.zeros((), dtype=torch.float64))

    @property
    def alpha(self) -> Tensor:
        """The coefficient the next batch will use (a float64 scalar tensor)."""
        ea, eb, eab, ebb = (self.moments / self.weight.clamp(min=1e-300)).unbind()
        var = ebb - eb * eb
        ok = (self.weight > 0) & (var > _VAR_RTOL * ebb)
        return torch.where(ok, -(eab - ea * eb) / torch.where(ok, var, 1.0), self.init)

    def forward(self, a: Tensor, b: Tensor, valid: Tensor) -> Tensor:
        """The coefficient for this batch, then fold the batch (as in :func:`fit_alpha`) in."""
        if self.moments.device != a.device:
            self.to(a.device)
        coef = self.alpha
        if not self.training:  # eval(): use the state, do not update it
            return coef
        with torch.no_grad():
            a, b = a.detach().double(), b.detach().double()
            keep = valid & torch.isfinite(a) & torch.isfinite(b)
            a, b = torch.where(keep, a, 0.0), torch.where(keep, b, 0.0)
            n = keep.sum().double()
            batch = torch.stack([a.sum(), b.sum(), (a * b).sum(), (b * b).sum()]) / n.clamp(min=1)
            seen = n > 0
            g = self.decay
            self.moments.copy_(torch.where(seen, g * self.moments + (1 - g) * batch, self.moments))
            self.weight.copy_(torch.where(seen, g * self.weight + (1 - g), self.weight))
        return coef

    def _apply(self, fn, recurse=True):
        # Follow .to(device), but keep float64 state (values too) when a model is cast.
        return super()._apply(keep_float64(fn), recurse)

    def extra_repr(self) -> str:
        return f"decay={self.decay}, init={self.init}"


Alpha = float | Tensor | AlphaFit | AlphaEMA
"""A control-variate coefficient: fixed (number, tensor), fitted (a name), or an AlphaEMA."""


def resolve_alpha(
    alpha: Alpha | None, lr: LogRatios, direction: str, keys: Tensor | None, checks: ValueChecks
) -> Tensor:
    """The coefficient as a tensor broadcastable to ``[rows, T]`` (detached when fitted)."""
    dtype, device = lr.delta.dtype, lr.delta.device
    if alpha is None:
        raise ValueError(
            "estimator 'cv' needs alpha: a number, a tensor, 'loo', 'crossfit', 'in-sample', "
            "or an AlphaEMA"
        )
    if isinstance(alpha, str | AlphaEMA):
        a = weighted(naive_term(lr.delta, direction), lr.log_w)
        b = weighted(control_term(lr.delta, direction), lr.log_w)
        if isinstance(alpha, AlphaEMA):
            return alpha(a, b, lr.valid_or_all()).to(dtype)
        return fit_alpha(a, b, lr.valid_or_all(), alpha, keys=keys).to(dtype).unsqueeze(-1)
    if isinstance(alpha, Tensor):
        alpha = alpha.detach().to(device=device, dtype=dtype)
        checks.add(
            ~torch.isfinite(alpha),
            lambda f: (
                f"alpha must be finite (a NaN or inf coefficient makes every value NaN); "
                f"it is not at {first_bad(f)}"
            ),
        )
        if alpha.numel() == 1:
            return alpha.reshape(())
        if alpha.shape != lr.layout.shape:
            raise ValueError(
                f"alpha has shape {tuple(alpha.shape)}; it must be a scalar or match the "
                f"estimate's per-element shape {tuple(lr.layout.shape)}"
            )
        return lr.layout.rows(alpha)
    if isinstance(alpha, int | float) and not isinstance(alpha, bool):
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha}")
        # A fill, not a copy from the host (which waits for the GPU).
        return torch.full((), float(alpha), dtype=dtype, device=device)
    raise TypeError(f"alpha must be a number, tensor, str or AlphaEMA, got {type(alpha).__name__}")
