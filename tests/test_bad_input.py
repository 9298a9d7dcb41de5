"""Every bad input is a TypeError / ValueError that names the argument, never a silent NaN."""

from __future__ import annotations

import warnings

import pytest
import torch

import klest

P = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
Q = torch.tensor([[-1.2, -1.0], [-0.9, -0.3]])


def test_mismatched_shapes_name_both():
    with pytest.raises(
        ValueError, match=r"logp has shape \(2, 2\) but logp_ref has shape \(2, 3\)"
    ):
        klest.k3(P, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="logp_behavior has shape"):
        klest.k3(P, Q, logp_behavior=torch.zeros(3))
    with pytest.raises(ValueError, match=r"mask has shape \(2,\)"):
        klest.k3(P, Q, mask=torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("name", ["logp", "logp_ref", "logp_behavior"])
def test_nan_is_rejected_naming_the_argument(name):
    args = {"logp": P.clone(), "logp_ref": Q.clone(), "logp_behavior": Q.clone()}
    args[name][1, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"{name} contains NaN .*\(1, 0\)"):
        klest.k3(args["logp"], args["logp_ref"], logp_behavior=args["logp_behavior"])


def test_logp_minus_inf_is_a_sample_pi_cannot_produce():
    bad = P.clone()
    bad[0, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"logp is -inf .* a sample pi cannot produce"):
        klest.k1(bad, Q)
    with pytest.raises(ValueError, match="logp_behavior is -inf"):
        klest.k1(P, Q, logp_behavior=bad)


def test_plus_inf_log_probs_are_rejected():
    bad = Q.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"logp_ref contains \+inf"):
        klest.k3(P, bad)


@pytest.mark.parametrize(
    ("passed", "guess"),
    [
        (P.exp(), "probabilities"),
        (-P, "negative log-likelihoods"),
        (torch.tensor([[2.5, -1.0], [0.3, -4.0]]), "raw logits"),
    ],
)
@pytest.mark.parametrize("name", ["logp", "logp_ref"])
def test_log_probs_above_zero_say_what_was_probably_passed(name, passed, guess):
    args = {"logp": P, "logp_ref": Q} | {name: passed}
    with pytest.raises(ValueError, match=rf"{name} has values above 0 .*Were these {guess}"):
        klest.k3(args["logp"], args["logp_ref"])
    with pytest.raises(ValueError, match=rf"{name} has values above 0"):
        klest.kl_penalty(args["logp"].clone().requires_grad_(), args["logp_ref"])


