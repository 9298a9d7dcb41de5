"""The nn.Module forms equal the functions they wrap, and their state is checkpointed."""

from __future__ import annotations

import pytest
import torch

import klest
from klest.nn import KLFromHidden, KLFromLogits, KLPenalty
from klest.testbeds import make_generator
from tests._testbeds import make
from tests._tolerance import assert_close_to_rounding, assert_logits_values_close


def test_kl_penalty_module_equals_the_function_times_beta():
    s = make("tabular").sample(6, generator=make_generator(1))
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    module = KLPenalty(estimator="k3", grad="cumulative", baseline="loo", beta=0.25)
    got = module(s.logp, s.logp_ref, mask=s.mask, group=group)
    want = 0.25 * klest.kl_penalty(s.logp, s.logp_ref, mask=s.mask, baseline="loo", group=group)
    torch.testing.assert_close(got, want)
    value, details = module(s.logp, s.logp_ref, mask=s.mask, group=group, return_details=True)
    torch.testing.assert_close(value, want)
    assert isinstance(details, klest.PenaltyDetails)


def test_kl_penalty_module_keeps_its_moving_averages_across_a_checkpoint():
    testbed = make("tabular")
    batches = [testbed.sample(8, generator=make_generator(s)) for s in range(4)]
    module = KLPenalty(baseline="ema", alpha="ema", estimator="cv", baseline_decay=0.5)
    for b in batches[:3]:
        module(b.logp, b.logp_ref, mask=b.mask)
    state = module.state_dict()
    assert set(state) == {
        "baseline_ema.sums",
        "baseline_ema.weights",
        "alpha_ema.moments",
        "alpha_ema.weight",
    }
    resumed = KLPenalty(baseline="ema", alpha="ema", estimator="cv", baseline_decay=0.5)
    resumed.load_state_dict(state)
    last = batches[3]
    params = testbed.parameters()
    (g_module,) = torch.autograd.grad(
        module(last.logp, last.logp_ref, mask=last.mask), params, retain_graph=True
    )
    (g_resumed,) = torch.autograd.grad(
        resumed(last.logp, last.logp_ref, mask=last.mask), params, retain_graph=True
    )
    torch.testing.assert_close(g_resumed, g_module, rtol=0, atol=0)
    fresh = KLPenalty(baseline="ema", alpha="ema", estimator="cv", baseline_decay=0.5)
    (g_fresh,) = torch.autograd.grad(fresh(last.logp, last.logp_ref, mask=last.mask), params)
    assert not torch.allclose(g_fresh, g_module)  # a restart would change the gradient


def test_kl_penalty_module_rejects_bad_names_at_construction():
    with pytest.raises(ValueError, match="unknown grad"):
        KLPenalty(grad="reinforce")
    with pytest.raises(ValueError, match="unknown direction"):
        KLPenalty(direction="forward")


def test_kl_from_logits_module_equals_the_function():
    g = make_generator(2)
    z = torch.randn(2, 4, 9, generator=g, requires_grad=True)
    y = torch.randn(2, 4, 9, generator=g)
    labels = torch.randint(0, 9, (2, 4), generator=g)
    module = KLFromLogits(direction="ref||pi", reduction="token-mean", temperature=0.8)
    got = module(z, y, labels=labels)
    want = klest.kl_from_logits(
        z, y, direction="ref||pi", reduction="token-mean", temperature=0.8, labels=labels
    )
    # the module calls the function: the same float32 arithmetic, a log-softmax and a sum over
    # V at the rows' logit scale (16 roundings, twice)
    assert_logits_values_close(got, want, z, y, ulps=32, temperature=0.8)
    assert list(module.parameters()) == [] and module.state_dict() == {}


