"""klest.integrations.openrlhf: OpenRLHF's compute_approx_kl, its values, gradients and install.

Values are compared with OpenRLHF's formulas as written here from OpenRLHF 0.11.2's math
(float64, with its clips); ``grad="peer"`` gradients with autograd of those formulas (and of
the straight-through surrogate of ``unbiased_gradient``); klest's gradients with autograd of the
surrogates of ``tests/integrations/_peer_reference.py``. The last tests compare with the real
OpenRLHF (``requirements/peers.txt``, which ``make test`` installs): the file
``openrlhf/models/utils.py`` run on its own (the package ``openrlhf.models`` needs flash-attn,
which has no CPU build), and the source of its actor, parsed (it imports vLLM); without OpenRLHF
they skip (``make test`` makes them fail instead).

Statistical tests (``tests/_stats.py``): as in ``test_verl.py``, 600 gradients of batches of 8
on tabular testbeds with exact gradients, ``klest.audit.mean_shift_z`` against the documented
mean one-sided at ``RATE`` (3.83, false-fail rate 6.3e-5 per test); the rejections asserted
measure z above 12 at the fixed seed.
"""

from __future__ import annotations

import ast
import inspect
import itertools
import sys

import pytest
import torch

from klest.audit import gradient_draws, mean_shift_z
from klest.integrations import openrlhf
from tests._reference import assert_verbose_close, exact_token_level_gradient
from tests._stats import RATE, z_for
from tests._testbeds import make
from tests.integrations._peer_reference import (
    exact_grads,
    real_function,
    real_source,
    stand_in_module,
    surrogate_reference,
    two_leaves,
)
from tests.integrations.test_verl import REFERENCE_ROUNDING, log_probs, row_mask

ESTIMATORS = ["k1", "k2", "k3"]
Z_ONE_SIDED = z_for(RATE, 1, two_sided=False)


def openrlhf_formula(delta: torch.Tensor, estimator: str) -> torch.Tensor:
    """OpenRLHF 0.11.2's per-token value at ``delta = log_probs - log_probs_base``, float64:
    k1 = delta, k2 = delta^2 / 2, k3 = e^{-x} - 1 + x with x = max(delta, -10); every value
    clipped to [-10, 10]."""
    delta = delta.double()
    if estimator == "k1":
        value = delta
    elif estimator == "k2":
        value = delta**2 / 2
    else:
        x = delta.clamp(min=-10.0)
        value = torch.expm1(-x) + x
    return value.clamp(-10.0, 10.0)


def weighted_k2(lp, lr, lo):
    """The surrogate of ``unbiased_gradient=True``: w delta^2 / 2, w = min(pi / pi_old, 10)
    detached (1 without ``lo``)."""
    w = 1.0 if lo is None else torch.exp(lp - lo).clamp(max=10.0).detach()
    return w * (lp - lr) ** 2 / 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unbiased_gradient", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_values_are_openrlhfs_formulas(estimator, unbiased_gradient, dtype):
    lp, lr = log_probs((5, 7), seed=1, dtype=dtype)
    lo, _ = log_probs((5, 7), seed=2, dtype=dtype)
    mask = row_mask((5, 7), seed=3)
    out = openrlhf.compute_approx_kl(lp, lr, lo, estimator, unbiased_gradient, action_mask=mask)
    delta = lp.double() - lr.double() if dtype == torch.bfloat16 else (lp - lr).double()
    want = torch.where(mask, openrlhf_formula(delta, estimator), 0.0)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol = 1e-13 if dtype == torch.float64 else 4e-7
    atol = REFERENCE_ROUNDING * delta.abs()
    assert_verbose_close(out, want, atol=atol, rtol=rtol, what=f"{estimator} {dtype}")


