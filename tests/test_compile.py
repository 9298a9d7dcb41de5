"""klest's sampled-token path under ``torch.compile``: with validation off it compiles as one graph
(``fullgraph=True``: no graph break), and compiled calls give eager's values and gradients; with
validation on the checks' one host read breaks the graph there, and bad input still raises.

The padding layouts of a real trainer's batch are all here: a right-padded row, a left-padded
row, an empty row, and a group of one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import klest

B, T = 4, 6


def _batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(11)
    logp, logp_ref, logp_behavior = (
        -3.0 * torch.rand(B, T, generator=g, dtype=torch.float64) for _ in range(3)
    )
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False  # right padding
    mask[2, :2] = False  # left padding
    mask[3] = False  # an empty row
    group = torch.tensor([0, 0, 1, 2])  # group 1 holds one sample with tokens
    return logp, logp_ref, logp_behavior, mask, group


LP, LR, LB, MASK, GROUP = _batch()

CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "kl_penalty k3 cumulative loo": lambda lp: klest.kl_penalty(
        lp, LR, mask=MASK, baseline="loo", group=GROUP, validate=False
    ),
    "kl_penalty k1 score mean, off-policy": lambda lp: klest.kl_penalty(
        lp,
        LR,
        estimator="k1",
        grad="score",
        baseline="mean",
        group=GROUP,
        logp_behavior=LB,
        mask=MASK,
        reduction="none",
        validate=False,
    ),
    "kl_penalty ref||pi": lambda lp: klest.kl_penalty(
        lp, LR, direction="ref||pi", grad="score", mask=MASK, validate=False
    ),
    "kl_estimate cv loo sequence": lambda lp: klest.kl_estimate(
        lp,
        LR,
        estimator="cv",
        alpha="loo",
        group=GROUP,
        level="sequence",
        mask=MASK,
        validate=False,
    ),
    "k1": lambda lp: klest.k1(lp, LR, mask=MASK, validate=False),
    "k2": lambda lp: klest.k2(lp, LR, mask=MASK, validate=False),
    "k3": lambda lp: klest.k3(lp, LR, mask=MASK, validate=False),
    "cv": lambda lp: klest.cv(lp, LR, alpha=0.7, mask=MASK, validate=False),
    "kl_reward": lambda lp: klest.kl_reward(lp, LR, mask=MASK, validate=False) * lp,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_in_one_graph_equals_eager(name):
    fn = CASES[name]
    lp = LP.clone().requires_grad_()
    eager = fn(lp)
    (eager_grad,) = torch.autograd.grad(eager.sum(), lp)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)  # raises at any graph break
    lp = LP.clone().requires_grad_()
    out = compiled(lp)
    (grad,) = torch.autograd.grad(out.sum(), lp)
    # float64, the same operations reordered by the compiler: agreement to rounding.
    torch.testing.assert_close(out, eager, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, eager_grad, rtol=1e-12, atol=1e-12)
    assert float(eager_grad[3].abs().sum()) == 0.0  # the empty row gets no gradient


def test_validated_calls_compile_and_still_refuse_bad_input():
    def loss(lp, lr):
        return klest.kl_penalty(lp, lr, mask=MASK, baseline="loo", group=GROUP)

    torch._dynamo.reset()
    compiled = torch.compile(loss)
    lp = LP.clone().requires_grad_()
    out = compiled(lp, LR)
    torch.testing.assert_close(out, loss(LP.clone().requires_grad_(), LR), rtol=1e-12, atol=0.0)
    with pytest.raises(ValueError, match="logp_ref has values above 0"):
        compiled(lp, -LR)
