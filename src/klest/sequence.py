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
    return torch.exp(cum if inclusive else cum - log_w.detach())


def first_token(valid: Tensor) -> Tensor:
    """Column of each row's first valid token, ``[rows]`` (0 for a row with none)."""
    return valid.to(torch.uint8).argmax(-1)


def align_left(x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Shift each row so that its first valid token is in column 0 (``[rows, T]``).

    Left- and right-padded layouts of one batch give the same result: per-position statistics
    (baselines) computed on it compare the t-th token of every completion. Returns the shifted
    values and validity (columns shifted in from past the end are invalid, value 0).
    """
    t = x.shape[-1]
    cols = torch.arange(t, device=x.device) + first_token(valid).unsqueeze(-1)
    inside = cols < t
    cols = cols.clamp(max=t - 1)
    keep = inside & valid.gather(-1, cols)
    return torch.where(keep, x.gather(-1, cols), 0.0), keep


def unalign(aligned: Tensor, valid: Tensor) -> Tensor:
    """Undo :func:`align_left`: each row's column ``c`` takes aligned column ``c - first``."""
    t = aligned.shape[-1]
    cols = torch.arange(t, device=aligned.device) - first_token(valid).unsqueeze(-1)
    back = aligned.gather(-1, cols.clamp(min=0))
    return torch.where(valid & (cols >= 0), back, 0.0)