@pytest.mark.parametrize("unbiased_gradient", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_peer_gradient_is_openrlhfs(estimator, unbiased_gradient):
    lp, lr = log_probs((5, 7), seed=4)
    lo, _ = log_probs((5, 7), seed=5)
    mask = row_mask((5, 7), seed=6)
    a, b = two_leaves(lp)
    openrlhf.compute_approx_kl(
        a, lr, lo, kl_estimator=estimator, unbiased_gradient=unbiased_gradient, action_mask=mask
    ).sum().backward()
    surrogate = weighted_k2(b, lr, lo) if unbiased_gradient else openrlhf_formula(b - lr, estimator)
    torch.where(mask, surrogate, 0.0).sum().backward()
    if unbiased_gradient:  # the straight-through gradient, exactly
        assert torch.equal(a.grad, b.grad)
    else:
        assert_verbose_close(a.grad, b.grad, atol=1e-15, rtol=1e-12, what=estimator)


def test_unbiased_gradient_without_old_log_probs_is_k2s():
    lp, lr = log_probs((4, 6), seed=7)
    a, b = two_leaves(lp)
    openrlhf.compute_approx_kl(a, lr, kl_estimator="k3", unbiased_gradient=True).sum().backward()
    weighted_k2(b, lr, None).sum().backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("grad", ["cumulative", "score"])
@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_klest_gradient_keeps_openrlhfs_value(estimator, off_policy, grad):
    """klest's gradient, importance weighted per prefix by ``log_probs_old`` when given."""
    lp, lr = log_probs((5, 7), seed=8)
    lo = log_probs((5, 7), seed=9)[0] if off_policy else None
    mask = row_mask((5, 7), seed=10)
    a, b = two_leaves(lp)
    out = openrlhf.compute_approx_kl(a, lr, lo, estimator, grad=grad, action_mask=mask)
    want = torch.where(mask, openrlhf_formula(lp - lr, estimator), 0.0)
    assert_verbose_close(out, want, atol=REFERENCE_ROUNDING * (lp - lr).abs(), rtol=1e-13)
    out.sum().backward()
    surrogate_reference(b, lr, mask, grad, logp_behavior=lo).sum().backward()
    assert_verbose_close(a.grad, b.grad, atol=1e-14, rtol=1e-12, what=f"{estimator} {grad}")


def test_leave_one_out_baseline_within_groups():
    lp, lr = log_probs((6, 5), seed=11)
    mask = row_mask((6, 5), seed=12)
    group = torch.tensor([0, 0, 1, 1, 1, 2])
    a, b = two_leaves(lp)
    openrlhf.compute_approx_kl(
        a, lr, kl_estimator="k3", grad="cumulative", action_mask=mask, baseline="loo", group=group
    ).sum().backward()
    surrogate_reference(b, lr, mask, "cumulative", loo_group=group.tolist()).sum().backward()
    assert_verbose_close(a.grad, b.grad, atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("grad", ["peer", "cumulative"])
def test_bf16_empty_rows_and_layouts(grad):
    lp, lr = log_probs((2, 3, 4), seed=13, dtype=torch.bfloat16)
    lp.requires_grad_(True)
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[1, 2] = False  # an empty row
    out = openrlhf.compute_approx_kl(lp, lr, kl_estimator="k3", grad=grad, action_mask=mask)
    assert out.shape == (2, 3, 4) and out.dtype == torch.float32
    assert torch.equal(out[1, 2], torch.zeros(4))
    out.sum().backward()
    assert lp.grad.dtype == torch.bfloat16 and bool((lp.grad[1, 2] == 0).all())


def test_bad_input():
    lp, lr = log_probs((3, 4), seed=14)
    lp.requires_grad_(True)
    with pytest.raises(ValueError, match="unknown kl_estimator"):
        openrlhf.compute_approx_kl(lp, lr, kl_estimator="low_var_kl")
    with pytest.raises(ValueError, match="unbiased_gradient=True chooses"):
        openrlhf.compute_approx_kl(lp, lr, None, "k3", True, grad="cumulative")
    with pytest.raises(TypeError, match="unbiased_gradient must be a bool"):
        openrlhf.compute_approx_kl(lp, lr, None, "k3", 1)
    with pytest.raises(ValueError, match="baseline applies"):
        openrlhf.compute_approx_kl(lp, lr, baseline="loo")
    with pytest.raises(ValueError, match=r"log_probs has shape .* but log_probs_base has shape"):
        openrlhf.compute_approx_kl(lp, lr[:, :2])
    # An earlier OpenRLHF took action_mask third: a 0/1 mask there is refused, not used as
    # log-probs of the sampling policy.
    with pytest.raises(ValueError, match="log_probs_old has values above 0"):
        openrlhf.compute_approx_kl(lp, lr, torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="log_probs_old must have a floating-point dtype"):
        openrlhf.compute_approx_kl(lp, lr, torch.ones(3, 4, dtype=torch.bool))


# -- gradients against exact answers -----------------------------------------------------------

ON_POLICY = [
    # (estimator, unbiased_gradient, grad, the documented mean, a gradient it is not)
    ("k1", False, "peer", "zero", "pi||ref"),
    ("k3", False, "peer", "token ref||pi", "pi||ref"),
    ("k2", False, "peer", "token pi||ref", "pi||ref"),
    ("k3", True, "peer", "token pi||ref", "pi||ref"),  # OpenRLHF's "unbiased" gradient
    ("k3", False, "cumulative", "pi||ref", "zero"),
]


@pytest.mark.parametrize(("estimator", "unbiased", "grad", "mean", "not_mean"), ON_POLICY)
def test_gradient_has_its_documented_mean(estimator, unbiased, grad, mean, not_mean):
    """On-policy (``log_probs_old`` equal to ``log_probs``, as in OpenRLHF's first PPO step):
    k1's gradient has mean 0, k3's descends the token-local KL(ref||pi), k2's and
    ``unbiased_gradient``'s the token-local KL(pi||ref) (biased for sequences); klest's is
    unbiased for the sequence KL(pi||ref)."""
    testbed = make("tabular")
    exact = exact_grads(testbed)
    exact["zero"] = torch.zeros_like(exact["pi||ref"])

    def loss(s):
        kl = openrlhf.compute_approx_kl(s.logp, s.logp_ref, s.logp.detach(), estimator, unbiased,
                                        grad=grad, action_mask=s.mask)  # fmt: skip
        return kl.sum(-1).mean()

    draws = gradient_draws(loss, testbed, batch_size=8, n_trials=600, seed=5)
    assert mean_shift_z(draws, exact[mean]) <= Z_ONE_SIDED
    assert mean_shift_z(draws, exact[not_mean]) > Z_ONE_SIDED


@pytest.mark.parametrize("grad", ["peer", "cumulative"])
def test_off_policy_gradients(grad):
    """Samples from an older policy (``log_probs_old``): OpenRLHF's ``unbiased_gradient`` has
    the token-level mean with the sampler's prefixes (its weight clip at 10 never acts on this
    testbed: the largest per-token ratio is below 10), not the gradient of the sequence KL;
    klest's cumulative estimator, weighted per prefix, is unbiased for it."""
    testbed = make("off-policy")
    exact = exact_grads(testbed.target)["pi||ref"]
    documented = {
        "peer": exact_token_level_gradient(testbed.target, "pi||ref", testbed.behavior),
        "cumulative": exact,
    }[grad]

    def loss(s):
        kl = openrlhf.compute_approx_kl(s.logp, s.logp_ref, s.logp_behavior, "k3",
                                        grad == "peer", grad=grad, action_mask=s.mask)  # fmt: skip
        return kl.sum(-1).mean()

    draws = gradient_draws(loss, testbed, batch_size=8, n_trials=600, seed=6)
    assert mean_shift_z(draws, documented) <= Z_ONE_SIDED
    other = exact if grad == "peer" else torch.zeros_like(exact)
    assert mean_shift_z(draws, other) > Z_ONE_SIDED


def test_off_policy_testbed_weights_stay_below_openrlhfs_clip():
    """What ``test_off_policy_gradients`` relies on: pi / behavior < 10 for every token."""
    testbed = make("off-policy")
    ratio = (testbed.target.logits.log_softmax(-1) - testbed.behavior.logits.log_softmax(-1)).exp()
    assert float(ratio.detach().max()) < 10


# -- install -----------------------------------------------------------------------------------


@pytest.fixture
def fake_openrlhf(monkeypatch):
    """A stand-in for OpenRLHF's actor module, holding a compute_approx_kl."""
    return stand_in_module(
        monkeypatch,
        "openrlhf.trainer.ray.ppo_actor",
        compute_approx_kl=lambda *args, **kwargs: "OpenRLHF's",
    )


def test_install_rebinds_openrlhfs_compute_approx_kl(fake_openrlhf):
    original = fake_openrlhf.compute_approx_kl
    lp, lr = log_probs((4, 6), seed=15)
    lo, _ = log_probs((4, 6), seed=16)
    with openrlhf.install(grad="cumulative") as installed:
        assert fake_openrlhf.compute_approx_kl is installed.replacement
        a, b = two_leaves(lp)
        # as OpenRLHF's actor calls it
        out = fake_openrlhf.compute_approx_kl(
            a, lr, log_probs_old=lo, kl_estimator="k3", unbiased_gradient=False
        )
        want = openrlhf_formula(lp - lr, "k3")
        assert_verbose_close(out, want, atol=REFERENCE_ROUNDING * (lp - lr).abs(), rtol=1e-13)
        out.sum().backward()
        surrogate_reference(b, lr, None, "cumulative", logp_behavior=lo).sum().backward()
        assert_verbose_close(a.grad, b.grad, atol=1e-14, rtol=1e-12)
        with pytest.raises(ValueError, match="unbiased_gradient=True chooses"):
            fake_openrlhf.compute_approx_kl(a, lr, lo, "k3", True)
    assert fake_openrlhf.compute_approx_kl is original


def test_install_without_openrlhf(monkeypatch):
    monkeypatch.setitem(sys.modules, "openrlhf.trainer.ray.ppo_actor", None)
    with pytest.raises(ImportError, match="install\\(\\) must run in the process that trains"):
        openrlhf.install()


# -- the real OpenRLHF, where it imports -------------------------------------------------------


@pytest.mark.parametrize("unbiased_gradient", [False, True])
def test_values_and_gradients_equal_the_real_openrlhfs(unbiased_gradient):
    real = real_function("openrlhf.models.utils", "compute_approx_kl", file_only=True)
    lp, lr = log_probs((6, 40), seed=17, dtype=torch.float32)
    lo, _ = log_probs((6, 40), seed=18, dtype=torch.float32)
    # with the rollout log-probs (9 of the 240 weights pi / pi_old past the clip at 10),
    # and without them (weight 1)
    for estimator, old in itertools.product(ESTIMATORS, (lo, None)):
        a, b = two_leaves(lp)
        ours = openrlhf.compute_approx_kl(a, lr, old, estimator, unbiased_gradient)
        theirs = real(b, lr, old, kl_estimator=estimator, unbiased_gradient=unbiased_gradient)
        # OpenRLHF rounds at the scale of its terms: e^{-x} and, straight-through, w delta^2 / 2.
        delta = (lp - lr).double()
        scale = 1 + delta.abs() + (-delta.clamp(min=-10)).exp() + 10 * delta**2
        tol = 8 * torch.finfo(torch.float32).eps * scale
        assert_verbose_close(ours, theirs, atol=tol, what=estimator)
        ours.sum().backward()
        theirs.sum().backward()
        assert_verbose_close(a.grad, b.grad, atol=tol, what=f"{estimator} gradient")


def _calls_of(tree: ast.Module, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def test_install_reaches_the_real_openrlhfs_actor_call(fake_openrlhf):
    """What ``install()`` relies on, read from the real OpenRLHF's actor
    (``openrlhf.trainer.ray.ppo_actor``, which imports vLLM and flash-attn, so it is parsed
    here, not imported): the module binds ``compute_approx_kl`` once, from
    ``openrlhf.models.utils``, never rebinds it, and calls it by that global name, so the name
    that ``install()`` rebinds (the stand-in above has the same module name) is the one the loss
    calls; each call's arguments bind to the replacement's signature, the rollout log-probs
    among them (klest's importance weights); and the real function's name and parameters are
    the ones the replacement takes."""
    tree = real_source("openrlhf.trainer.ray.ppo_actor")
    name = "compute_approx_kl"
    imported = [
        (node.module, alias.name, alias.asname)
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name == name
    ]
    assert imported == [("openrlhf.models.utils", name, None)]
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name]
    assert all(isinstance(n.ctx, ast.Load) for n in uses)  # never assigned in the module
    calls = _calls_of(tree, name)
    assert calls and len(calls) == len(uses)  # every use is a call by the global name
    with openrlhf.install(grad="cumulative") as installed:
        assert fake_openrlhf.compute_approx_kl is installed.replacement
        replacement = inspect.signature(installed.replacement)
    real = inspect.signature(real_function("openrlhf.models.utils", name, file_only=True))
    assert list(real.parameters) == list(replacement.parameters)
    for call in calls:
        assert not any(isinstance(a, ast.Starred) for a in call.args)
        keywords = [k.arg for k in call.keywords]
        assert None not in keywords  # no **kwargs
        replacement.bind(*call.args, **dict.fromkeys(keywords))
        assert "log_probs_old" in keywords
