"""The kl-regularized-po experiment: its RLOO loss, its Pareto frontier, and its quick run.

The quick run's claims are checked against the curves it writes (every held-out evaluation's
means and standard errors, every training step's reward), with statistics computed here: the
held-out RB and MC estimates of KL(pi||ref) agree (both unbiased, same samples); at pi = ref the
KL is exactly 0 and the KL term moves nothing; a large beta holds the KL far below beta = 0's;
and (slow, over more seeds than the quick run's) at beta = 0 the reward rises.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import product
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the klest[hf] extra (installed by make test)")
pytest.importorskip("matplotlib", reason="the klest[experiments] extra")

from klest.experiments import kl_regularized_po
from klest.experiments.kl_regularized_po import (
    LOW_KL,
    QUICK,
    frontier_share,
    pareto_front,
    policy_loss,
    prompts,
    rloo_advantages,
    rloo_kl_terms,
    train,
    with_cross_terms,
)
from klest.experiments.reviews import NEUTRAL, sentiment
from klest.experiments.small_lms import (
    MAX_LENGTH,
    Architecture,
    Training,
    build_gpt2,
    completion_log_probs,
    sample_completions,
    trained_gpt2,
)
from tests._stats import RATE, t_for, z_for
from tests._tolerance import assert_close_to_rounding
from tests.experiments.test_experiments import models_cached_in, run_quick

TINY = Architecture(n_embd=16, n_layer=1, n_head=2)


def _slow_loo(values: list[float], group: list[int]) -> list[float]:
    """values[i] minus the mean of the other values of its group (0 when it is alone)."""
    out = []
    for i, g in enumerate(group):
        others = [values[j] for j, h in enumerate(group) if h == g and j != i]
        out.append(values[i] - (sum(others) / len(others) if others else 0.0))
    return out


def test_rloo_advantages_are_leave_one_out_and_sum_to_zero_per_group():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(13, generator=g, dtype=torch.float64) * 2 - 1
    group = torch.tensor([3, 3, 3, 3, 0, 0, 7, 7, 7, 7, 7, 1, 1])
    got = rloo_advantages(rewards, group)
    assert got.tolist() == pytest.approx(_slow_loo(rewards.tolist(), group.tolist()), abs=1e-12)
    for k in group.unique():
        assert abs(float(got[group == k].sum())) < 1e-12
    alone = rloo_advantages(torch.tensor([0.25, 0.5], dtype=torch.float64), torch.tensor([0, 1]))
    assert alone.tolist() == [0.25, 0.5]  # no other completion: baseline 0


def _dominated(i: int, reward: np.ndarray, kl: np.ndarray) -> bool:
    return any(
        reward[j] >= reward[i] and kl[j] <= kl[i] and (reward[j] > reward[i] or kl[j] < kl[i])
        for j in range(len(reward))
    )


@pytest.mark.parametrize("decimals", [None, 1])  # continuous points, and many ties
def test_pareto_front_matches_brute_force(decimals):
    rng = np.random.default_rng(1)
    for trial in range(200):
        n = int(rng.integers(1, 30))
        reward, kl = rng.uniform(-1, 1, n), rng.exponential(3.0, n)
        if decimals is not None:
            reward, kl = reward.round(decimals), kl.round(decimals)
        want = np.array([not _dominated(i, reward, kl) for i in range(n)])
        assert np.array_equal(pareto_front(reward, kl), want), (trial, reward, kl)
        labels = list(rng.choice(["mc", "rb"], n))
        on = want & (kl < LOW_KL)
        share = frontier_share(reward, kl, labels, kl_below=LOW_KL)
        assert share["points"] == int(on.sum())
        for label in ("mc", "rb"):
            if label in labels and on.any():
                held = sum(o and lab == label for o, lab in zip(on, labels, strict=True))
                assert share[label] == pytest.approx(held / on.sum())


def test_pareto_front_rejects_bad_input():
    with pytest.raises(ValueError, match="reward and kl"):
        pareto_front(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="finite"):
        pareto_front(np.array([0.0, np.nan]), np.zeros(2))


def test_mc_arm_is_rloo_on_the_reward_minus_beta_k1():
    """The MC arm's loss (REINFORCE with RLOO advantages plus beta * k1 with the score gradient
    and a leave-one-out baseline) has the gradient of plain RLOO on the reward r - beta * delta,
    delta the completion's log-ratio (the "KL in the reward" form), built here by hand."""
    policy = build_gpt2(TINY, max_length=MAX_LENGTH, seed=0).eval()
    ref = build_gpt2(TINY, max_length=MAX_LENGTH, seed=1).eval()
    gen = torch.Generator().manual_seed(2)
    batch = sample_completions(
        policy, prompts(6, generator=gen).repeat_interleave(4, 0), generator=gen
    )
    group = torch.arange(6).repeat_interleave(4)
    beta = 0.3
    params = list(policy.parameters())
    loss, _ = policy_loss(policy, ref, batch, group, beta=beta, estimator="mc")
    got = torch.autograd.grad(loss, params)

    _, logp = completion_log_probs(policy, batch)
    with torch.no_grad():
        _, logp_ref = completion_log_probs(ref, batch)
    delta = (logp.detach() - logp_ref).sum(-1)
    reward = sentiment(batch.tokens[:, batch.k :], batch.mask).double() - beta * delta
    advantage = torch.tensor(_slow_loo(reward.tolist(), group.tolist()), dtype=torch.float64)
    want = torch.autograd.grad(-(advantage * logp.sum(-1)).mean(), params)
    for a, b in zip(got, want, strict=True):
        # one float32 backward pass each, through the same model: normwise, its sums over the
        # batch and the model's width rounding at the scale of the largest entry (64 roundings)
        assert_close_to_rounding(a, b, ulps=64, dtype=torch.float32)


