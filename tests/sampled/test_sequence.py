"""Sums from each token on, prefix weights and first-token alignment, against Python loops."""

from __future__ import annotations

import torch

from klest.sampled.sequence import (
    align_left,
    first_token,
    prefix_weights,
    sum_after,
    sum_from_here,
    unalign,
)
from klest.testbeds import make_generator


def test_suffix_sums_match_loops():
    x = torch.randn(3, 5, generator=make_generator(1), dtype=torch.float64)
    for i in range(3):
        for t in range(5):
            assert abs(float(sum_from_here(x)[i, t]) - float(x[i, t:].sum())) <= 1e-14
            assert abs(float(sum_after(x)[i, t]) - float(x[i, t + 1 :].sum())) <= 1e-14


def test_prefix_weights_are_products_of_the_weights_so_far():
    log_w = torch.randn(2, 4, generator=make_generator(2), dtype=torch.float64)
    incl, excl = prefix_weights(log_w, inclusive=True), prefix_weights(log_w, inclusive=False)
    for i in range(2):
        for t in range(4):
            assert abs(float(incl[i, t]) - float(log_w[i, : t + 1].exp().prod())) <= 1e-12
            assert abs(float(excl[i, t]) - float(log_w[i, :t].exp().prod())) <= 1e-12
    assert prefix_weights(None, inclusive=True) == 1.0
    assert not prefix_weights(log_w.requires_grad_(), inclusive=True).requires_grad


def test_alignment_at_the_first_valid_token_round_trips():
    valid = torch.tensor(
        [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 1, 1]], dtype=torch.bool
    )
    x = torch.arange(20, dtype=torch.float64).reshape(4, 5) + 1
    assert first_token(valid).tolist() == [2, 0, 0, 1]
    first = first_token(valid)
    rolled, aligned_valid = align_left(x, valid, first)
    aligned = torch.where(aligned_valid, rolled, 0.0)
    assert aligned.tolist()[0] == [3, 4, 5, 0, 0] and aligned.tolist()[1] == [6, 7, 8, 0, 0]
    assert aligned.tolist()[3] == [17, 0, 19, 20, 0]  # a hole stays a hole
    assert aligned_valid.sum(-1).tolist() == valid.sum(-1).tolist()
    assert torch.equal(torch.where(valid, unalign(rolled, first), 0.0), torch.where(valid, x, 0.0))


def test_first_token_is_the_first_true_column_or_0_for_an_empty_row():
    g = make_generator(4)
    for t in (1, 7, 2**15 + 3):  # int16 positions below 2^15 columns, int32 above
        valid = torch.rand(6, t, generator=g) > 0.7
        valid[0] = False
        valid[1, : t // 2] = False
        expected = [row.nonzero()[0].item() if row.any() else 0 for row in valid]
        assert first_token(valid).tolist() == expected


def test_align_left_and_unalign_shift_each_row_with_zeros_shifted_in():
    """align_left moves row r left by its first valid column s, zeros shifted in at the end;
    unalign moves it right by s, zeros shifted in at the start (a loop over rows as reference),
    values, validity and the gradient through the shift."""
    x = torch.arange(1.0, 25.0, dtype=torch.float64).reshape(4, 6).requires_grad_()
    valid = torch.zeros(4, 6, dtype=torch.bool)
    for r, s in enumerate([0, 1, 5, 6]):  # 6: an empty row, whose first token is column 0
        valid[r, s:] = True
    first = first_token(valid)
    assert first.tolist() == [0, 1, 5, 0]
    left, left_valid = align_left(x, valid, first)
    right = unalign(x, first)
    for r in range(4):
        s = int(first[r])
        assert left[r].tolist() == x[r, s:].tolist() + [0.0] * s
        assert left_valid[r].tolist() == valid[r, s:].tolist() + [False] * s
        assert right[r].tolist() == [0.0] * s + x[r, : 6 - s].tolist()
    (grad,) = torch.autograd.grad(left.sum(), x)
    assert torch.equal(grad, (torch.arange(6) >= first.unsqueeze(1)).double())
    no_rows = torch.zeros(0, 6)
    assert align_left(no_rows, no_rows.bool(), first[:0])[0].shape == (0, 6)
    assert unalign(torch.zeros(3, 0), first[:3]).shape == (3, 0)
