"""klest.integrations.verl: verl's kl_penalty and agg_loss, their values, gradients and install.

Values are compared with verl's formulas as written here from verl 0.9.1's math (float64, with
its clips); ``grad="peer"`` gradients with autograd of those formulas; klest's gradients with
autograd of the surrogates of ``tests/integrations/_peer_reference.py``; ``"full"`` with the
float64 reference of ``tests/_reference.py``; agg_loss with ``reduce_reference`` and the modes'
formulas. The last tests compare with the real verl (``requirements/peers.txt``, which ``make
test`` installs): its ``kl_penalty`` and ``agg_loss``, and its actor loss ``ppo_loss`` run with
klest installed into it; without verl they skip (``make test`` makes them fail instead).

Statistical tests (``tests/_stats.py``), on the "tabular" testbed with exact gradients by
enumeration: the z statistic of ``klest.audit.mean_shift_z`` (about N(0, 1) under the null,
large when the mean is off) of 600 gradients of batches of 8, against the mean the docstrings
state, one-sided at ``RATE`` (3.83, false-fail rate 6.3e-5 per test); where a test asserts a
mean is *not* some gradient, the z it measures is above 12 at the fixed seed (the threshold is
3.83), and the signal check of klest's gradients (z against 0) is above 20.
"""

from __future__ import annotations

import sys

import pytest
import torch

import klest
from klest.audit import gradient_draws, mean_shift_z
from klest.integrations import verl
from tests._reference import assert_verbose_close, logits_reference, reduce_reference
from tests._stats import RATE, z_for
from tests._testbeds import make
from tests._tolerance import assert_logits_values_close, rounding_tolerance
from tests.integrations._peer_reference import (
    exact_grads,
    flat_grad,
    rb_surrogate_reference,
    real_function,
    real_module,
    stand_in_module,
    surrogate_reference,
    two_leaves,
)

NAMES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
PLUS = [n + "+" for n in NAMES]
Z_ONE_SIDED = z_for(RATE, 1, two_sided=False)


def verl_formula(delta: torch.Tensor, name: str) -> torch.Tensor:
    """verl 0.9.1's per-token value at log-ratios ``delta = logprob - ref_logprob``, float64:
    k1 = delta, abs = |delta|, k2 = delta^2 / 2, k3 = clip(e^x - 1 - x, -10, 10) with
    x = clip(ref_logprob - logprob, -20, 20); a "+" suffix has the same value."""
    delta = delta.double()
    base = name.removesuffix("+")
    if base in ("kl", "k1"):
        return delta
    if base == "abs":
        return delta.abs()
    if base in ("mse", "k2"):
        return 0.5 * delta**2
    x = torch.clamp(-delta, -20.0, 20.0)
    return torch.clamp(torch.expm1(x) - x, -10.0, 10.0)


# The float64 reference's own rounding: expm1(x) - x cancels to about 2 eps |x| near x = 0.
REFERENCE_ROUNDING = 4 * torch.finfo(torch.float64).eps


def log_probs(shape, seed, dtype=torch.float64):
    """Log-prob pairs over a wide range, with the edge cases of verl's clips planted: a tiny
    log-ratio, and log-ratios past k3's clip of the value and of the log-ratio (both signs)."""
    g = torch.Generator().manual_seed(seed)
    lp = -3.0 * torch.rand(shape, generator=g, dtype=torch.float64)
    lr = -3.0 * torch.rand(shape, generator=g, dtype=torch.float64)
    flat_p, flat_r = lp.view(-1), lr.view(-1)
    edges = [(-0.5, -0.5 - 1e-6), (-0.01, -30.0), (-30.0, -0.01), (-0.2, -15.0), (-14.0, -0.3)]
    for i, (p, r) in enumerate(edges[: flat_p.numel()]):
        flat_p[i], flat_r[i] = p, r
    return lp.to(dtype), lr.to(dtype)


def row_mask(shape, seed):
    """A right-padded mask with one empty row (when there are rows)."""
    g = torch.Generator().manual_seed(seed)
    if len(shape) < 2:
        return torch.rand(shape, generator=g) > 0.3
    t = shape[-1]
    lengths = torch.randint(1, t + 1, shape[:-1], generator=g)
    lengths.view(-1)[-1] = 0
    return torch.arange(t) < lengths.unsqueeze(-1)


