"""``position_kls=``: the exact per-position KLs given directly (e.g. from the fused LM heads).

The reference is the logits path: ``kl_penalty(..., logits=, logits_ref=)`` on the materialized
logits of the same heads, which is itself tested against brute-force sums elsewhere.
"""

from __future__ import annotations

import pytest
import torch

import klest

B, T, H, V = 4, 5, 6, 11


def _heads_and_samples(seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    h_ref = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    w_ref = torch.randn(V, H, generator=g, dtype=torch.float64)
    logits = h @ w.T
    tokens = torch.multinomial(logits.detach().softmax(-1).reshape(-1, V), 1, generator=g).reshape(
        B, T
    )
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False  # right padding
    mask[2, :2] = False  # left padding
    mask[3] = False  # an empty row
    return h, h_ref, w, w_ref, tokens, mask


def _log_probs(logits, tokens):
    return logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]


@pytest.mark.parametrize("direction", ["pi||ref", "ref||pi"])
@pytest.mark.parametrize("estimator", ["rb", "k3"])
def test_kls_from_hidden_give_the_logits_paths_loss_and_gradient(direction, estimator):
    h, h_ref, w, w_ref, tokens, mask = _heads_and_samples(0)
    group = torch.tensor([0, 0, 1, 1])

    def loss_and_grad(**exact):
        logits = h @ w.T
        logp = _log_probs(logits, tokens)
        logp_ref = _log_probs(h_ref @ w_ref.T, tokens)
        if "position_kls" in exact:
            exact = {
                "position_kls": klest.kl_from_hidden(
                    h, w, h_ref, w_ref, mask=mask, direction=direction, reduction="none"
                )
            }
        else:
            exact = {"logits": logits, "logits_ref": h_ref @ w_ref.T}
        loss = klest.kl_penalty(
            logp,
            logp_ref,
            mask=mask,
            estimator=estimator,
            grad="rb",
            baseline="loo" if direction == "pi||ref" else None,
            group=group,
            direction=direction,
            **exact,
        )
        (grad,) = torch.autograd.grad(loss, w)
        return loss.detach(), grad

    loss, grad = loss_and_grad(position_kls=True)
    loss_ref, grad_ref = loss_and_grad(logits=True)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)


def test_kl_estimate_rb_with_position_kls_is_their_masked_sum():
    h, h_ref, w, w_ref, tokens, mask = _heads_and_samples(1)
    kls = klest.kl_from_hidden(h, w, h_ref, w_ref, mask=mask, reduction="none").detach()
    logp = _log_probs(h @ w.T, tokens).detach()
    logp_ref = _log_probs(h_ref @ w_ref.T, tokens)
    value = klest.kl_estimate(
        logp, logp_ref, mask=mask, estimator="rb", position_kls=kls, reduction="per-sequence"
    )
    torch.testing.assert_close(value, torch.where(mask, kls, 0.0).sum(-1))


def test_position_kls_errors_name_the_argument():
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    kls = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="position_kls"):
        klest.kl_penalty(logp, logp, grad="rb", position_kls=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="either position_kls or logits"):
        klest.kl_penalty(
            logp,
            logp,
            grad="rb",
            position_kls=kls,
            logits=torch.zeros(2, 3, 5),
            logits_ref=torch.zeros(2, 3, 5),
        )
    with pytest.raises(ValueError, match="position_kls is NaN or infinite"):
        klest.kl_penalty(logp, logp, grad="rb", position_kls=kls.fill_(float("nan")))
    with pytest.raises(ValueError, match="apply only to estimator='rb'"):
        klest.kl_estimate(logp, logp, estimator="k3", position_kls=torch.zeros(2, 3))
    # Masked positions may hold anything: they are not read.
    bad_at_padding = torch.zeros(2, 3)
    bad_at_padding[0, 2] = float("nan")
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss = klest.kl_penalty(logp, logp, mask=mask, grad="rb", position_kls=bad_at_padding)
    assert torch.isfinite(loss)
