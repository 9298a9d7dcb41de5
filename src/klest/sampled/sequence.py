r"""Autoregressive sequences: sums from each token on, prefix weights, first-token alignment.

For a sequence :math:`y_1..y_T` with per-token log-ratios :math:`\rho_t` and scores
:math:`s_t = \nabla \log\pi(y_t|y_{<t})`, the gradient of the sequence KL(pi||ref) is

.. math:: \nabla KL(\pi\|ref) = E_\pi\Big[\sum_t s_t \sum_{u \ge t} \rho_u\Big]

(each token's score times the log-ratios from that token on: the "reward to go"), because a token
cannot change the log-ratios before it. Tensors here are ``[rows, T]`` with masked positions
already zeroed.

See "On a few pitfalls in KL divergence gradient estimation for RL" by Yunhao Tang and Rémi Munos
(2025, https://arxiv.org/abs/2506.09477).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "align_left",
    "discounted_sum_from_here",
    "first_token",
    "prefix_weights",
    "sum_after",
    "sum_from_here",
    "unalign",
]


def sum_from_here(x: Tensor) -> Tensor:
    """``out[:, t] = sum_{u >= t} x[:, u]`` (reverse cumulative sum over tokens), as the row total
    minus the sum before t (absolute error a few ulps of the row's partial sums)."""
    return x.sum(-1, keepdim=True) - (x.cumsum(-1) - x)


# Columns per block of the discounted scan: a [K, K] matrix of discount powers per block.
_BLOCK = 64


def discounted_sum_from_here(x: Tensor, discount: float) -> Tensor:
    r"""``out[:, t] = sum_{u >= t} discount^(u - t) x[:, u]`` for ``x`` ``[rows, T]``
    (``discount`` in [0, 1]; 0: ``x`` itself, 1: :func:`sum_from_here`).

    Block by block from the end: within a block of K columns a ``[K, K]`` matrix of powers
    :math:`\gamma^{u-t}` (``u >= t``, all at most 1: no overflow), and each block adds
    :math:`\gamma^{e-t}` times the first column of the block after it (starting at e).
    """
    rows, t_len = x.shape
    out = torch.empty_like(x)
    k = min(_BLOCK, t_len)
    if k == 0:
        return out
    steps = torch.arange(k, device=x.device)
    gap = steps.unsqueeze(0) - steps.unsqueeze(1)  # [t, u] -> u - t
    powers = torch.where(gap >= 0, discount ** gap.clamp(min=0).to(x.dtype), 0.0)
    carry = x.new_zeros(rows)  # out[:, e]: the first column after the block
    for end in range(t_len, 0, -k):
        start = max(end - k, 0)
        n = end - start
        block = x[:, start:end] @ powers[:n, :n].T  # [rows, n]
        block += carry.unsqueeze(1) * discount ** (n - steps[:n]).to(x.dtype)
        out[:, start:end] = block
        carry = block[:, 0]
    return out


def sum_after(x: Tensor) -> Tensor:
    """``out[:, t] = sum_{u > t} x[:, u]``."""
    return sum_from_here(x) - x


def prefix_weights(log_w: Tensor | None, *, inclusive: bool) -> Tensor | float:
    r"""Detached prefix importance weights :math:`W_{\le t}` (or :math:`W_{<t}`) from log-weights.

    ``log_w[:, t] = log pi(y_t|y_{<t}) - log behavior(y_t|y_{<t})``; on-policy (``None``) every
    weight is 1 and the float ``1.0`` is returned.
    """
    if log_w is None:
        return 1.0
    cum = log_w.detach().cumsum(-1)
    if not inclusive:  # shifted, not cum - log_w: a -inf log-weight would give -inf - -inf
        cum = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], -1)
    return torch.exp(cum)


def first_token(valid: Tensor) -> Tensor:
    """Column of each row's first valid token, ``[rows]`` (0 for a row with none)."""
    if valid.shape[-1] == 0:
        return torch.zeros(valid.shape[:-1], dtype=torch.int64, device=valid.device)
    return valid.to(torch.uint8).argmax(-1)  # argmax gives the first of equal maxima


def _shift(shift: Tensor, t: int) -> tuple[Tensor, Tensor]:
    """For rows shifted left by ``shift`` ``[rows]``: the source column of each column
    (clamped into the row) and whether it lies inside the row, ``[rows, T]`` each."""
    source = torch.arange(t, device=shift.device) + shift.unsqueeze(-1)
    inside = (source >= 0) & (source < t)
    return source.clamp_(0, max(t - 1, 0)), inside


def _take(x: Tensor, source: Tensor, inside: Tensor) -> Tensor:
    """``x``'s columns ``source``, 0 (False) where not ``inside``."""
    return torch.where(
        inside, x.gather(-1, source), torch.zeros((), dtype=x.dtype, device=x.device)
    )


def align_left(x: Tensor, valid: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
    """Shift each row left so that its first valid token is in column 0 (``[rows, T]``).

    Left- and right-padded layouts of one batch give the same result: per-position statistics
    (baselines) computed on it compare the t-th token of every completion. The columns shifted
    in past a row's end are invalid and 0. Returns the shifted values and validity. ``first`` is
    :func:`first_token` of ``valid``.
    """
    source, inside = _shift(first, x.shape[-1])
    return _take(x, source, inside), _take(valid, source, inside)


def unalign(aligned: Tensor, first: Tensor) -> Tensor:
    """Undo :func:`align_left`: each row's column ``c`` takes aligned column ``c - first`` (0
    for ``c < first``, the row's leading padding)."""
    return _take(aligned, *_shift(-first, aligned.shape[-1]))
