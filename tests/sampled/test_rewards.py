"""kl_reward: values against a hand-written loop (masks, padding, discount, rewards-to-go), no
graph, refusals and warnings; and the REINFORCE gradient of the reward against exact gradients.

Statistical rule (``tests/_stats.py``): each gradient check is a ``mean_shift_z`` statistic
(N(0, 1) under its null, tail included; see ``klest.audit.mean_shift_z``), one-sided. A test
with m null comparisons uses ``z_for(RATE, m, two_sided=False)`` each (family false-fail rate
``RATE`` = 6.3e-5, Bonferroni). Where a test asserts that a target is *rejected*, the measured
statistic is far above the threshold (each test says by how much). Seeds are fixed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from klest.audit import audit_grad, gradient_draws, mean_shift_z
from klest.sampled.penalty import KLGradientWarning
from klest.sampled.rewards import kl_reward
from klest.testbeds import Sample, TabularAutoregressive, make_generator
from tests._reference import (
    assert_verbose_close,
    estimator_formula,
    exact_token_level_gradient,
    left_padded,
)
from tests._stats import RATE, assert_failures_consistent, z_for
from tests._testbeds import make
from tests._tolerance import assert_close_to_rounding

# -- values ---------------------------------------------------------------------------------------


def reference_reward(logp, logp_ref, mask, estimator, discount, reward_to_go):
    """Row by row, token by token, in float64: the estimator's formula at each valid token (0
    elsewhere), and with ``reward_to_go`` the discounted sum over the valid tokens from t on
    (the discount counting token columns)."""
    rows, t_len = logp.shape
    out = torch.zeros(rows, t_len, dtype=torch.float64)
    for i in range(rows):
        v = [
            float(estimator_formula(logp[i, t] - logp_ref[i, t], estimator, "pi||ref"))
            if mask[i, t]
            else 0.0
            for t in range(t_len)
        ]
        for t in range(t_len):
            if not mask[i, t]:
                continue
            if reward_to_go:
                out[i, t] = sum(discount ** (u - t) * v[u] for u in range(t, t_len))
            else:
                out[i, t] = v[t]
    return out


def random_batch(rows: int, t_len: int, seed: int):
    """Log-probs of a trainer batch: right padding, an empty row, a hole."""
    g = make_generator(seed)
    logp = -torch.rand(rows, t_len, generator=g, dtype=torch.float64) * 2
    logp_ref = -torch.rand(rows, t_len, generator=g, dtype=torch.float64) * 2
    lengths = torch.randint(0, t_len + 1, (rows,), generator=g)
    lengths[0], lengths[1] = t_len, 0
    mask = torch.arange(t_len) < lengths.unsqueeze(1)
    mask[0, t_len // 2] = False  # a masked token inside a sequence
    return logp, logp_ref, mask


@pytest.mark.parametrize(
    ("discount", "reward_to_go"), [(1.0, False), (1.0, True), (0.9, True), (0.5, True)]
)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("t_len", [7, 150])  # 150: the discounted scan crosses its blocks
def test_values_match_the_loop(t_len, estimator, discount, reward_to_go):
    logp, logp_ref, mask = random_batch(5, t_len, seed=t_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KLGradientWarning)
        got = kl_reward(
            logp, logp_ref, mask=mask, estimator=estimator, discount=discount,
            reward_to_go=reward_to_go,
        )  # fmt: skip
    want = reference_reward(logp, logp_ref, mask, estimator, discount, reward_to_go)
    assert_verbose_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("discount", [1.0, 0.8])
def test_left_and_right_padding_give_the_same_rewards(discount):
    logp, logp_ref, mask = random_batch(6, 9, seed=3)
    mask[0, 4] = True  # contiguous completions: padding only at the ends
    right = kl_reward(logp, logp_ref, mask=mask, discount=discount, reward_to_go=True)
    left = kl_reward(
        left_padded(logp, mask), left_padded(logp_ref, mask), mask=left_padded(mask, mask),
        discount=discount, reward_to_go=True,
    )  # fmt: skip
    # Equal up to rounding: the discounted scan's matrix products sum in a layout-dependent order.
    assert_verbose_close(left, left_padded(right, mask), atol=1e-14)


def test_float32_and_no_mask_and_shapes():
    logp, logp_ref, _ = random_batch(4, 6, seed=5)
    got = kl_reward(logp.float(), logp_ref.bfloat16(), reward_to_go=True, discount=0.7)
    assert got.dtype == torch.float32
    want = reference_reward(logp, logp_ref.bfloat16().double(), torch.ones(4, 6, dtype=bool),
                            "k1", 0.7, True)  # fmt: skip
    # float32 inputs and arithmetic: each reward -(log pi - log ref) rounds at the log-probs'
    # size, and the discounted reward-to-go sums up to T = 6 of them: 8 roundings of the row's
    # sum of |log pi| + |log ref|
    size = (logp.abs() + logp_ref.abs()).sum(-1, keepdim=True)
    assert_close_to_rounding(got, want, ulps=8, scale=size)
    lead = kl_reward(logp.reshape(2, 2, 6), logp_ref.reshape(2, 2, 6), reward_to_go=True)
    assert lead.shape == (2, 2, 6)
    assert torch.equal(lead.reshape(4, 6), kl_reward(logp, logp_ref, reward_to_go=True))
    one_token = kl_reward(logp[:, 0], logp_ref[:, 0])  # [N] independent samples
    assert torch.equal(one_token, logp[:, 0] - logp_ref[:, 0])
    empty = kl_reward(logp[:, :0], logp_ref[:, :0], reward_to_go=True, discount=0.9)
    assert empty.shape == (4, 0)


def test_rewards_carry_no_graph():
    logp, logp_ref, mask = random_batch(3, 5, seed=6)
    logp.requires_grad_(True)
    with torch.enable_grad():
        for rtg in (False, True):
            out = kl_reward(logp, logp_ref, mask=mask, reward_to_go=rtg)
            assert not out.requires_grad and out.grad_fn is None


def test_refusals_and_warnings():
    logp, logp_ref, mask = random_batch(3, 5, seed=7)
    with pytest.raises(ValueError, match=r"direction='ref\|\|pi'\) is refused.*kl_penalty"):
        kl_reward(logp, logp_ref, direction="ref||pi")
    with pytest.raises(ValueError, match=r"estimator='rb'.*grad='rb'"):
        kl_reward(logp, logp_ref, estimator="rb")
    with pytest.raises(ValueError, match=r"estimator='cv'.*coefficient"):
        kl_reward(logp, logp_ref, estimator="cv")
    with pytest.raises(ValueError, match="unknown estimator"):
        kl_reward(logp, logp_ref, estimator="k4")
    for bad in (0.0, 1.5, -0.5, float("nan")):
        with pytest.raises(ValueError, match=r"discount must be in \(0, 1\]"):
            kl_reward(logp, logp_ref, discount=bad, reward_to_go=True)
    with pytest.raises(TypeError, match="discount must be a float"):
        kl_reward(logp, logp_ref, discount=True, reward_to_go=True)
    with pytest.raises(ValueError, match="pass reward_to_go=True"):
        kl_reward(logp, logp_ref, discount=0.9)
    with pytest.raises(ValueError, match=r"reward_to_go needs sequences"):
        kl_reward(logp[0], logp_ref[0], reward_to_go=True)
    with pytest.raises(TypeError, match="reward_to_go must be a bool"):
        kl_reward(logp, logp_ref, reward_to_go=1)
    with pytest.raises(ValueError, match="logp has values above 0"):
        kl_reward(-logp, logp_ref)
    with pytest.raises(ValueError, match=r"mask has shape \(3, 4\)"):
        kl_reward(logp, logp_ref, mask=mask[:, :4])
    for estimator, match in (("k3", "nearly cancel near ref"), ("k2", "biased too")):
        with pytest.warns(KLGradientWarning, match=match):
            kl_reward(logp, logp_ref, estimator=estimator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kl_reward(logp, logp_ref, mask=mask, reward_to_go=True)


# -- the reward's gradient ----------------------------------------------------------------------


def reinforce(estimator: str, reward_to_go: bool):
    """The REINFORCE surrogate of the KL as a reward (descending it): mean over sequences of
    sum_t log pi(y_t|y_<t) * G_t, with G_t the reward-to-go or the whole sequence's sum."""

    def loss(s: Sample) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KLGradientWarning)
            v = kl_reward(
                s.logp, s.logp_ref, mask=s.mask, estimator=estimator, reward_to_go=reward_to_go
            )
        if not reward_to_go:
            v = v.sum(-1, keepdim=True).expand_as(v)
        mask = torch.ones_like(v, dtype=torch.bool) if s.mask is None else s.mask
        return (torch.where(mask, s.logp, 0.0) * torch.where(mask, v, 0.0)).sum(-1).mean()

    return loss


def flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def test_k1_reward_gradient_is_the_gradient_of_the_sequence_kl():
    """Two null comparisons (rewards-to-go, whole returns) at z_for(RATE, 2) = 4.0 each; the
    power check (the mean gradient is not 0) measured z_zero 23.7 and 24.7."""
    for rtg in (True, False):
        z_target, z_zero = _k1_checks(rtg, seed=1)
        assert z_target <= K1_THRESHOLD, (rtg, z_target)
        assert z_zero > K1_THRESHOLD, (rtg, z_zero)


K1_THRESHOLD = z_for(RATE, 2, two_sided=False)


def _k1_checks(reward_to_go: bool, seed: int) -> tuple[float, float]:
    audit = audit_grad(
        reinforce("k1", reward_to_go), make("tabular"), batch_size=8, n_trials=400, seed=seed
    )
    return audit.z_target, audit.z_zero


@pytest.mark.calibration
def test_k1_reward_gradient_null_check_holds_over_seeds():
    """The null check above at 20 seeds per variant: no failure expected (40 x 3.2e-5)."""
    for rtg in (True, False):
        stats = [_k1_checks(rtg, seed)[0] for seed in range(100, 120)]
        assert_failures_consistent(stats, K1_THRESHOLD, RATE / 2, f"k1 reward, rtg={rtg}")


