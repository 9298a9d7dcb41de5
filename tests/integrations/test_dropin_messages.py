"""The verl and OpenRLHF drop-ins' errors and warnings name the peer's arguments under every
gradient, klest's included (their checks then run inside ``klest.kl_penalty``), and never
suggest ``density=True``, an option the drop-ins do not have."""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from collections.abc import Callable

import pytest
import torch

import klest
from klest import KLGradientWarning
from klest.integrations import openrlhf, verl


@dataclasses.dataclass(frozen=True)
class DropIn:
    """A drop-in called with the peer's three log-prob arguments and its mask keyword."""

    call: Callable[..., torch.Tensor]
    logp: str
    logp_ref: str
    behavior: str
    mask: str

    def __call__(self, lp, lr, *, grad, behavior=None, mask=None, **more):
        return self.call(lp, lr, grad=grad, **{self.behavior: behavior, self.mask: mask}, **more)


def _verl(lp, lr, **kwargs):
    return verl.kl_penalty(lp, lr, "low_var_kl", **kwargs)


def _openrlhf(lp, lr, **kwargs):
    return openrlhf.compute_approx_kl(lp, lr, kl_estimator="k3", **kwargs)


DROP_INS = {
    "verl": DropIn(_verl, "logprob", "ref_logprob", "logp_behavior", "mask"),
    "openrlhf": DropIn(_openrlhf, "log_probs", "log_probs_base", "log_probs_old", "action_mask"),
}
GRADS = ["peer", "cumulative", "score", "rb"]
B, T, V = 3, 4, 5


