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

from klest._autodiff import transforms_active


def sum_from_here(x: Tensor) -> Tensor:
    """``out[:, t] = sum_{u >= t} x[:, u]`` (reverse cumulative sum over tokens), as the row total
    minus the sum before t: two flips would cost more than the sum (absolute error a few ulps of
    the row's partial sums). One new tensor: the rest is done in place on the cumulative sum."""
    before = x.cumsum(-1).sub_(x)
    return before.neg_().add_(x.sum(-1, keepdim=True))


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
    t = valid.shape[-1]
    if t == 0:
        return torch.zeros(valid.shape[:-1], dtype=torch.int64, device=valid.device)
    # The largest T - column over the valid columns is T - first (0 for an empty row). Integer
    # products and a max reduce are several times faster than argmax over bools on the CPU.
    dtype = torch.int16 if t < 2**15 else torch.int32  # narrower: less memory to write
    to_end = torch.arange(t, 0, -1, dtype=dtype, device=valid.device)
    return (t - (valid.view(torch.uint8) * to_end).amax(-1)).remainder_(t).long()


class ShiftBuffer:
    """Rows ``[rows, T]`` laid out between blocks of T zeros, to shift each row by its own offset.

    The flat buffer is ``0 | row 0 | 0 | row 1 | ... | row R-1 | 0`` (each block T long), so
    row r shifted left by ``s`` (zeros shifted in at the end) is the T values from
    ``row r``'s column ``s`` on, and shifted right by ``s`` (zeros shifted in at the start) the
    T values ending ``s`` before its end: windows of one flat view (``unfold``), picked with an
    ``index_select`` of whole rows (contiguous copies; about 2x faster than advanced indexing
    on the CPU). Write the rows into :attr:`data` in place; it can be rewritten between shifts.
    """

    def __init__(self, rows: int, t: int, *, like: Tensor) -> None:
        self.rows, self.t = rows, t
        self.flat = like.new_empty((2 * rows + 1) * t)
        blocks = self.flat.view(2 * rows + 1, t)
        blocks[0::2].zero_()
        self.data = blocks[1::2]  # [rows, T], a view
        # Where each row's data starts in the flat buffer, and every T-long window of it.
        self._windows_view = self._starts = None
        if rows and t:
            self._starts = torch.arange(t, (2 * rows + 1) * t, 2 * t, device=self.flat.device)
            self._windows_view = self.flat.unfold(0, t, 1)

    def shifted_left(self, shift: Tensor, *, out: Tensor | None = None) -> Tensor:
        """Row r's values from column ``shift[r]`` on, then zeros: ``[rows, T]`` (written into
        ``out`` when given: any ``[rows, T]`` tensor of the dtype, a strided view too)."""
        return self._windows(shift, out)

    def shifted_right(self, shift: Tensor) -> Tensor:
        """``shift[r]`` zeros, then row r's first ``T - shift[r]`` values: ``[rows, T]``."""
        return self._windows(-shift)

    def _windows(self, offset: Tensor, out: Tensor | None = None) -> Tensor:
        if self._windows_view is None or self._starts is None:
            return self.data.clone() if out is None else out.copy_(self.data)
        if out is None:
            return self._windows_view.index_select(0, self._starts + offset)
        if transforms_active():  # out= into a strided view: neither traced nor batched
            return out.copy_(self._windows_view.index_select(0, self._starts + offset))
        return torch.index_select(self._windows_view, 0, self._starts + offset, out=out)


def align_left(x: Tensor, valid: Tensor, first: Tensor) -> tuple[Tensor, Tensor]:
    """Shift each row left so that its first valid token is in column 0 (``[rows, T]``).

    Left- and right-padded layouts of one batch give the same result: per-position statistics
    (baselines) computed on it compare the t-th token of every completion. The columns shifted
    in past a row's end are invalid and 0. Returns the shifted values and validity. ``first`` is
    :func:`first_token` of ``valid``.
    """
    rows, t = x.shape
    values, flags = ShiftBuffer(rows, t, like=x), ShiftBuffer(rows, t, like=valid)
    values.data.copy_(x)
    flags.data.copy_(valid)
    return values.shifted_left(first), flags.shifted_left(first)


def unalign(aligned: Tensor, first: Tensor) -> Tensor:
    """Undo :func:`align_left`: each row's column ``c`` takes aligned column ``c - first`` (0
    for ``c < first``, the row's leading padding)."""
    out = ShiftBuffer(*aligned.shape, like=aligned)
    out.data.copy_(aligned)
    return out.shifted_right(first)
