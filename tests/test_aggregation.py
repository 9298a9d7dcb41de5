"""Masks, reductions and levels against a slow, obviously correct Python reference.

The rule under test: a row with no valid token contributes nothing, means count only valid
tokens / non-empty rows, and an all-empty batch gives 0 with a zero gradient.
"""

from __future__ import annotations

import pytest
import torch

import klest
from klest.testbeds import make_generator
from tests._reference import random_log_probs, reduce_reference

REDUCTIONS = [
    "none",
    "per-sequence",
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "sum",
]


def random_case(shape, seed):
    g = make_generator(seed)
    values = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) > 0.4
    return values, mask


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 2, 6), (1, 9), (5, 1), (6, 2)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_aggregate_matches_slow_reference(shape, reduction):
    values, mask = random_case(shape, seed=sum(shape))
    if len(shape) >= 2:
        mask[0] = False  # an empty row, as a trainer's padding or truncation makes
    out = klest.aggregate(values, mask=mask, reduction=reduction)
    masked = torch.where(mask, values, 0.0)
    if reduction == "none":
        assert torch.equal(out, masked)
    elif reduction == "per-sequence":
        assert torch.equal(out, masked.sum(-1) if len(shape) >= 2 else masked)
    else:
        assert float(out) == pytest.approx(reduce_reference(values, mask, reduction), rel=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS[2:])
def test_an_all_empty_batch_gives_zero_with_a_zero_gradient(reduction):
    values = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = klest.aggregate(values, mask=torch.zeros(3, 4, dtype=torch.bool), reduction=reduction)
    (grad,) = torch.autograd.grad(out, [values])
    assert float(out.detach()) == 0.0 and float(grad.abs().max()) == 0.0


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_estimator_reduction_equals_aggregate_of_per_token_values(reduction):
    g = make_generator(1)
    logp, logp_ref = random_log_probs((4, 6), g), random_log_probs((4, 6), g)
    mask = torch.rand(4, 6, generator=g) > 0.5
    mask[1] = False
    per_token = klest.k3(logp, logp_ref, mask=mask, reduction="none")
    out = klest.k3(logp, logp_ref, mask=mask, reduction=reduction)
    assert torch.allclose(out, klest.aggregate(per_token, mask=mask, reduction=reduction))


def test_masked_positions_never_reach_value_or_gradient():
    logp = torch.tensor(
        [[-1.0, -2.0, float("nan")], [-0.5, float("-inf"), float("inf")]], requires_grad=True
    )
    logp_ref = torch.tensor([[-1.5, -1.0, float("inf")], [-0.7, float("nan"), -1.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    for estimator in ("k1", "k2", "k3", "abs"):
        for direction in ("pi||ref", "ref||pi"):
            logp.grad = None
            out = klest.kl_estimate(
                logp,
                logp_ref,
                estimator=estimator,
                direction=direction,
                mask=mask,
                reduction="seq-mean-token-sum",
            )
            out.backward()
            assert torch.isfinite(out)
            assert torch.isfinite(logp.grad).all()
            assert bool((logp.grad[~mask] == 0).all())


def test_float_and_int_masks_equal_bool_masks():
    values, mask = random_case((3, 4), seed=2)
    for m in (mask.float(), mask.long(), mask.to(torch.uint8)):
        assert torch.equal(
            klest.aggregate(values, mask=m, reduction="token-mean"),
            klest.aggregate(values, mask=mask, reduction="token-mean"),
        )


def test_sequence_level_applies_the_estimator_to_the_summed_log_ratio():
    g = make_generator(3)
    logp, logp_ref = random_log_probs((5, 4), g), random_log_probs((5, 4), g)
    mask = torch.rand(5, 4, generator=g) > 0.3
    mask[:, 0] = True
    seq_delta = ((logp - logp_ref) * mask).sum(-1)
    for direction in ("pi||ref", "ref||pi"):
        out = klest.k3(
            logp,
            logp_ref,
            mask=mask,
            level="sequence",
            direction=direction,
            reduction="per-sequence",
        )
        expected = klest.k3(
            seq_delta.clamp(max=0),
            (-seq_delta).clamp(max=0),
            direction=direction,
            reduction="none",
        )
        assert out.shape == (5,)
        assert torch.allclose(out, expected, rtol=1e-12)
        mean = klest.k3(
            logp,
            logp_ref,
            mask=mask,
            level="sequence",
            direction=direction,
            reduction="seq-mean-token-sum",
        )
        assert float(mean) == pytest.approx(float(expected.mean()), rel=1e-12)


def test_one_dimensional_input_is_independent_samples():
    values = torch.tensor([1.0, 2.0, 6.0])
    for reduction in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert float(klest.aggregate(values, reduction=reduction)) == pytest.approx(3.0)
    assert float(klest.aggregate(values, reduction="sum")) == 9.0


def test_per_row_fitted_alpha_with_mask_matches_masked_out_rows_dropped():
    """Masked tokens must not enter the alpha fit: padding a row changes nothing."""
    g = make_generator(4)
    logp, logp_ref = random_log_probs((6, 3), g), random_log_probs((6, 3), g)
    pad_p = torch.cat([logp, torch.randn(6, 2, generator=g, dtype=torch.float64)], 1)
    pad_r = torch.cat([logp_ref, torch.randn(6, 2, generator=g, dtype=torch.float64)], 1)
    mask = torch.cat([torch.ones(6, 3), torch.zeros(6, 2)], 1).bool()
    a = klest.cv(logp, logp_ref, alpha="loo", reduction="seq-mean-token-sum")
    b = klest.cv(pad_p, pad_r, alpha="loo", mask=mask, reduction="seq-mean-token-sum")
    assert float(a) == pytest.approx(float(b), rel=1e-12)
