"""What the divergences' docstrings state beyond their values, each checked against an
independent answer: TV is symmetric, bounded by Pinsker, and has gradient 0 at pi = ref; the
JSD is at most the binary entropy h(beta) and is the beta-weighted sum of the two skew KLs; the
skew KL at alpha = 0 is the KL in the direction asked for; the details of a JSD strictly
between its ends carry no gradient. float64 inputs: two computations of one value agree within
``VALUE_ULPS`` roundings of the row's logit scale (as in test_jsd.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from klest.logits import jsd_from_logits, kl_from_logits, skew_kl_from_logits, tv_from_logits
from tests._tolerance import assert_logits_values_close

VALUE_ULPS = 16


def _logits(shape, scale=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))


def test_tv_is_symmetric_in_value_and_gradient():
    """TV(pi, ref) = TV(ref, pi); swapping the arguments swaps the two gradients."""
    z, y = _logits((4, 9))
    zz, yy = z.clone().requires_grad_(), y.clone().requires_grad_()
    a = tv_from_logits(zz, yy, reduction="none", temperature=0.8)
    b = tv_from_logits(yy, zz, reduction="none", temperature=0.8)
    assert_logits_values_close(a, b, z, y, ulps=VALUE_ULPS, temperature=0.8)
    w = torch.arange(1.0, 5.0, dtype=torch.float64)
    ga = torch.autograd.grad((a * w).sum(), (zz, yy))
    gb = torch.autograd.grad((b * w).sum(), (zz, yy))
    for g1, g2 in zip(ga, gb, strict=True):
        torch.testing.assert_close(g1, g2, rtol=0, atol=1e-14)


def test_tv_gradient_at_equal_distributions_is_zero():
    """At pi = ref (the same logits, one row with a -inf entry) every sign is 0: the returned
    (sub)gradient is exactly 0, the minimum, as is the value."""
    z, _ = _logits((3, 7))
    z[1, 2] = -math.inf
    zz, yy = z.clone().requires_grad_(), z.clone().requires_grad_()
    tv = tv_from_logits(zz, yy, reduction="sum", temperature=0.6)
    gz, gy = torch.autograd.grad(tv, (zz, yy))
    assert float(tv.detach()) == 0.0
    assert torch.count_nonzero(gz) == 0 and torch.count_nonzero(gy) == 0


def test_pinsker_bounds_tv_by_either_kl():
    """TV <= sqrt(KL / 2) for KL(pi||ref) and KL(ref||pi), row by row (from near-identical to
    nearly disjoint rows)."""
    for scale in (0.05, 1.0, 8.0):
        z, y = _logits((32, 11), scale=scale, seed=1)
        tv = tv_from_logits(z, y, reduction="none")
        for direction in ("pi||ref", "ref||pi"):
            kl = kl_from_logits(z, y, direction=direction, reduction="none")
            assert (tv <= (kl / 2).sqrt() + 1e-12).all(), (scale, direction)


@pytest.mark.parametrize("beta", [0.1, 0.3, 0.8])
def test_jsd_is_at_most_the_binary_entropy_of_beta(beta):
    """JSD_beta <= h(beta) = -beta log beta - (1 - beta) log(1 - beta), approached by nearly
    disjoint rows (h(beta) < log 2 away from beta = 1/2)."""
    z, y = _logits((64, 20), scale=30.0, seed=2)
    jsd = jsd_from_logits(z, y, beta=beta, reduction="none")
    h = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
    assert (jsd >= 0).all() and (jsd <= h + 1e-12).all()
    assert float(jsd.max()) > 0.9 * h


@pytest.mark.parametrize("beta", [0.2, 0.5, 0.7])
def test_jsd_is_the_weighted_sum_of_the_two_skew_kls(beta):
    """JSD_beta = beta KL(ref || beta ref + (1 - beta) pi) + (1 - beta) KL(pi || m): the
    "ref||pi" skew KL at alpha = beta and the "pi||ref" one at alpha = 1 - beta."""
    z, y = _logits((5, 13), seed=3)
    jsd = jsd_from_logits(z, y, beta=beta, reduction="none", temperature=1.3)
    ref_side = skew_kl_from_logits(
        z, y, alpha=beta, direction="ref||pi", reduction="none", temperature=1.3
    )
    pi_side = skew_kl_from_logits(
        z, y, alpha=1 - beta, direction="pi||ref", reduction="none", temperature=1.3
    )
    both = beta * ref_side + (1 - beta) * pi_side
    assert_logits_values_close(jsd, both, z, y, ulps=2 * VALUE_ULPS, temperature=1.3)


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
def test_skew_kl_at_alpha_zero_is_the_kl_in_its_direction(direction):
    z, y = _logits((4, 6), seed=4)
    got = skew_kl_from_logits(z, y, alpha=0.0, direction=direction, reduction="none")
    want = kl_from_logits(z, y, direction=direction, reduction="none")
    other = kl_from_logits(
        z, y, direction="ref||pi" if direction == "pi||ref" else "pi||ref", reduction="none"
    )
    assert torch.equal(got, want)
    assert not torch.allclose(got, other)


def test_jsd_details_between_the_ends_carry_no_gradient():
    """return_details for 0 < beta < 1: label log-probs and entropy without a graph (at the
    ends, the KL's details, which do carry one)."""
    z, y = _logits((2, 3, 8), seed=5)
    zz = z.clone().requires_grad_()
    labels = torch.tensor([[1, 2, 3], [4, 5, -100]])
    _, d = jsd_from_logits(zz, y, beta=0.4, labels=labels, return_details=True)
    assert not d.logp.requires_grad and not d.entropy.requires_grad
    _, d_end = jsd_from_logits(zz, y, beta=1.0, labels=labels, return_details=True)
    assert d_end.logp.requires_grad