def reference_delta(lp, lr):
    """The log-ratio as verl forms it: in the inputs' dtype (bf16 inputs: exactly, as klest
    computes bf16 in float32 and the difference of two bf16 numbers is exact there)."""
    if lp.dtype == torch.bfloat16:
        return lp.double() - lr.double()
    return (lp - lr).double()


# -- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES + PLUS)
def test_values_are_verls_formulas(name, dtype):
    lp, lr = log_probs((5, 7), seed=1, dtype=dtype)
    mask = row_mask((5, 7), seed=2)
    out = verl.kl_penalty(lp, lr, name, mask=mask)
    delta = reference_delta(lp, lr)
    want = torch.where(mask, verl_formula(delta, name), 0.0)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol = 1e-13 if dtype == torch.float64 else 4e-7
    atol = REFERENCE_ROUNDING * delta.abs()
    assert_verbose_close(out, want, atol=atol, rtol=rtol, what=f"{name} {dtype}")


@pytest.mark.parametrize("shape", [(9,), (5, 7), (2, 3, 6)])
@pytest.mark.parametrize("name", ["k1", "low_var_kl"])
def test_values_for_every_layout(name, shape):
    lp, lr = log_probs(shape, seed=3)
    mask = row_mask(shape, seed=4)
    for m in (None, mask):
        out = verl.kl_penalty(lp, lr, name, mask=m)
        want = verl_formula(lp - lr, name)
        want = want if m is None else torch.where(m, want, 0.0)
        assert out.shape == shape
        atol = REFERENCE_ROUNDING * (lp - lr).abs()
        assert_verbose_close(out, want, atol=atol, rtol=1e-13, what=f"{name} {shape}")


def test_k3_is_never_negative_and_exact_near_zero_in_float32():
    """verl's exp(x) - x - 1 in float32 is rounding noise near 0 (and can be negative); klest's
    value is the float32 rounding of the exact one."""
    delta = torch.logspace(-7, -1, 50, dtype=torch.float64)
    delta = torch.cat([delta, -delta])
    lr = torch.full_like(delta, -1.0)
    lp = (lr + delta).float()
    out = verl.kl_penalty(lp, lr.float(), "k3")
    exact = verl_formula((lp.double() - lr.float().double()), "k3")
    assert bool((out >= 0).all())
    assert_verbose_close(out, exact, atol=1e-300, rtol=4e-7)


# -- gradients ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_peer_gradient_is_the_autodiff_of_verls_value(name):
    lp, lr = log_probs((5, 7), seed=5)
    mask = row_mask((5, 7), seed=6)
    a, b = two_leaves(lp)
    verl.kl_penalty(a, lr, name, mask=mask).sum().backward()
    torch.where(mask, verl_formula(b - lr, name), 0.0).sum().backward()
    assert_verbose_close(a.grad, b.grad, atol=1e-15, rtol=1e-12, what=name)


@pytest.mark.parametrize("name", ["k1", "abs", "k2", "k3"])
def test_peer_gradient_passes_gradcheck(name):
    """Away from the clips and from abs's kink (log-ratios in [-2, -0.1] and [0.1, 2])."""
    g = torch.Generator().manual_seed(7)
    lr = -1.0 - torch.rand(3, 4, generator=g, dtype=torch.float64)
    delta = (0.1 + 1.9 * torch.rand(3, 4, generator=g, dtype=torch.float64)) * torch.sign(
        torch.randn(3, 4, generator=g, dtype=torch.float64)
    )
    lp = (lr + delta).clamp(max=-0.01).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: verl.kl_penalty(x, lr, name), (lp,))


@pytest.mark.parametrize("name", PLUS)
def test_plus_variants_have_the_value_of_the_first_and_the_gradient_of_k2_exactly(name):
    lp, lr = log_probs((5, 7), seed=8)
    mask = row_mask((5, 7), seed=9)
    a, b = two_leaves(lp)
    out = verl.kl_penalty(a, lr, name, mask=mask)
    assert torch.equal(out, verl.kl_penalty(lp, lr, name.removesuffix("+"), mask=mask))
    out.sum().backward()
    torch.where(mask, 0.5 * (b - lr) ** 2, 0.0).sum().backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("grad", ["cumulative", "score"])
