"""token_log_probs against float64 log_softmax (values and autograd), its memory, its errors."""

from __future__ import annotations

import pytest
import torch

from klest.logits.sampled_log_probs import token_log_probs
from klest.testbeds import make_generator
from tests._reference import assert_verbose_close
from tests._tolerance import assert_logits_values_close, rounding_tolerance


def reference(z: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float64 ``log_softmax(z / tau)`` at the tokens, 0 where the token is -100."""
    la = torch.log_softmax(z.double() / temperature, -1)
    picked = la.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(tokens >= 0, picked, 0.0)


def _case(dtype: torch.dtype, seed: int = 0):
    g = make_generator(seed)
    full = (3 * torch.randn(3, 9, 13, generator=g, dtype=torch.float64)).to(dtype)
    tokens = torch.randint(0, 13, (3, 5), generator=g)
    tokens[1, 3:] = -100
    tokens[2] = -100
    return full, tokens


def gradient_scale(z: torch.Tensor, tokens: torch.Tensor, temperature: float, weights):
    """Per entry, the size of what the gradient's arithmetic rounds: ``|w| / T`` times
    ``q (1 + |log q|)`` (the softmax, from logits less the log-sum-exp) plus the one-hot."""
    la = torch.log_softmax(z.detach().double() / temperature, -1)
    onehot = torch.nn.functional.one_hot(tokens.clamp(min=0), z.shape[-1])
    terms = la.exp() * (1 + la.abs()) + onehot
    return (
        torch.where((tokens >= 0)[..., None], terms, 0.0) * weights.abs()[..., None] / temperature
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("budget", [None, 4 * 13 * 2, 4 * 13 * 2 * 7])  # blocks: 1 row, 7 rows
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_and_gradient_match_float64_log_softmax(dtype, budget, temperature):
    """The math is float32 for bf16 logits (float64 for float64): a log-softmax, within a few
    roundings (16) of the row's logit scale; its gradient within 32 roundings of each entry's
    :func:`gradient_scale` (measured: at most 3.9), and for bf16 logits rounded to bf16 (2^-8
    of each entry)."""
    full, tokens = _case(dtype)
    full.requires_grad_(True)
    view = full[:, 2:7]  # a strided view along T, as a slice of a model's output
    logp = token_log_probs(view, tokens, temperature=temperature, memory_budget=budget)
    assert logp.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = reference(full.detach()[:, 2:7], tokens, temperature)
    view64 = full.detach()[:, 2:7]
    assert_logits_values_close(logp, want, view64, ulps=16, temperature=temperature)
    weights = torch.randn(3, 5, generator=make_generator(1), dtype=torch.float64)
    (grad,) = torch.autograd.grad((logp.double() * weights).sum(), full)
    assert grad.dtype == dtype
    z64 = full.detach().double().requires_grad_(True)
    (want_grad,) = torch.autograd.grad(
        (reference(z64[:, 2:7], tokens, temperature) * weights).sum(), z64
    )
    scale = torch.zeros_like(want_grad)
    scale[:, 2:7] = gradient_scale(view64, tokens, temperature, weights)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    atol = rounding_tolerance(want_grad, ulps=32, dtype=compute, scale=scale)
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    assert_verbose_close(grad, want_grad, atol=atol, rtol=rtol, what="gradient")
    assert float(grad[:, :2].abs().max()) == 0 and float(grad[:, 7:].abs().max()) == 0
    assert float(grad[2].abs().max()) == 0  # every token ignored: no gradient


def test_gradcheck_float64():
    z = torch.randn(2, 3, 4, generator=make_generator(2), dtype=torch.float64, requires_grad=True)
    tokens = torch.tensor([[0, 3, -100], [2, 2, 1]])
    assert torch.autograd.gradcheck(
        lambda x: token_log_probs(x, tokens, temperature=0.8, memory_budget=4 * 4 * 2), (z,)
    )


@pytest.mark.parametrize(
    ("lead", "tokens"),
    [((), torch.tensor(2)), ((4,), torch.tensor([0, 1, 2, 3])), ((2, 2, 3), None)],
)
def test_any_leading_shape(lead, tokens):
    g = make_generator(3)
    z = torch.randn(*lead, 5, generator=g, dtype=torch.float64)
    if tokens is None:
        tokens = torch.randint(0, 5, lead, generator=g)
    got = token_log_probs(z, tokens)
    assert got.shape == lead
    assert_verbose_close(got, reference(z, tokens, 1.0), atol=1e-14)


def test_no_positions():
    z = torch.randn(2, 0, 5, requires_grad=True)
    logp = token_log_probs(z, torch.zeros(2, 0, dtype=torch.long))
    assert logp.shape == (2, 0)
    logp.sum().backward()
    assert z.grad is not None and z.grad.shape == z.shape


def test_ignored_positions_may_hold_anything():
    z = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    z.data[0, 2] = float("nan")
    z.data[1, 0] = float("inf")
    tokens = torch.tensor([[1, 2, -100], [-100, 0, 3]])
    logp = token_log_probs(z, tokens)
    assert bool(torch.isfinite(logp).all())
    logp.sum().backward()
    assert bool(torch.isfinite(z.grad).all())
    assert float(z.grad[0, 2].abs().max()) == 0 and float(z.grad[1, 0].abs().max()) == 0


def _saved_bytes(fn) -> int:
    """Bytes of distinct storages autograd saves for the backward of ``fn()``."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_saves_no_float_copy_of_the_logits():
    """Saved for the backward: the bf16 logits themselves and a few numbers per position; the
    plain formula saves its float32 log-softmax, twice the bf16 logits' size."""
    z = torch.randn(4, 8, 512, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 512, (4, 8), generator=make_generator(4))
    ours = _saved_bytes(lambda: token_log_probs(z, tokens, temperature=0.7))
    plain = _saved_bytes(
        lambda: torch.log_softmax(z.float() / 0.7, -1).gather(-1, tokens[..., None])
    )
    logits_bytes = z.numel() * z.element_size()
    assert ours <= logits_bytes + 32 * z.shape[0] * z.shape[1], ours
    assert plain >= logits_bytes * 2, plain


def test_bad_input():
    z = torch.randn(2, 3, 5)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="logits must have a floating-point dtype"):
        token_log_probs(z.long(), tokens)
    with pytest.raises(TypeError, match="labels must hold integer ids"):
        token_log_probs(z, tokens.float())
    with pytest.raises(ValueError, match=r"labels has shape \(2, 2\)"):
        token_log_probs(z, tokens[:, :2])
    with pytest.raises(ValueError, match=r"outside \[0, 5\)"):
        token_log_probs(z, tokens + 5)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        token_log_probs(z, tokens, temperature=0.0)
    bad = z.clone()
    bad[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"no distribution .*first at index \(1, 2\)"):
        token_log_probs(bad, tokens)
    token_log_probs(bad, tokens, validate=False)  # no check, no error
    with pytest.raises(ValueError, match="V >= 1"):
        token_log_probs(torch.zeros(2, 0), torch.zeros(2, dtype=torch.long))
    for bad_index in (True, -100.0, "-100"):  # a bool is an int to Python, not an id
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            token_log_probs(z, tokens, ignore_index=bad_index)
