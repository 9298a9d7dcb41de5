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


def sum_from_here(x: Tensor) -> Tensor:
    """``out[:, t] = sum_{u >= t} x[:, u]`` (reverse cumulative sum over tokens), as the row total
    minus the sum before t: two flips would cost more than the sum (absolute error a few ulps of
    the row's partial sums)."""
    return x.sum(-1, keepdim=True) - (x.cumsum(-1) - x)


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
    return valid.view(torch.uint8).argmax(-1)  # a view: bool and uint8 share a layout


def roll_rows(x: Tensor, shift: Tensor) -> Tensor:
    """Roll row ``r`` of ``x`` ``[rows, T]`` left by ``shift[r]`` (in ``[0, T)``).

    Each row of the result is a window of the row written twice (``unfold``), so only whole rows
    are copied: no per-element index.
    """
    if x.shape[-1] == 0:
        return x
    doubled = torch.cat([x, x], -1)
    windows = doubled.unfold(-1, x.shape[-1], 1)  # [rows, T + 1, T], a view
    return windows[torch.arange(x.shape[0], device=x.device), shift]


def align_left(x: Tensor, valid: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
    """Roll each row so that its first valid token is in column 0 (``[rows, T]``).

    Left- and right-padded layouts of one batch give the same result: per-position statistics
    (baselines) computed on it compare the t-th token of every completion. The columns rolled in
    past a row's end are its leading padding, so they stay invalid. Returns the rolled values and
    validity (values at invalid positions are ``x``'s own: pass ``x`` masked). ``first`` is
    :func:`first_token` of ``valid``.
    """
    return roll_rows(x, first), roll_rows(valid, first)


def unalign(aligned: Tensor, first: Tensor) -> Tensor:
    """Undo :func:`align_left`: each row's column ``c`` takes aligned column ``c - first``."""
    t = aligned.shape[-1]
    return roll_rows(aligned, (t - first) % max(t, 1))