def _raised(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def test_density_is_suggested_only_where_it_is_an_option_and_peers_name_their_arguments():
    """Probabilities passed for log-probs: the message names the argument as the function
    calls it, and suggests ``density=True`` only to functions that take it (a reward, the
    verl / OpenRLHF drop-ins and a teacher's top-k log-probs are over tokens)."""
    from klest.integrations import openrlhf, verl

    probs = P.exp()
    assert "pass density=True" in _raised(lambda: klest.k3(probs, Q))
    assert "pass density=True" in _raised(lambda: klest.kl_penalty(probs, Q))
    calls = {
        "logp": lambda: klest.kl_reward(probs, Q),
        "logprob": lambda: verl.kl_penalty(probs, Q, "low_var_kl"),
        "ref_logprob": lambda: verl.kl_penalty(P, probs, "k1"),
        "log_probs": lambda: openrlhf.compute_approx_kl(probs, Q, kl_estimator="k3"),
        "log_probs_old": lambda: openrlhf.compute_approx_kl(P, Q, probs, kl_estimator="k2"),
        "topk_logp": lambda: klest.kl_from_topk(
            torch.zeros(2, 2, 4),
            torch.tensor([0, 1]).expand(2, 2, 2),
            torch.full((2, 2, 2), 0.4),
            estimator="tail-bucket",
        ),
    }
    for name, call in calls.items():
        message = _raised(call)
        assert message.startswith(f"{name} has values above 0"), message
        assert "Were these probabilities" in message, message
        assert "density" not in message, message


def test_rounding_above_zero_is_not_an_error():
    """log_softmax in float32 can return a log-prob a few ulps above 0; bf16 more."""
    logp = torch.tensor([[1e-6, -1.0], [-0.5, -0.7]])
    assert torch.isfinite(klest.k3(logp, Q))
    assert torch.isfinite(klest.k3(logp.bfloat16() + 0.03, Q.bfloat16()))
    with pytest.raises(ValueError, match="above 0"):
        klest.k3(logp + 0.01, Q)


def test_validate_false_skips_the_value_checks():
    bad = P.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        klest.k3(bad, Q)
    assert torch.isnan(klest.k3(bad, Q, validate=False))
    klest.set_default_validate(False)
    try:
        assert torch.isnan(klest.k3(bad, Q))
        with pytest.raises(ValueError, match="NaN"):
            klest.k3(bad, Q, validate=True)
    finally:
        klest.set_default_validate(True)
    with pytest.raises(TypeError, match="validate must be a bool"):
        klest.k3(P, Q, validate="yes")
    # Structural checks always run.
    with pytest.raises(ValueError, match="logp_ref has shape"):
        klest.k3(P, Q[:1], validate=False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_dtypes(dtype):
    with pytest.raises(TypeError, match="logp must have a floating-point dtype"):
        klest.k3(P.to(dtype), Q)
    with pytest.raises(TypeError, match="logp_ref must have a floating-point dtype"):
        klest.k3(P, Q.to(dtype))


def test_non_tensors():
    with pytest.raises(TypeError, match=r"logp must be a torch\.Tensor, got list"):
        klest.k3([-1.0], Q)
    with pytest.raises(TypeError, match=r"mask must be a torch\.Tensor"):
        klest.k3(P, Q, mask=[[1, 1], [1, 1]])


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown estimator 'k4'; expected one of 'k1'"):
        klest.kl_estimate(P, Q, estimator="k4")
    with pytest.raises(ValueError, match="unknown direction 'forward'"):
        klest.k3(P, Q, direction="forward")
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        klest.k3(P, Q, reduction="mean")
    with pytest.raises(ValueError, match="unknown level 'batch'"):
        klest.k3(P, Q, level="batch")
    with pytest.raises(ValueError, match="unknown alpha 'optimal'"):
        klest.cv(P, Q, alpha="optimal")


def test_estimator_option_errors():
    with pytest.raises(ValueError, match="estimator 'cv' needs alpha"):
        klest.kl_estimate(P, Q, estimator="cv")
    with pytest.raises(ValueError, match="alpha applies only to estimator='cv'"):
        klest.kl_estimate(P, Q, estimator="k3", alpha=0.5)
    with pytest.raises(ValueError, match="with level='sequence' use one of"):
        klest.k3(P, Q, level="sequence", reduction="token-mean")
    with pytest.raises(ValueError, match="alpha has shape"):
        klest.cv(P, Q, alpha=torch.ones(3))
    with pytest.raises(TypeError, match="alpha must be"):
        klest.cv(P, Q, alpha=[0.5])
    with pytest.raises(ValueError, match=r"mask must hold only 0 and 1 .* 4 position\(s\)"):
        klest.k3(P, Q, mask=torch.full((2, 2), 2.0))


def test_group_errors():
    with pytest.raises(TypeError, match="group must hold integer ids"):
        klest.cv(P, Q, alpha="loo", group=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"group has shape \(3,\)"):
        klest.cv(P, Q, alpha="loo", group=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="group applies only to a fitted alpha"):
        klest.kl_estimate(P, Q, estimator="k3", group=torch.tensor([0, 0]))


def test_categorical_kl_bad_input():
    z = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"logits has shape \(3, 5\) but logits_ref has shape"):
        klest.categorical_kl(z, torch.randn(3, 4))
    dead = z.clone()
    dead[1] = float("-inf")
    with pytest.raises(ValueError, match=r"logits_ref has 1 row\(s\) .*every entry -inf"):
        klest.categorical_kl(z, dead)
    nan = z.clone()
    nan[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"logits has 1 row.* with NaN or \+inf"):
        klest.categorical_kl(nan, z)
    with pytest.raises(TypeError, match="floating-point"):
        klest.categorical_kl(z.long(), z)
    # Masked rows are neither checked nor counted.
    out = klest.categorical_kl(dead, z, mask=torch.tensor([True, False, True]), reduction="none")
    assert torch.isfinite(out).all() and float(out[1]) == 0.0


def test_audit_and_spec_errors():
    from klest.audit import EstimatorSpec

    with pytest.raises(ValueError, match="needs a coefficient"):
        EstimatorSpec.parse("cv")
    with pytest.raises(ValueError, match="takes no argument"):
        EstimatorSpec.parse("k3:2")
    with pytest.raises(ValueError, match="unknown estimator"):
        EstimatorSpec.parse("k9")


@pytest.mark.parametrize("given", ["logits", "logits_ref"])
def test_exact_kls_need_both_logits(given):
    """An estimator of the exact per-position KLs given one of the two logits tensors names
    what it needs (not an error about the missing one's type)."""
    logits = {given: torch.zeros(*P.shape, 3)}
    with pytest.raises(ValueError, match="needs the full next-token distributions"):
        klest.kl_estimate(P, Q, estimator="rb", **logits)
    with pytest.raises(ValueError, match="needs the full next-token distributions"):
        klest.kl_penalty(P, Q, grad="rb", **logits)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("n", [5, 100_003])
def test_nan_or_inf_deep_in_a_long_logp_ref_is_rejected(bad, n):
    """logp_ref may be -inf, so its check reads only its largest value: a NaN or +inf anywhere
    (the vectorised reduction's tail included) must still reach it."""
    logp = -torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 0.1
    for where in (0, n // 2, n - 1):
        logp_ref = logp.clone()
        logp_ref[where] = bad
        what = "NaN" if bad != bad else r"\+inf"
        with pytest.raises(ValueError, match=rf"logp_ref contains {what} at .*index \({where},\)"):
            klest.k1(logp, logp_ref)


def test_value_checks_judge_flags_and_host_reads_in_registration_order():
    """Flags (any True fails) and 0-dim reads judged on the host share the one read; the first
    failed check in registration order raises; NaN fails a read's comparison."""
    from klest._checks import ValueChecks

    def run(*failing: bool) -> None:
        checks = ValueChecks(True)
        for i, bad in enumerate(failing):
            if i % 2:
                checks.add(torch.tensor([False, bad]), lambda _, i=i: f"check {i}")
            else:
                value = torch.tensor(1.0 if bad else -1.0)
                checks.add_read((value,), lambda v: v > 0, lambda i=i: f"check {i}")
        checks.run()

    run(False, False, False, False)
    for first in range(4):
        failing = [i >= first for i in range(4)]
        with pytest.raises(ValueError, match=f"check {first}"):
            run(*failing)
    checks = ValueChecks(True)
    checks.add_read((torch.tensor(float("nan")), torch.tensor(0.0)), lambda a, b: not a <= b, str)
    with pytest.raises(ValueError):
        checks.run()
    disabled = ValueChecks(False)
    disabled.add_read((torch.tensor(1.0),), lambda v: True, lambda: "never")
    disabled.run()  # disabled: nothing recorded, nothing raised


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_behavior_log_probs_are_refused_by_name(dtype):
    with pytest.raises(TypeError, match="logp_behavior must have a floating-point dtype"):
        klest.k3(P, Q, logp_behavior=Q.to(dtype))
    with pytest.raises(TypeError, match=r"logp_behavior must be a torch\.Tensor, got list"):
        klest.k3(P, Q, logp_behavior=Q.tolist())


def test_a_once_per_process_warning_queued_twice_in_one_call_is_given_once(monkeypatch):
    """The same key queued twice in one ValueChecks (both failing) gives one warning, the first
    one's message; a later call does not give it again."""
    from klest._checks import ValueChecks

    monkeypatch.setattr("klest._checks._WARNED_ONCE", set())
    checks = ValueChecks(True)
    checks.warn_once("key", torch.tensor([True]), lambda _: "first")
    checks.warn_once("key", torch.tensor([True]), lambda _: "second")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checks.run()
        again = ValueChecks(True)
        again.warn_once("key", torch.tensor([True]), lambda _: "third")
        again.run()
    assert [str(w.message) for w in caught] == ["first"]