@pytest.mark.parametrize("name", NAMES)
def test_klest_gradient_keeps_verls_value_and_is_klests_surrogate(name, grad):
    lp, lr = log_probs((5, 7), seed=10)
    mask = row_mask((5, 7), seed=11)
    a, b = two_leaves(lp)
    out = verl.kl_penalty(a, lr, name, grad=grad, mask=mask)
    want = torch.where(mask, verl_formula(lp - lr, name), 0.0)
    assert_verbose_close(out, want, atol=REFERENCE_ROUNDING * (lp - lr).abs(), rtol=1e-13)
    out.sum().backward()
    surrogate_reference(b, lr, mask, grad).sum().backward()
    assert_verbose_close(a.grad, b.grad, atol=1e-14, rtol=1e-12, what=f"{name} {grad}")


@pytest.mark.parametrize("grad", ["cumulative", "score"])
def test_leave_one_out_baseline_within_groups(grad):
    lp, lr = log_probs((6, 5), seed=12)
    mask = row_mask((6, 5), seed=13)
    group = torch.tensor([0, 0, 0, 1, 1, 2])  # the last row alone in its group (and empty)
    a, b = two_leaves(lp)
    out = verl.kl_penalty(a, lr, "k3", grad=grad, mask=mask, baseline="loo", group=group)
    out.sum().backward()
    surrogate_reference(b, lr, mask, grad, loo_group=group.tolist()).sum().backward()
    assert_verbose_close(a.grad, b.grad, atol=1e-14, rtol=1e-12)


def test_off_policy_klest_gradient_uses_prefix_importance_weights():
    lp, lr = log_probs((4, 6), seed=14)
    lb, _ = log_probs((4, 6), seed=15)
    mask = row_mask((4, 6), seed=16)
    a, b = two_leaves(lp)
    verl.kl_penalty(a, lr, "k3", grad="cumulative", mask=mask, logp_behavior=lb).sum().backward()
    surrogate_reference(b, lr, mask, "cumulative", logp_behavior=lb).sum().backward()
    assert_verbose_close(a.grad, b.grad, atol=1e-14, rtol=1e-12)