def _batch(grad: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Log-probs of sampled tokens under two random softmaxes, and the logits for ``"rb"``."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(V, (B, T, 1), generator=g)
    lp = z.log_softmax(-1).gather(-1, tokens).squeeze(-1)
    lr = y.log_softmax(-1).gather(-1, tokens).squeeze(-1)
    more = dict(logits=z, logits_ref=y) if grad == "rb" else {}
    return lp, lr, more


def _refused(drop_in, lp, lr, grad, more, **kwargs) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLGradientWarning)
        with pytest.raises(ValueError) as info:
            drop_in(lp, lr, grad=grad, **more, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("peer", sorted(DROP_INS))
def test_log_prob_errors_name_the_peers_arguments(peer, grad):
    d = DROP_INS[peer]
    lp, lr, more = _batch(grad)
    if grad == "peer":
        more = {}

    def positive(x):  # negative log-likelihoods passed as log-probs
        return x.detach().neg()

    cases = [
        (dict(lp=positive(lp), lr=lr), f"{d.logp} has values above 0"),
        (dict(lp=lp, lr=positive(lr)), f"{d.logp_ref} has values above 0"),
        (dict(lp=lp, lr=lr[:, :2]), f"{d.logp} has shape (3, 4) but {d.logp_ref} has shape"),
        (dict(lp=lp, lr=torch.full_like(lr, math.nan)), f"{d.logp_ref} contains NaN"),
        (dict(lp=lp, lr=lr, mask=torch.ones(B, T + 1, dtype=torch.bool)), f"{d.mask} has shape"),
        (dict(lp=lp, lr=lr, mask=torch.full((B, T), 2)), f"{d.mask} must hold only 0 and 1"),
    ]
    if grad != "peer" or peer == "openrlhf":  # verl's own gradient takes no behavior log-probs
        cases.append((dict(lp=lp, lr=lr, behavior=positive(lp)), f"{d.behavior} has values above"))
    for case, expected in cases:
        kwargs = dict(case)
        message = _refused(d, kwargs.pop("lp"), kwargs.pop("lr"), grad, more, **kwargs)
        assert expected in message, message
        assert "density" not in message, message


@pytest.mark.parametrize("grad", ["cumulative", "score", "rb"])
@pytest.mark.parametrize("peer", sorted(DROP_INS))
def test_gradient_warnings_and_surrogate_errors_name_the_peers_arguments(peer, grad):
    d = DROP_INS[peer]
    lp, lr, more = _batch(grad)
    more = {k: v.detach() for k, v in more.items()}
    with pytest.warns(KLGradientWarning, match=f"{d.logp} does not require grad"):
        d(lp.detach(), lr, grad=grad, **more)
    if grad == "rb":
        return  # rb's surrogate is the exact per-position KL's, from the logits
    # ref gives a sampled token probability 0: KL(pi||ref) is infinite, no finite gradient.
    lr_zero = lr.detach().clone()
    lr_zero[0, 1] = -math.inf
    message = _refused(d, lp, lr_zero, grad, more)
    assert f"{d.logp_ref} is -inf at 1 position(s)" in message, message


def test_klest_names_its_own_arguments_again_after_a_drop_in_failed():
    lp, lr, _ = _batch("cumulative")
    with pytest.raises(ValueError, match="log_probs_base has values above 0"):
        openrlhf.compute_approx_kl(lp, -lr, kl_estimator="k3", grad="cumulative")
    with pytest.raises(ValueError, match="logp_ref has values above 0") as info:
        klest.kl_penalty(lp, -lr)
    assert "density=True" in str(info.value)  # kl_penalty has that option


def test_names_are_per_thread_and_restored_whatever_the_interleaving():
    """Thread A enters a drop-in's names, B enters, A leaves, B leaves: neither thread's names
    outlive its block (a module-wide value restored by B would keep A's names for good)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def run(name, names, entered, wait_for, then_leave=None):
        with klest._checks.named_by_caller(names):
            entered.set()
            wait_for.wait(5)
            seen[name] = klest._checks.caller_names()
        if then_leave is not None:
            then_leave.set()
        seen[name + " after"] = klest._checks.caller_names()

    verl_names, openrlhf_names = verl._NAMES, openrlhf._NAMES
    a = threading.Thread(target=run, args=("a", verl_names, a_in, b_in, a_out))
    b = threading.Thread(target=run, args=("b", openrlhf_names, b_in, a_out))
    a.start()
    a_in.wait(5)
    b.start()
    a.join(10)
    b.join(10)
    assert seen["a"] == verl_names and seen["b"] == openrlhf_names
    assert seen["a after"] == seen["b after"] == klest._checks.KLEST_NAMES
    assert klest._checks.caller_names() == klest._checks.KLEST_NAMES
    with pytest.raises(ValueError, match="logp_ref has values above 0"):
        klest.kl_penalty(*_batch("cumulative")[:1], -_batch("cumulative")[1])


@pytest.mark.parametrize("peer", sorted(DROP_INS))
def test_drop_ins_compile_in_one_graph_and_name_their_arguments(peer):
    d = DROP_INS[peer]
    lp, lr, _ = _batch("cumulative")

    def loss(logp, logp_ref, validate):
        return d(logp, logp_ref, grad="cumulative", validate=validate)

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    lp_c, lp_e = lp.detach().requires_grad_(), lp.detach().requires_grad_()
    out, eager = compiled(lp_c, lr, False), loss(lp_e, lr, False)
    torch.testing.assert_close(out, eager, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    eager.sum().backward()
    torch.testing.assert_close(lp_c.grad, lp_e.grad, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=f"{d.logp_ref} has values above 0"):
        torch.compile(loss)(lp.detach(), -lr.detach(), None)
    assert klest._checks.caller_names() == klest._checks.KLEST_NAMES


def test_nested_names_restore_the_enclosing_callers_names():
    """The innermost block's names hold inside it; leaving it gives back the enclosing block's
    names (not klest's own), and leaving that one gives back klest's."""
    with klest._checks.named_by_caller(verl._NAMES):
        with klest._checks.named_by_caller(openrlhf._NAMES):
            assert klest._checks.caller_names() == openrlhf._NAMES
        assert klest._checks.caller_names() == verl._NAMES
    assert klest._checks.caller_names() == klest._checks.KLEST_NAMES