def test_policy_loss_rejects_an_unknown_estimator():
    policy = build_gpt2(TINY, max_length=MAX_LENGTH, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    batch = sample_completions(policy, prompts(2, generator=gen), generator=gen)
    with pytest.raises(ValueError, match="estimators must be among"):
        policy_loss(policy, policy, batch, torch.arange(2), beta=0.1, estimator="k3")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The module's small-LM cache: the quick run trains its ref here, the slow test loads it."""
    return tmp_path_factory.mktemp("po-models")


@pytest.fixture(scope="module")
def quick(tmp_path_factory, models) -> dict:
    with models_cached_in(kl_regularized_po, models):
        return run_quick("kl-regularized-po", tmp_path_factory.mktemp("po"))


def _runs(r: dict):
    """(beta, estimator, seed, run) for every run of the quick result."""
    for beta, by_est in r["runs"].items():
        for est, seeds in by_est.items():
            for seed, run in enumerate(seeds):
                yield float(beta), est, seed, run


def test_quick_kl_is_exactly_zero_at_the_start_and_the_first_step_is_shared(quick):
    """pi = ref at step 0: both held-out KL estimates are exactly 0, and both KL terms and their
    gradients are exactly 0, so every arm and beta takes the same first step from the same
    samples (same step-1 reward and same step-1 KL value per estimator), and at beta = 0 the
    two arms are the same run throughout. Exact equalities: the runs draw from the same
    generator seeds, so a KL gradient that were not exactly 0 at pi = ref would make the first
    updates, and through Adam and the samples the later steps, differ."""
    runs = list(_runs(quick))
    for _, _, _, run in runs:
        assert run["held_out"]["kl"][0] == 0.0 and run["held_out"]["kl_mc"][0] == 0.0
        assert run["held_out"]["kl"][1] > 0.0  # the policy moved
    for seed in {s for _, _, s, _ in runs}:
        same_seed = [(b, e, run) for b, e, s, run in runs if s == seed]
        assert len({run["train"]["reward"][1] for _, _, run in same_seed}) == 1
        for est in ("mc", "rb"):
            assert len({run["train"]["kl_estimate"][1] for _, e, run in same_seed if e == est}) == 1
        at_zero = {e: run for b, e, run in same_seed if b == 0.0}
        # The same policies throughout (the logged training KL values differ: k1 vs RB).
        assert at_zero["mc"]["train"]["reward"] == at_zero["rb"]["train"]["reward"]
        assert at_zero["mc"]["held_out"] == at_zero["rb"]["held_out"]


def test_quick_held_out_rb_and_mc_estimates_agree(quick):
    """Both held-out estimates are unbiased for KL(pi||ref) and computed on the same samples:
    their paired difference has mean 0. Every evaluation after step 0 is compared within Student
    t standard errors of the paired difference, Bonferroni over all of them (false-fail rate
    RATE; t = 5.3 for the quick run's 32 comparisons)."""
    comparisons = []
    for _, _, _, run in _runs(quick):
        h = run["held_out"]
        comparisons += list(zip(h["kl_mc_minus_rb"][1:], h["kl_mc_minus_rb_se"][1:], strict=True))
    n_min = quick["sizes"]["eval_samples"]
    t = t_for(RATE, len(comparisons), dof=n_min - 1)
    for diff, se in comparisons:
        assert se > 0 and abs(diff) <= t * se, (diff, se, t)


def _final_mean(runs: list[dict], key: str) -> tuple[float, float]:
    """The mean over ``runs`` of their final held-out ``key``, and a standard error that holds
    however the runs' evaluations are correlated (the mean of theirs: the runs of one seed
    evaluate with the same generator)."""
    return (
        sum(run["held_out"][key][-1] for run in runs) / len(runs),
        sum(run["held_out"][f"{key}_se"][-1] for run in runs) / len(runs),
    )


def test_quick_large_beta_holds_the_kl(quick):
    """The final KL at the large beta, averaged over seeds and arms, is below beta = 0's,
    averaged over seeds: one one-sided comparison of the two means, above z_for(RATE, 1,
    two_sided=False) = 3.83 standard errors (false-fail rate RATE from the evaluations' noise).

    The training's own randomness counts too: the final KL's log has mean 3.55 (sd 0.91) at
    beta = 0 and -0.74 (sd 0.56) at beta = 1. Compared per seed and arm instead, a beta = 0 run
    ending below about 2.5 nats would fail: 2e-3 per run under a normal fit to the log-KL.
    Averaged, both seeds' runs must (both below about 2: 4e-6).

    The reward's rise at beta = 0 is not asserted here: a run's rise is at the mercy of its
    training (a run can fall), and averaged over the quick run's 2 seeds it is about a 0.3%
    false-fail rate under a normal fit to the runs' rises (mean 0.66, sd 0.23).
    :func:`test_reward_rises_at_beta_zero` asserts it at 6 seeds."""
    runs = list(_runs(quick))
    betas = sorted({b for b, _, _, _ in runs})
    assert betas[0] == 0.0 and betas[-1] >= 1.0
    free = [run for b, e, _, run in runs if b == betas[0] and e == "mc"]  # = the rb arm's
    held = [run for b, _, _, run in runs if b == betas[-1]]
    (kl_free, se_free), (kl_held, se_held) = _final_mean(free, "kl"), _final_mean(held, "kl")
    z = z_for(RATE, 1, two_sided=False)
    assert kl_free - kl_held > z * math.hypot(se_free, se_held), (kl_free, kl_held)


@pytest.mark.slow
def test_reward_rises_at_beta_zero(models):
    """The quick run's training at beta = 0 (its ref, sizes and steps) at 6 seeds: the mean of
    the final held-out rewards is above the mean of the starts' (pi = ref), one one-sided
    comparison above z_for(RATE, 1, two_sided=False) = 3.83 standard errors (false-fail rate
    RATE from the evaluations' noise). The runs' own spread: a run's rise has mean 0.68 and sd
    0.19 to 0.23 across refs; the mean of 6 fails below about 0.12, more than 5.7 of its sds
    under the mean. Evaluating only at the start and the end changes no step (the evaluations
    draw from their own generators)."""
    ref, _ = trained_gpt2(
        QUICK.arch,
        Training(NEUTRAL, steps=QUICK.ref_steps, seed=0),
        cache_dir=models,
        progress=False,
    )
    sizes = replace(QUICK, eval_every=QUICK.steps)
    n = 6
    evals = [
        train(ref, beta=0.0, estimator="mc", seed=s, sizes=sizes)[0]["held_out"] for s in range(n)
    ]
    rise = sum(h["reward"][-1] - h["reward"][0] for h in evals) / n
    se = math.sqrt(sum(h["reward_se"][-1] ** 2 + h["reward_se"][0] ** 2 for h in evals)) / n
    assert rise > z_for(RATE, 1, two_sided=False) * se, (rise, se)


def test_quick_frontier_is_the_brute_force_frontier_of_the_final_points(quick):
    points = quick["frontier"]["points"]
    reward = np.array([p["reward"] for p in points])
    kl = np.array([p["kl"] for p in points])
    on = [not _dominated(i, reward, kl) for i in range(len(points))]
    assert [p["on_frontier"] for p in points] == on
    for p, (b, e, s, run) in zip(points, _runs(quick), strict=True):
        assert (p["beta"], p["estimator"], p["seed"]) == (b, e, s)
        assert (p["reward"], p["kl"]) == (run["held_out"]["reward"][-1], run["held_out"]["kl"][-1])
    rb = sum(o and p["estimator"] == "rb" for o, p in zip(on, points, strict=True))
    assert quick["frontier"]["share"]["all"]["rb"] == pytest.approx(rb / sum(on))
    assert set(product(["all", f"kl<{LOW_KL:g}"], ["rb", "mc", "points"])) <= {
        (region, k) for region, share in quick["frontier"]["share"].items() for k in share
    }


# The mechanism of the gradient-noise study, exactly: a policy over two-token completions
# (V = 3, 9 completions) with K = 3 completions of one prompt per batch, all 9^3 batches
# enumerated with their probabilities.
V, K = 3, 3
COMPLETIONS = torch.tensor(list(product(range(V), repeat=2)))
BATCHES = torch.tensor(list(product(range(len(COMPLETIONS)), repeat=K)))


def _table_rows(y: torch.Tensor) -> torch.Tensor:
    """The table row of each position: 0 for the first token, 1 + y_1 for the second."""
    return torch.stack([torch.zeros_like(y[:, 0]), 1 + y[:, 0]], 1)


def _tilted_policy(seed: int, *, temperature: float, jitter: float):
    """ref (a random table), a reward r in [-1, 1] per completion, and pi(y) proportional to
    ref(y) exp(r(y) / temperature + jitter * noise(y)) as a table of next-token log-probs: the
    policy KL-regularized training moves toward (at jitter 0, the optimum of beta =
    temperature), whose log-ratio is r / temperature up to the noise and a constant."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(1 + V, V, generator=g, dtype=torch.float64).log_softmax(-1)
    reward = torch.rand(len(COMPLETIONS), generator=g, dtype=torch.float64) * 2 - 1
    noise = torch.randn(len(COMPLETIONS), generator=g, dtype=torch.float64)
    logref = ref[_table_rows(COMPLETIONS), COMPLETIONS].sum(-1)
    joint = (logref + reward / temperature + jitter * noise).log_softmax(0).view(V, V)
    first = joint.logsumexp(1)
    return torch.cat([first[None], joint - first[:, None]]), ref, reward


def _enumerated_parts(table, ref, reward):
    """Every batch's probability ``[B]`` and the gradients ``[B, P]`` (w.r.t. pi's table) of
    the experiment's loss parts on it: the RLOO reward term and each arm's KL term
    (:func:`rloo_kl_terms`). One backward: each batch has a copy of the table."""
    n = len(BATCHES)
    copies = table.expand(n, *table.shape).clone().requires_grad_(True)
    y = COMPLETIONS[BATCHES].reshape(n * K, 2)
    batch = torch.arange(n).repeat_interleave(K)
    rows = _table_rows(y)
    logits = copies[batch[:, None], rows].log_softmax(-1)
    logits_ref = ref[rows]
    logp = logits.gather(-1, y[..., None]).squeeze(-1)
    logp_ref = logits_ref.gather(-1, y[..., None]).squeeze(-1)
    mask = torch.ones_like(y, dtype=torch.bool)
    rewards = reward[BATCHES].reshape(-1)
    reinforce, kls = rloo_kl_terms(logp, logp_ref, logits, logits_ref, mask, rewards, batch)

    def per_batch(loss):  # the losses average over all batches' rows: n times each one's
        (grad,) = torch.autograd.grad(loss, copies, retain_graph=True)
        return (n * grad).reshape(n, -1)

    parts = {"reward": per_batch(reinforce)} | {f"kl/{e}": per_batch(v) for e, v in kls.items()}
    logp_completion = table.log_softmax(-1)[_table_rows(COMPLETIONS), COMPLETIONS].sum(-1)
    return logp_completion[BATCHES].sum(-1).exp(), parts


def _mean_var(prob, x):
    mean = (prob[:, None] * x).sum(0)
    return mean, float((prob[:, None] * (x - mean).square()).sum())


def _exact_noise(prob, parts, beta) -> dict[str, float]:
    """The gradient-noise study's total variances, exact over the enumerated batches."""
    noise = {"reward": _mean_var(prob, parts["reward"])[1]}
    for est in ("mc", "rb"):
        noise[f"kl/{est}"] = _mean_var(prob, beta * parts[f"kl/{est}"])[1]
        noise[f"total/{est}"] = _mean_var(prob, parts["reward"] + beta * parts[f"kl/{est}"])[1]
    return with_cross_terms(noise)