def _logits_batch(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 5, 7, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(3, 5, 7, generator=g, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    return z, y, labels, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_full_is_the_exact_per_position_kl(dtype):
    z, y, _, mask = _logits_batch(17, dtype)
    zz = z.clone().requires_grad_(True)
    out = verl.kl_penalty(zz, y, "full", mask=mask)
    want = torch.where(mask, logits_reference(z, y)["kl_pi_ref"], 0.0)
    # the arithmetic's rounding (float32 for bf16 inputs, which the reference gets unchanged) at
    # the row's logit scale: a log-softmax and a sum over V = 7 (16 roundings)
    assert_logits_values_close(out, want, z, y, ulps=16)
    # verl's gradient: each position's own (autodiff of the exact per-position KLs)
    out.sum().backward()
    z64 = z.double().requires_grad_(True)
    torch.where(mask, logits_reference(z64, y)["kl_pi_ref"], 0.0).sum().backward()
    # q (log q - log p - KL) cancels at the row's scale: 16 roundings of the largest entry, then
    # the gradient's rounding to bf16 (half an ulp, 2^-8 of each entry)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    atol = rounding_tolerance(z64.grad, ulps=16, dtype=compute)
    rtol = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    assert_verbose_close(zz.grad, z64.grad, atol=atol, rtol=rtol, what="gradient")


@pytest.mark.parametrize("name", ["full", "k3"])
def test_rb_gradient_is_the_rao_blackwellized_surrogate(name):
    """``"full"`` + ``grad="rb"`` (logits as inputs, labels given) and k3 + ``grad="rb"``
    (sampled-token log-probs, logits given): the gradient of Sum_n KL_n + Sum_m log pi_m times
    the later KLs; the value stays verl's (the exact KL, or k3)."""
    z, y, labels, mask = _logits_batch(18)
    zz = z.clone().requires_grad_(True)
    if name == "full":
        out = verl.kl_penalty(zz, y, "full", grad="rb", labels=labels, mask=mask)
        want = logits_reference(z, y)["kl_pi_ref"]
    else:
        lp = torch.log_softmax(zz, -1).gather(-1, labels[..., None])[..., 0]
        lr = torch.log_softmax(y, -1).gather(-1, labels[..., None])[..., 0]
        out = verl.kl_penalty(lp, lr, "k3", grad="rb", mask=mask, logits=zz, logits_ref=y)
        want = verl_formula(lp.detach() - lr, "k3")
    assert_verbose_close(out, torch.where(mask, want, 0.0), atol=1e-300, rtol=1e-12)
    out.sum().backward()
    z64 = z.clone().requires_grad_(True)
    rb_surrogate_reference(z64, y, labels, mask).sum().backward()
    assert_verbose_close(zz.grad, z64.grad, atol=1e-14, rtol=1e-10)


def test_full_off_policy_keeps_the_unweighted_exact_kl():
    z, y, labels, mask = _logits_batch(19)
    lb = torch.log_softmax(torch.randn(3, 5, 7, dtype=torch.float64), -1)
    lb = lb.gather(-1, labels[..., None])[..., 0]
    zz = z.clone().requires_grad_(True)
    out = verl.kl_penalty(zz, y, "full", grad="cumulative", labels=labels, mask=mask,
                          logp_behavior=lb)  # fmt: skip
    want = torch.where(mask, logits_reference(z, y)["kl_pi_ref"], 0.0)
    assert_verbose_close(out, want, atol=1e-300, rtol=1e-12)
    out.sum().backward()
    assert bool(torch.isfinite(zz.grad).all()) and float(zz.grad.abs().sum()) > 0


# -- the contract: layouts, padding, dtypes, empty rows, bad input -----------------------------


@pytest.mark.parametrize("grad", ["peer", "cumulative", "score"])
def test_zero_padding_needs_no_mask(grad):
    """verl's padding holds log-probs 0 under both models: without a mask the values are the
    masked ones, and so are the gradients at the tokens (at the padding the unmasked gradient
    need not be 0, but verl's padding is a constant that passes no gradient to the model)."""
    lp, lr = log_probs((5, 7), seed=20)
    mask = row_mask((5, 7), seed=21)
    lp, lr = torch.where(mask, lp, 0.0), torch.where(mask, lr, 0.0)
    a, b = two_leaves(lp)
    out_a = verl.kl_penalty(a, lr, "k3", grad=grad)
    out_b = verl.kl_penalty(b, lr, "k3", grad=grad, mask=mask)
    assert torch.equal(out_a, out_b)
    out_a.sum().backward()
    out_b.sum().backward()
    assert_verbose_close(a.grad[mask], b.grad[mask], atol=1e-14, rtol=1e-12)


def test_left_and_right_padding_agree():
    lp, lr = log_probs((6, 5), seed=22)
    mask = row_mask((6, 5), seed=23)
    lengths = mask.sum(-1)
    shift = (5 - lengths).tolist()
    left = [torch.roll(x, s, -1) for x, s in zip(lp, shift, strict=True)]
    left_lp = torch.stack(left)
    left_lr = torch.stack([torch.roll(x, s, -1) for x, s in zip(lr, shift, strict=True)])
    left_mask = torch.stack([torch.roll(x, s, -1) for x, s in zip(mask, shift, strict=True)])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    grads, sums = [], []
    for x, y, m in ((lp, lr, mask), (left_lp, left_lr, left_mask)):
        x = x.clone().requires_grad_(True)
        out = verl.kl_penalty(x, y, "k3", grad="cumulative", mask=m, baseline="loo", group=group)
        sums.append(out.sum(-1).detach())
        out.sum().backward()
        grads.append(x.grad.sum(-1))
    assert_verbose_close(sums[0], sums[1], atol=1e-14, rtol=1e-12)
    assert_verbose_close(grads[0], grads[1], atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("grad", ["peer", "cumulative"])
def test_bf16_inputs_give_float32_and_a_bf16_gradient(grad):
    lp, lr = log_probs((4, 6), seed=24, dtype=torch.bfloat16)
    lp.requires_grad_(True)
    out = verl.kl_penalty(lp, lr, "k3", grad=grad)
    assert out.dtype == torch.float32
    verl.agg_loss(out, torch.ones(4, 6), "seq-mean-token-sum").backward()
    assert lp.grad.dtype == torch.bfloat16 and bool(torch.isfinite(lp.grad).all())


@pytest.mark.parametrize("grad", ["peer", "cumulative", "score"])
def test_empty_rows_and_an_empty_batch(grad):
    lp, lr = log_probs((3, 4), seed=25)
    lp.requires_grad_(True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = verl.kl_penalty(lp, lr, "k3", grad=grad, mask=mask)
    assert torch.equal(out, torch.zeros(3, 4, dtype=torch.float64))
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        loss = verl.agg_loss(out, mask, mode)
        assert float(loss.detach()) == 0.0
        (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
        assert torch.equal(g, torch.zeros_like(g))


def test_bad_input():
    lp, lr = log_probs((3, 4), seed=26)
    cases = [
        (dict(kl_penalty="kl3"), ValueError, "unknown kl_penalty"),
        (dict(kl_penalty="full+"), ValueError, "full\\+"),
        (dict(kl_penalty="k3+", grad="cumulative"), ValueError, "'\\+' suffix"),
        (dict(kl_penalty="k3", grad="token"), ValueError, "unknown grad"),
        (dict(kl_penalty="k3", baseline="loo"), ValueError, "baseline applies"),
        (dict(kl_penalty="k3", labels=torch.zeros(3, 4, dtype=torch.long)), ValueError, "labels"),
        (dict(kl_penalty="k3", grad="rb"), ValueError, "logits"),
        (dict(kl_penalty="k3", mask=torch.ones(3, 5)), ValueError, "mask has shape"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            verl.kl_penalty(lp, lr, **kwargs)
    with pytest.raises(ValueError, match="logprob has shape \\(3, 4\\) but ref_logprob has shape"):
        verl.kl_penalty(lp, lr[:, :3], "k3")
    with pytest.raises(ValueError, match="NaN"):
        verl.kl_penalty(lp, torch.full_like(lr, float("nan")), "k3")
    with pytest.raises(ValueError, match="above 0"):
        verl.kl_penalty((-lp).requires_grad_(True), lr, "k1", grad="cumulative")
    z, y, _, _ = _logits_batch(27)
    with pytest.raises(ValueError, match="needs labels"):
        verl.kl_penalty(z, y, "full", grad="rb")
    with pytest.raises(ValueError, match="do not pass"):
        verl.kl_penalty(z, y, "full", logits=z)


# -- agg_loss ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_modes_that_are_klest_reductions(mode):
    values, _ = log_probs((6, 5), seed=28)
    mask = row_mask((6, 5), seed=29)
    for m in (mask, mask.double()):  # verl passes bool or 0/1 float masks
        got = verl.agg_loss(values, m, mode)
        assert abs(float(got) - reduce_reference(values, mask, mode)) <= 1e-12


def test_agg_loss_modes_of_verl_only():
    values, _ = log_probs((6, 5), seed=30)
    mask = row_mask((6, 5), seed=31)
    kept = torch.where(mask, values, 0.0)
    n_rows = int(mask.any(-1).sum())
    seq_sum = float(kept.sum()) / n_rows
    assert abs(float(verl.agg_loss(values, mask, "token-sum")) - float(kept.sum())) <= 1e-12
    got = verl.agg_loss(values, mask, "seq-mean-token-sum-norm")
    assert abs(float(got) - seq_sum / 5) <= 1e-12  # the default factor is T
    got = verl.agg_loss(values, mask, "seq-mean-token-sum-norm", loss_scale_factor=64)
    assert abs(float(got) - seq_sum / 64) <= 1e-12


def test_agg_loss_with_global_counts_of_data_parallelism():
    values, _ = log_probs((6, 5), seed=32)
    mask = row_mask((6, 5), seed=33)
    kept = torch.where(mask, values, 0.0)
    per_row_mean = kept.sum(-1) / mask.sum(-1).clamp(min=1)
    cases = [
        ("token-mean", dict(batch_num_tokens=40), float(kept.sum()) / 40 * 4),
        ("token-sum", {}, float(kept.sum()) * 4),
        ("seq-mean-token-sum", dict(global_batch_size=20), float(kept.sum()) / 20 * 4),
        ("seq-mean-token-mean", dict(global_batch_size=20), float(per_row_mean.sum()) / 20 * 4),
        (
            "seq-mean-token-sum-norm",
            dict(global_batch_size=torch.tensor(20.0), loss_scale_factor=8),
            float(kept.sum()) / 20 * 4 / 8,
        ),
    ]
    for mode, counts, want in cases:
        got = verl.agg_loss(values, mask, mode, dp_size=4, **counts)
        assert abs(float(got) - want) <= 1e-12, mode


def test_agg_loss_bad_input():
    values = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="needs batch_num_tokens"):
        verl.agg_loss(values, mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="needs global_batch_size"):
        verl.agg_loss(values, mask, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        verl.agg_loss(values, mask, "seq-sum")
    with pytest.raises(ValueError, match="dp_size"):
        verl.agg_loss(values, mask, "token-sum", dp_size=0)
    with pytest.raises(ValueError, match="only 0 and 1"):
        verl.agg_loss(values, torch.full((2, 3), 2.0), "token-mean")
    with pytest.raises(ValueError, match="mask has shape"):
        verl.agg_loss(values, torch.ones(2, 2), "token-mean")


# -- gradients against exact answers -----------------------------------------------------------

MEANS = [
    # (kl_penalty, grad, the mean the docstrings state, a gradient it is documented not to be)
    ("k1", "peer", "zero", "pi||ref"),
    ("k3", "peer", "token ref||pi", "pi||ref"),
    ("low_var_kl+", "peer", "token pi||ref", "pi||ref"),
    ("k2", "peer", "token pi||ref", "pi||ref"),
    ("full", "peer", "token pi||ref", "pi||ref"),
    ("k3", "cumulative", "pi||ref", "zero"),
    ("k3", "score", "pi||ref", "zero"),
    ("full", "rb", "pi||ref", "zero"),
]


@pytest.mark.parametrize(("name", "grad", "mean", "not_mean"), MEANS)
def test_gradient_has_its_documented_mean(name, grad, mean, not_mean):
    """On sequences: verl's k1 has mean 0, its k3 descends the token-local KL(ref||pi), k2 and
    the '+' variants (and "full") the token-local KL(pi||ref); klest's gradients are unbiased
    for the sequence KL(pi||ref)."""
    testbed = make("tabular")
    exact = exact_grads(testbed)
    exact["zero"] = torch.zeros_like(exact["pi||ref"])

    def loss(s):
        if name == "full":
            per_token = verl.kl_penalty(s.logits, s.logits_ref, "full", grad=grad, mask=s.mask,
                                        labels=s.x if grad != "peer" else None)  # fmt: skip
        else:
            per_token = verl.kl_penalty(s.logp, s.logp_ref, name, grad=grad, mask=s.mask)
        return verl.agg_loss(per_token, s.mask, "seq-mean-token-sum")

    draws = gradient_draws(loss, testbed, batch_size=8, n_trials=600, seed=3)
    assert mean_shift_z(draws, exact[mean]) <= Z_ONE_SIDED
    assert mean_shift_z(draws, exact[not_mean]) > Z_ONE_SIDED


def test_klest_gradient_through_tokens_mean_is_the_sequence_gradient_times_rows_over_tokens():
    """With verl's default token-mean the per-token losses give, per batch, the sequence KL's
    gradient times B / (the batch's tokens): exactly, batch by batch."""
    testbed = make("tabular")
    s = testbed.sample(8, generator=klest.testbeds.make_generator(0))
    per_token = verl.kl_penalty(s.logp, s.logp_ref, "k3", grad="cumulative", mask=s.mask)
    params = testbed.parameters()
    g_tokens = flat_grad(verl.agg_loss(per_token, s.mask, "token-mean"), params, retain=True)
    g_seq = flat_grad(verl.agg_loss(per_token, s.mask, "seq-mean-token-sum"), params)
    factor = 8 / int(s.mask.sum())
    assert_verbose_close(g_tokens, factor * g_seq, atol=1e-15, rtol=1e-12)


# -- install -----------------------------------------------------------------------------------


@pytest.fixture
def fake_verl(monkeypatch):
    """A stand-in for verl's loss module, holding a kl_penalty of verl's signature."""

    def kl_penalty(logprob, ref_logprob, kl_penalty):
        return "verl's"

    return stand_in_module(monkeypatch, "verl.workers.utils.losses", kl_penalty=kl_penalty)


def test_install_rebinds_verls_kl_penalty_and_uninstall_restores_it(fake_verl):
    original = fake_verl.kl_penalty
    lp, lr = log_probs((4, 6), seed=34)
    with verl.install(grad="cumulative") as installed:
        assert fake_verl.kl_penalty is installed.replacement
        again = verl.install(grad="score")  # a second install keeps verl's original
        assert again.original is original
        a, b = two_leaves(lp)
        out = fake_verl.kl_penalty(logprob=a, ref_logprob=lr, kl_penalty="low_var_kl")
        atol = REFERENCE_ROUNDING * (lp - lr).abs()
        assert_verbose_close(out, verl_formula(lp - lr, "k3"), atol=atol, rtol=1e-13)
        out.sum().backward()
        surrogate_reference(b, lr, None, "score").sum().backward()
        assert_verbose_close(a.grad, b.grad, atol=1e-14, rtol=1e-12)
        again.uninstall()
        assert fake_verl.kl_penalty is original
    installed.uninstall()  # twice is harmless
    assert fake_verl.kl_penalty is original


def test_install_says_what_is_missing(monkeypatch, fake_verl):
    with pytest.raises(ValueError, match="unknown grad"):
        verl.install(grad="rb")
    del fake_verl.kl_penalty
    with pytest.raises(RuntimeError, match="has no function kl_penalty"):
        verl.install()
    monkeypatch.setitem(sys.modules, "verl.workers.utils.losses", None)
    with pytest.raises(ImportError, match="does not import here"):
        verl.install()


# -- the real verl, where it imports -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients_equal_the_real_verls(dtype):
    real = real_function("verl.trainer.ppo.core_algos", "kl_penalty")
    lp, lr = log_probs((6, 40), seed=35, dtype=dtype)
    eps = torch.finfo(dtype).eps
    for name in NAMES + PLUS:
        a, b = two_leaves(lp)
        ours, theirs = verl.kl_penalty(a, lr, name), real(b, lr, name)
        # k3: verl's exp(x) - x - 1 rounds at the scale of its terms, klest's does not.
        x = (lr - lp).double().clamp(-20, 20)
        tol = 8 * eps * (1 + x.abs() + x.exp())
        assert_verbose_close(ours, theirs, atol=tol, what=name)
        ours.sum().backward()
        theirs.sum().backward()
        assert_verbose_close(a.grad, b.grad, atol=tol, what=f"{name} gradient")


def test_agg_loss_equals_the_real_verls():
    real = real_function("verl.trainer.ppo.core_algos", "agg_loss")
    values, _ = log_probs((6, 5), seed=36)
    mask = row_mask((6, 5), seed=37)
    mask[-1, 0] = True  # no empty row: verl's seq-mean-token-mean divides by n + 1e-8
    for mode in ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                 "seq-mean-token-sum-norm"]:  # fmt: skip
        for kwargs in ({}, dict(dp_size=2, batch_num_tokens=30, global_batch_size=12)):
            ours = verl.agg_loss(values, mask, mode, **kwargs)
            theirs = real(values, mask, mode, **kwargs)
            assert abs(float(ours) - float(theirs)) <= 1e-7 * abs(float(theirs)), mode


def test_what_klest_says_the_real_verl_does_where_it_differs():
    """The differences the docstrings state: verl 0.9.1 names ``"full"`` but raises
    ``NotImplementedError`` (as for unknown names; klest: ``ValueError``), and its ``agg_loss``
    of a batch with no valid token is 0 / 0 = NaN (klest: 0)."""
    real_kl = real_function("verl.trainer.ppo.core_algos", "kl_penalty")
    real_agg = real_function("verl.trainer.ppo.core_algos", "agg_loss")
    lp, lr = log_probs((3, 4), seed=40)
    for name in ("full", "kl3"):
        with pytest.raises(NotImplementedError):
            real_kl(lp, lr, name)
    empty = torch.zeros(3, 4, dtype=torch.bool)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert bool(torch.isnan(real_agg(lp, empty, mode)))
        assert float(verl.agg_loss(lp, empty, mode)) == 0.0


def _real_ppo_loss_and_gradient(
    losses,
    logp,
    logp_ref,
    mask,
    prompt_len=3,
    *,
    kl_loss_type="low_var_kl",
    loss_agg_mode="seq-mean-token-sum",
):
    """verl's actor loss (``losses.ppo_loss``, the real one) on one micro-batch in the layout its
    ``no_padding_2_padding`` reads: the model's log-probs flat over prompt and response tokens,
    shifted by one, with a KL loss (``kl_loss_type``, coefficient 1, ``loss_agg_mode``) and zero
    advantages (no policy-gradient term). The loss and its gradient in ``logp`` ``[B, R]``."""
    from verl.utils import tensordict_utils
    from verl.workers.config import ActorConfig

    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         use_kl_loss=True, kl_loss_type=kl_loss_type, kl_loss_coef=1.0,
                         loss_agg_mode=loss_agg_mode)  # fmt: skip
    b_rows, r_len = logp.shape
    lengths = mask.sum(-1)
    flat = torch.cat(
        [
            torch.cat([logp.new_zeros(prompt_len - 1), logp[i, : int(n)], logp.new_zeros(1)])
            for i, n in enumerate(lengths)
        ]
    )
    data = tensordict_utils.get_tensordict(
        {
            "prompts": torch.ones(b_rows, prompt_len, dtype=torch.long),
            "responses": torch.ones(b_rows, r_len, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(b_rows, prompt_len), mask.double()], -1).long(),
            "response_mask": mask.long(),
            "old_log_probs": logp.detach(),
            "advantages": torch.zeros_like(logp.detach()),
            "ref_log_prob": logp_ref,
        },
        {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None},
    )
    loss, _ = losses.ppo_loss(config, {"log_probs": flat}, data)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def test_install_reaches_the_real_verls_actor_loss():
    """``install()`` into the real verl: its actor loss (``ppo_loss``) keeps verl's KL value and
    takes klest's gradient, the cumulative surrogate's, through verl's own aggregation; before
    and after, verl's k3 gradient. verl's padding holds log-probs 0 under both models."""
    losses = real_module("verl.workers.utils.losses")
    lp, lr = log_probs((5, 6), seed=38)
    mask = row_mask((5, 6), seed=39)
    mask[-1, 0] = True  # no empty row: verl's layout needs a token per sequence
    lp, lr = torch.where(mask, lp, 0.0), torch.where(mask, lr, 0.0)
    n_rows = int(mask.any(-1).sum())
    original = losses.kl_penalty

    def verls(x):
        return torch.where(mask, verl_formula(x - lr, "k3"), 0.0).sum() / n_rows

    def leaf(x):
        return x.clone().requires_grad_(True)

    want = {"klest": leaf(lp), "verl": leaf(lp)}
    (surrogate_reference(want["klest"], lr, mask, "cumulative").sum() / n_rows).backward()
    verls(want["verl"]).backward()
    got = {}
    with verl.install(grad="cumulative") as installed:
        assert losses.kl_penalty is installed.replacement
        value, got["klest"] = _real_ppo_loss_and_gradient(losses, leaf(lp), lr, mask)
        assert_verbose_close(value, verls(lp), atol=1e-15, rtol=1e-13, what="value")
    assert losses.kl_penalty is original
    _, got["verl"] = _real_ppo_loss_and_gradient(losses, leaf(lp), lr, mask)
    for whose in ("klest", "verl"):
        assert_verbose_close(got[whose], want[whose].grad, atol=1e-15, rtol=1e-12, what=whose)
    # the two gradients differ by far more than the tolerance: the check tells them apart
    assert float((want["klest"].grad - want["verl"].grad).abs().max()) > 1e-2


def test_full_with_ignored_labels_and_no_mask_drops_those_positions():
    """Labels of -100 (kl_from_logits' ignore_index) with no mask: those positions are left out
    of ``"full"`` + ``grad="rb"`` exactly as a mask would leave them out (value 0 there, the
    exact per-position KL elsewhere; the gradient the Rao-Blackwellized surrogate's)."""
    z, y, labels, mask = _logits_batch(21)
    ignored = torch.where(mask, labels, -100)
    zz = z.clone().requires_grad_(True)
    out = verl.kl_penalty(zz, y, "full", grad="rb", labels=ignored)
    want = torch.where(mask, logits_reference(z, y)["kl_pi_ref"], 0.0)
    assert_verbose_close(out, want, atol=1e-300, rtol=1e-12)
    out.sum().backward()
    z64 = z.clone().requires_grad_(True)
    rb_surrogate_reference(z64, y, labels, mask).sum().backward()
    assert_verbose_close(zz.grad, z64.grad, atol=1e-14, rtol=1e-10)


@pytest.mark.parametrize("grad", ["cumulative", "score"])
def test_validate_false_checks_nothing_with_klests_gradient(grad):
    """validate=False: NaN log-probs give NaN where they are, as the value checks are off (no
    error from the value's log-ratios either)."""
    lp, lr = log_probs((3, 4), seed=28)
    bad = lr.clone()
    bad[1, 2] = float("nan")
    out = verl.kl_penalty(lp.clone().requires_grad_(True), bad, "k3", grad=grad, validate=False)
    assert bool(torch.isnan(out[1, 2]))
    rows = [0, 2]  # rows without the NaN
    want = verl_formula(lp[rows] - lr[rows], "k3")
    atol = REFERENCE_ROUNDING * (lp[rows] - lr[rows]).abs()
    assert_verbose_close(out[rows], want, atol=atol, rtol=1e-13)