def test_kl_from_hidden_module_holds_the_heads_by_reference():
    g = make_generator(3)
    head, ref_head = torch.nn.Linear(5, 11), torch.nn.Linear(5, 11)
    h, h_ref = torch.randn(3, 2, 5, generator=g), torch.randn(3, 2, 5, generator=g)
    module = KLFromHidden(head, ref_head, reduction="sum")
    got = module(h, h_ref)
    want = klest.kl_from_logits(head(h), ref_head(h_ref), reduction="sum")
    # the fused head against the materialized logits: two float32 paths, each a log-softmax and
    # a sum over V at the rows' logit scale (16 roundings); a sum over the 6 positions
    z, y = head(h).detach(), ref_head(h_ref).detach()
    assert_logits_values_close(got, want, z, y, ulps=32, terms=6)
    got.backward()
    assert head.weight.grad is not None and head.bias.grad is not None
    assert list(module.parameters()) == [] and module.state_dict() == {}
    logits_ref = torch.randn(3, 2, 11, generator=g)
    assert_logits_values_close(
        KLFromHidden(head)(h, logits_ref=logits_ref),
        klest.kl_from_logits(head(h), logits_ref),
        z,
        logits_ref,
        ulps=32,
        terms=2,  # the default reduction: a mean over rows of sums over 2 positions
    )
    with pytest.raises(ValueError, match="needs a ref_head"):
        KLFromHidden(head)(h, h_ref)
    with pytest.raises(TypeError, match=r"lm_head must be an nn\.Linear"):
        KLFromHidden(torch.nn.Embedding(3, 4))


def test_kl_penalty_module_checks_its_options_at_construction():
    with pytest.raises(ValueError, match="unknown baseline"):
        KLPenalty(baseline="typo")
    with pytest.raises(ValueError, match="unknown level"):
        KLPenalty(level="bogus")
    with pytest.raises(ValueError, match="alpha applies only"):
        KLPenalty(alpha="ema")  # estimator k3


def test_moving_averages_stay_float64_under_a_model_cast_and_freeze_in_eval():
    module = KLPenalty(estimator="cv", alpha="ema", baseline="ema").to(torch.bfloat16)
    assert module.alpha_ema.moments.dtype == torch.float64
    assert module.baseline_ema.sums.dtype == torch.float64
    s = make("tabular").sample(6, generator=make_generator(3))
    module(s.logp, s.logp_ref, mask=s.mask)
    module.eval()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with torch.no_grad():
        module(s.logp, s.logp_ref, mask=s.mask)  # e.g. logging a validation KL
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    module.train()
    module(s.logp, s.logp_ref, mask=s.mask)
    assert not torch.equal(before["alpha_ema.moments"], module.alpha_ema.moments)


def test_kl_penalty_module_with_a_fitted_loo_scale_matches_the_function_over_batches():
    """``baseline="loo-ema"`` keeps a :class:`klest.LooScaleEMA` as a submodule: over several
    batches its gradients equal ``kl_penalty`` with an independent state of the same decay, and
    the state is in ``state_dict``."""
    testbed = make("tabular")
    params = testbed.parameters()
    module = KLPenalty(grad="cumulative", baseline="loo-ema", baseline_decay=0.5)
    state = klest.LooScaleEMA(decay=0.5)
    for s in range(4):
        b = testbed.sample(8, generator=make_generator(s))
        group = torch.arange(8) // 4
        (got,) = torch.autograd.grad(
            module(b.logp, b.logp_ref, mask=b.mask, group=group), params, retain_graph=True
        )
        want_loss = klest.kl_penalty(
            b.logp, b.logp_ref, mask=b.mask, group=group, baseline=state, grad="cumulative"
        )
        (want,) = torch.autograd.grad(want_loss, params)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert isinstance(module.baseline_ema, klest.LooScaleEMA)
    assert set(module.state_dict()) == {f"baseline_ema.{k}" for k in state.state_dict()}
    with pytest.raises(ValueError, match="baseline"):
        KLPenalty(baseline="loo-emma")