def test_mc_log_ratio_cancels_reward_noise_exactly():
    """The gradient-noise finding, by enumerating every batch: for a policy tilted toward the
    reward (its log-ratio r / 1 plus noise of sd 0.3), MC's KL-term gradient cancels part of
    the reward term's: the cross term Var(whole) - Var(reward) - Var(beta x KL) is negative,
    below RB's, and MC's whole gradient is less noisy than RB's, at beta = 0.1, 0.3, 1 (up to
    twice the tilt); at beta = 3 the KL term's own noise dominates and RB's whole gradient is
    the quieter. At the exact optimum (no noise, beta = the tilt) MC's reward minus beta times
    the log-ratio is the same for every completion, so its whole gradient is 0 on every batch.
    Exact values: the checks are inequalities between exact sums (margins: MC's cross term is
    at least 10x RB's), and the enumeration is checked against the exact means (both KL terms
    unbiased for the gradient of KL(pi||ref), the reward term for minus that of E[r]), to
    float64 rounding of sums over the 729 batches (729 x 16 roundings at the gradient's scale).
    """
    table, ref, reward = _tilted_policy(0, temperature=1.0, jitter=0.3)
    prob, parts = _enumerated_parts(table, ref, reward)
    assert_close_to_rounding(prob.sum(), torch.tensor(1.0, dtype=torch.float64), ulps=729)
    theta = table.clone().requires_grad_(True)
    logp = theta.log_softmax(-1)[_table_rows(COMPLETIONS), COMPLETIONS].sum(-1)
    logref = ref[_table_rows(COMPLETIONS), COMPLETIONS].sum(-1)
    kl_grad, reward_grad = (
        torch.autograd.grad((logp.exp() * f).sum(), theta, retain_graph=True)[0].reshape(-1)
        for f in (logp - logref, reward)
    )
    scale = max(float(p.abs().max()) for p in parts.values())
    for name, want in (("kl/mc", kl_grad), ("kl/rb", kl_grad), ("reward", -reward_grad)):
        got = _mean_var(prob, parts[name])[0]
        assert_close_to_rounding(got, want, ulps=729 * 16, scale=scale, what=name)

    for beta in (0.1, 0.3, 1.0):
        v = _exact_noise(prob, parts, beta)
        assert v["cross/mc"] < 10 * v["cross/rb"] < 0, (beta, v)
        assert v["total/mc"] < v["total/rb"], (beta, v)
    v = _exact_noise(prob, parts, 3.0)
    assert v["cross/mc"] < 0 and v["total/mc"] > v["total/rb"], v

    table, ref, reward = _tilted_policy(1, temperature=0.5, jitter=0.0)
    prob, parts = _enumerated_parts(table, ref, reward)
    whole = {e: parts["reward"] + 0.5 * parts[f"kl/{e}"] for e in ("mc", "rb")}
    # Each batch's whole MC gradient: K = 3 scores times advantages that cancel to 0, each a
    # difference of terms of the gradient parts' size (16 roundings of it).
    assert_close_to_rounding(
        whole["mc"],
        torch.zeros_like(whole["mc"]),
        ulps=16,
        scale=float(parts["reward"].abs().max()),
    )
    assert _mean_var(prob, whole["rb"])[1] > 0.1 * _mean_var(prob, parts["reward"])[1]
