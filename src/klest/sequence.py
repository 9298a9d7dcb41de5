r"""Autoregressive sequences: sums from each token on, and prefix importance weights.

For a sequence :math:`y_1..y_T` with per-token log-ratios :math:`\rho_t` and scores
:math:`s_t = \nabla \log\pi(y_t|y_{<t})`, the gradient of the sequence KL(pi||ref) is

.. math:: \nabla KL(\pi\|ref) = E_\pi\Big[\sum_t s_t \sum_{u \ge t} \rho_u\Big]

(each token's score times the log-ratios from that token on: the "reward to go"), because a token
cannot change the log-ratios before it. Tensors here are ``[rows, T]`` with masked positions
already zeroed. Source: seed 002 ("On a few pitfalls in KL divergence gradient estimation for
RL", arXiv:2506.09477), DESIGN.md section 3.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sum_from_here(x: Tensor) -> Tensor:
    """``out[:, t] = sum_{u >= t} x[:, u]`` (reverse cumulative sum over tokens)."""
    return x.flip(-1).cumsum(-1).flip(-1)


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