class _Student(torch.nn.Module):
    """A body and an LM head, fully sharded as one FSDP2 unit in the gloo test."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.body = torch.nn.Linear(6, 6)
        self.lm_head = torch.nn.Linear(6, 11)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))

    def forward(self, x):
        return torch.tanh(self.body(x))


def _fsdp_inputs():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 3, 6, generator=g)  # 2 micro-batches of [2, 3] positions
    h_ref = torch.randn(2, 2, 3, 6, generator=g)
    ref_head = torch.nn.Linear(6, 11).requires_grad_(False)
    with torch.no_grad():
        ref_head.weight.copy_(torch.randn(11, 6, generator=g))
        ref_head.bias.zero_()
    return x, h_ref, ref_head


def _fsdp_rank(rank: int, world: int):
    """Each rank: its own rows of both micro-batches; the root sharded with
    reshard_after_forward=True, gradient sync off for the first micro-batch."""
    from torch.distributed.fsdp import fully_shard

    model = _Student()
    fully_shard(model, reshard_after_forward=True)
    x, h_ref, ref_head = _fsdp_inputs()
    loss_fn = klest.nn.KLFromHidden(model.lm_head, ref_head, gather_with=model, reduction="sum")
    errors = []
    try:  # the shard read outside the forward (plain hidden states: no forward left dangling)
        klest.kl_from_hidden(h_ref[0, rank], model.lm_head.weight, h_ref[0, rank], ref_head.weight)
    except ValueError as e:
        errors.append(str(e))
    for mb in range(2):
        model.set_requires_gradient_sync(mb == 1)
        loss_fn(model(x[mb, rank]), h_ref[mb, rank]).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    torch.distributed.barrier()  # every rank's collectives done before the group is destroyed
    return grads, errors


def test_kl_from_hidden_module_gathers_fully_sharded_heads(tmp_path):
    """Under FSDP2 (2 gloo ranks, the LM head inside the sharded root), the module form gives
    the single-device gradients (averaged over ranks as FSDP does: half the sum of the two
    ranks' rows), and the tensor form refuses the shard by name. float32: a sum of 12 positions'
    terms of order 1, 64 roundings."""
    from tests._spawn import run_ranks

    results = run_ranks(_fsdp_rank, 2, tmp_path)
    model = _Student()
    x, h_ref, ref_head = _fsdp_inputs()
    loss_fn = klest.nn.KLFromHidden(model.lm_head, ref_head, reduction="sum")
    for mb in range(2):
        for rank in range(2):
            (0.5 * loss_fn(model(x[mb, rank]), h_ref[mb, rank])).backward()
    for grads, errors in results:
        for name, p in model.named_parameters():
            assert_close_to_rounding(grads[name], p.grad, ulps=64, what=name)
        assert len(errors) == 1 and "gather_with=model" in errors[0]


def test_gather_with_must_be_fully_sharded():
    head = torch.nn.Linear(3, 5)
    with pytest.raises(TypeError, match="fully_shard"):
        klest.nn.KLFromHidden(head, gather_with=torch.nn.Linear(3, 5))


def test_exact_kl_modules_pass_scale_and_ce_weight_through():
    """``scale`` and ``ce_weight`` reach the functions: the modules equal the function calls
    with them, value and gradient, bit for bit (the same code)."""
    g = torch.Generator().manual_seed(9)
    z = torch.randn(2, 3, 11, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randn(2, 3, 11, generator=g, dtype=torch.float64)
    labels = torch.tensor([[1, 2, -100], [0, 10, 4]])
    got = KLFromLogits(reduction="token-mean", scale=0.2, ce_weight=0.5)(z, y, labels=labels)
    want = klest.kl_from_logits(
        z, y, labels=labels, reduction="token-mean", scale=0.2, ce_weight=0.5
    )
    assert torch.equal(got, want)
    assert torch.equal(*(torch.autograd.grad(t, z)[0] for t in (got, want)))
    head = torch.nn.Linear(4, 11).double()
    h = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    got = KLFromHidden(head, scale=0.3, ce_weight=0.25)(h, logits_ref=y, labels=labels)
    want = klest.kl_from_hidden(
        h, head.weight, logits_ref=y, bias=head.bias, labels=labels, scale=0.3, ce_weight=0.25
    )
    assert torch.equal(got, want)