# k3 as a reward: E[g] = grad KL(pi||ref) - sum_t E_{y<t ~ pi}[grad KL(ref_t||pi_t)] (prefixes
# held fixed; klest.sampled.rewards). One null comparison per testbed, one-sided: z_for(RATE, 1,
# two_sided=False) = 3.83. Its rejections: "one-token" (one-token samples, where the
# per-position gradient of KL(ref||pi) is the KL's own) against grad KL(pi||ref); "tabular"
# against grad KL(pi||ref) and against the sequence-level grad KL(pi||ref) - grad KL(ref||pi),
# which the sequences' prefixes make wrong.
K3_TESTBEDS = {
    "one-token": lambda: TabularAutoregressive.random(4, 1, eos=0, seed=3, scale=1.0),
    "tabular": lambda: make("tabular"),
}
K3_THRESHOLD = z_for(RATE, 1, two_sided=False)


def _k3_checks(name: str, seed: int) -> tuple[float, dict[str, float]]:
    """The null statistic and the statistics of the targets to reject, from 100 batches of 32
    sequences drawn with ``seed``."""
    testbed = K3_TESTBEDS[name]()
    draws = gradient_draws(reinforce("k3", True), testbed, batch_size=32, n_trials=100, seed=seed)
    grad_pi_ref = flat(testbed.exact_kl_grad("pi||ref"))
    documented = grad_pi_ref - exact_token_level_gradient(testbed, "ref||pi")
    rejected = {"grad KL(pi||ref)": mean_shift_z(draws, grad_pi_ref)}
    if name == "tabular":
        sequence_level = grad_pi_ref - flat(testbed.exact_kl_grad("ref||pi"))
        rejected["grad KL(pi||ref) - grad KL(ref||pi)"] = mean_shift_z(draws, sequence_level)
    return mean_shift_z(draws, documented), rejected


@pytest.mark.parametrize("name", K3_TESTBEDS)
def test_k3_reward_gradient_is_the_documented_difference(name):
    """The null comparison at 3.83 (one-sided, RATE); the rejections average z = 26 (vs grad
    KL(pi||ref)) and 7.7 (sd 0.7, vs the sequence-level difference): 5 sd above 3.83."""
    z_null, rejected = _k3_checks(name, seed=2)
    assert z_null <= K3_THRESHOLD, (name, z_null)
    for target, z in rejected.items():
        assert z > K3_THRESHOLD, (name, target, z)


@pytest.mark.calibration
@pytest.mark.parametrize("name", K3_TESTBEDS)
def test_k3_reward_gradient_checks_hold_over_seeds(name):
    """The test above at 15 other draw seeds: no null failure expected (15 x RATE = 9.5e-4),
    and every rejection holds."""
    checks = [_k3_checks(name, seed) for seed in range(100, 115)]
    assert_failures_consistent([z for z, _ in checks], K3_THRESHOLD, RATE, f"k3 reward, {name}")
    weakest = min(z for _, rejected in checks for z in rejected.values())
    assert weakest > K3_THRESHOLD, (name, weakest)
