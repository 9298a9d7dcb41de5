"""The distill experiment's gradients, and its quick run end to end.

The claims are restated from "On a few pitfalls in KL divergence gradient estimation for RL"
(Tang and Munos, 2025), not read from the code: a token-local KL advantage (discount 0) is
REINFORCE with per-token KL rewards, and its mean is the token-local gradient (prefix
distribution held fixed), not the gradient of the sequence KL; reward-to-go, its leave-one-out
and exact-KL-baselined forms and the Rao-Blackwellized gradient are unbiased for the sequence
KL; the exact per-token KL loss (full-logit distillation) and vOPD's token-level control variate
have the token-local mean. They are checked on a small causal LM whose completions can all be
enumerated, so both exact gradients are known.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

pytest.importorskip("transformers", reason="the klest[hf] extra (installed by make test)")
pytest.importorskip("matplotlib", reason="the klest[experiments] extra")

from klest._progress import progress_bar
from klest.audit import gradient_draws, mean_shift_z
from klest.experiments import distill as distill_module
from klest.experiments.distill import (
    BY_NAME,
    METHODS,
    QUICK,
    Method,
    Rollout,
    Sizes,
    _models,
    distill,
    prompts,
)
from klest.experiments.small_lms import sample_completions
from klest.sampled.rewards import kl_reward
from klest.testbeds import LanguageModelTestbed, make_generator
from klest.testbeds.base import Sample
from tests._stats import RATE, z_for
from tests.experiments.test_experiments import models_cached_in, run_quick


def _random_rollout(seed: int) -> tuple[Rollout, Tensor]:
    g = torch.Generator().manual_seed(seed)
    n, length, v = 6, 5, 7
    logits = torch.randn(n, length, v, generator=g, dtype=torch.float64, requires_grad=True)
    logits_ref = torch.randn(n, length, v, generator=g, dtype=torch.float64)
    tokens = torch.randint(v, (n, length, 1), generator=g)
    logp = logits.log_softmax(-1).gather(-1, tokens).squeeze(-1)
    logp_ref = logits_ref.log_softmax(-1).gather(-1, tokens).squeeze(-1)
    mask = torch.ones(n, length, dtype=torch.bool)
    mask[1, 3:] = False
    mask[4, 1:] = False
    logp = torch.where(mask, logp, 0.0)
    logp_ref = torch.where(mask, logp_ref, 0.0)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    return Rollout(logp, logp_ref, logits, logits_ref, mask, group), logits


def _reinforce_grad(r: Rollout, logits: Tensor, advantages: Tensor) -> Tensor:
    """Gradient of the REINFORCE loss -mean over sequences of sum_t A_t log pi(y_t)."""
    loss = -(advantages.detach() * r.logp).sum(-1).mean()
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    return grad


def _method_grad(name: str, r: Rollout, logits: Tensor) -> Tensor:
    (grad,) = torch.autograd.grad(BY_NAME[name].loss(r), logits, retain_graph=True)
    return grad


def test_token_is_reinforce_with_discount_zero_kl_rewards():
    """``token``'s gradient is REINFORCE's with each token's advantage its own KL reward
    -(log pi - log ref) (``kl_reward`` without reward-to-go: the return with discount 0), and
    ``cumulative``'s with the undiscounted reward-to-go; exact up to float64 rounding."""
    r, logits = _random_rollout(0)
    discount_zero = -kl_reward(r.logp, r.logp_ref, mask=r.mask)
    to_go = -kl_reward(r.logp, r.logp_ref, mask=r.mask, reward_to_go=True, discount=1.0)
    torch.testing.assert_close(
        _method_grad("token", r, logits), _reinforce_grad(r, logits, discount_zero)
    )
    torch.testing.assert_close(
        _method_grad("cumulative", r, logits), _reinforce_grad(r, logits, to_go)
    )
    # Discounting with a small gamma approaches discount 0, and differs from reward-to-go.
    nearly_zero = -kl_reward(r.logp, r.logp_ref, mask=r.mask, reward_to_go=True, discount=1e-9)
    torch.testing.assert_close(nearly_zero, discount_zero, atol=1e-7, rtol=0)
    assert not torch.allclose(to_go, discount_zero)


def test_discounted_is_reinforce_with_discounted_kl_returns():
    """``cumulative gamma=G``'s gradient is REINFORCE's with each token's advantage the
    discounted KL return -sum_{u>=t} G^(u-t) (log pi - log ref)_u (``kl_reward`` with
    ``discount=G``, an independent scan); exact up to float64 rounding."""
    r, logits = _random_rollout(2)
    discounted = [m for m in METHODS if m.discount != 1.0]
    assert {m.discount for m in discounted} == {0.9, 0.5}
    for method in discounted:
        returns = -kl_reward(
            r.logp, r.logp_ref, mask=r.mask, reward_to_go=True, discount=method.discount
        )
        torch.testing.assert_close(
            _method_grad(method.name, r, logits), _reinforce_grad(r, logits, returns)
        )


def test_iw_opd_matches_trl():
    """``token+iw-opd``'s gradient is that of TRL's experimental IW-OPD loss (its own code, on
    the same student logits, sampled tokens and teacher log-probs) times the number of valid
    tokens over the number of sequences: TRL takes the token mean, klest the sequence mean of
    token sums. Exact up to float64 rounding."""
    pytest.importorskip("trl", reason="the klest[trl] extra (installed by make test)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's warning that its experimental API may change
        from trl.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer

    g = torch.Generator().manual_seed(3)
    n, length, v = 6, 5, 7
    logits = torch.randn(n, length, v, generator=g, dtype=torch.float64, requires_grad=True)
    logits_ref = torch.randn(n, length, v, generator=g, dtype=torch.float64)
    tokens = torch.randint(v, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.bool)
    mask[1, 3:] = False
    mask[4, 1:] = False
    logp_ref = logits_ref.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    logp = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    method = BY_NAME["token+iw-opd"]
    trainer = SimpleNamespace(
        temperature=1.0,
        iw_opd_gamma=method.iw_opd,
        iw_opd_epsilon=1e-8,
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
    )
    labels = torch.where(mask, tokens, -100)
    trl_loss = IWOPDTrainer._compute_iw_opd_loss(trainer, logits, tokens, labels, logp_ref)
    (want,) = torch.autograd.grad(trl_loss, logits)
    r = Rollout(
        torch.where(mask, logp, 0.0),
        torch.where(mask, logp_ref, 0.0),
        logits,
        logits_ref,
        mask,
        torch.zeros(n, dtype=torch.long),
    )
    got = _method_grad("token+iw-opd", r, logits)
    torch.testing.assert_close(got, want * mask.sum() / n)
    assert float(want.abs().max()) > 0


def test_exact_token_kl_is_the_sum_of_next_token_kls():
    """The exact per-token KL loss against a float64 sum over the vocabulary written here."""
    r, logits = _random_rollout(1)
    q, p = logits.log_softmax(-1), r.logits_ref.log_softmax(-1)
    per_position = (q.exp() * (q - p)).sum(-1)
    want = torch.where(r.mask, per_position, 0.0).sum(-1).mean()
    loss = BY_NAME["exact-token-kl"].loss(r)
    torch.testing.assert_close(loss.double(), want)
    (got,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (ref,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got.double(), ref)


BATCH, TRIALS = 8, 300


@pytest.fixture(scope="module")
def testbed() -> LanguageModelTestbed:
    """A small Llama pair over V = 5 tokens, completions of up to 4 tokens after a one-token
    prompt: 625 sequences, enumerated. KL(pi||ref) about 1.3 nats."""
    return LanguageModelTestbed.tiny(vocab_size=5, horizon=4, eos=1, scale=10.0, mix=1.0, seed=0)


def _loss_on(sample: Sample, name: str) -> Tensor:
    assert sample.mask is not None and sample.logits is not None
    group = torch.zeros(sample.logp.shape[0], dtype=torch.long)  # one prompt
    r = Rollout(sample.logp, sample.logp_ref, sample.logits, sample.logits_ref, sample.mask, group)
    return BY_NAME[name].loss(r)


def _shared_draws(
    testbed: LanguageModelTestbed, methods: list[Method], *, seed: int, trials: int = TRIALS
) -> Tensor:
    """``gradient_draws`` of every method at once, ``[methods, trials, params]``: the batches
    it would draw for each (one generator seeded ``seed``), drawn and scored once, each
    method's gradient taken through the same graph."""
    params = testbed.parameters()
    generator = make_generator(seed)
    rows = []
    for _ in range(trials):
        sample = testbed.sample(BATCH, generator=generator)
        row = []
        for i, method in enumerate(methods):
            grads = torch.autograd.grad(
                _loss_on(sample, method.name),
                params,
                retain_graph=i < len(methods) - 1,
                allow_unused=True,
            )
            row.append(
                torch.cat(
                    [
                        (torch.zeros_like(p) if g is None else g).reshape(-1).double()
                        for g, p in zip(grads, params, strict=True)
                    ]
                )
            )
        rows.append(torch.stack(row))
    return torch.stack(rows, dim=1)


def test_shared_draws_are_gradient_draws(testbed):
    """The shared batches of :func:`_shared_draws` are ``gradient_draws``' own, method by
    method: equal to the last bit on a few trials (the same generator, the same arithmetic)."""
    methods = [BY_NAME["token"], BY_NAME["rb"]]
    shared = _shared_draws(testbed, methods, seed=3, trials=4)
    for method, got in zip(methods, shared, strict=True):
        want = gradient_draws(
            lambda s, name=method.name: _loss_on(s, name),
            testbed,
            batch_size=BATCH,
            n_trials=4,
            seed=3,
        )
        assert torch.equal(got, want), method.name


def test_one_step_mean_gradients_on_an_enumerable_lm(testbed):
    """Over 300 independent batches of 8 completions, each method's mean gradient (w.r.t. all
    of the policy's parameters) against the exact gradients, by ``mean_shift_z`` (N(0, 1), tail
    included, under "the mean is this gradient", large rejects):

    - sequence-level methods: mean = grad KL(pi||ref) (null; 5 comparisons);
    - token-local methods: mean = the token-local gradient (null; 3 comparisons), and the
      mean is *not* grad KL(pi||ref) (3 detections).

    All 8 nulls share the family false-fail rate RATE (Bonferroni, one-sided); the detections
    use the same threshold (4.3) and pass by a margin: the detections are 9.1, 10.7 and 20
    (the nulls at most 2.2). The discounted and IW-OPD-weighted methods, whose means are
    neither gradient, are checked exactly in
    :func:`test_discounted_is_reinforce_with_discounted_kl_returns` and
    :func:`test_iw_opd_matches_trl`.
    """
    flat = [g.reshape(-1).double() for g in testbed.exact_kl_grad("pi||ref")]
    sequence_grad = torch.cat(flat)
    local = torch.cat([g.reshape(-1).double() for g in testbed.token_local().exact_kl_grad()])
    assert float((sequence_grad - local).norm()) > 0.1 * float(sequence_grad.norm())
    tested = [m for m in METHODS if m.sequence_level or m.token_local]
    assert len(tested) == 8
    threshold = z_for(RATE, len(tested), two_sided=False)
    for method, draws in zip(tested, _shared_draws(testbed, tested, seed=7), strict=True):
        z_sequence = mean_shift_z(draws, sequence_grad)
        if method.sequence_level:
            assert z_sequence <= threshold, (method.name, z_sequence)
        else:
            z_local = mean_shift_z(draws, local)
            assert z_local <= threshold, (method.name, z_local)
            assert z_sequence > threshold, (method.name, z_sequence)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The module's small-LM cache: the quick run trains its models here (seed 0), the slow
    test loads them."""
    return tmp_path_factory.mktemp("distill-models")


def test_distill_quick(tmp_path, models):
    """The quick run end to end, and its exact claims: all methods start from the same student
    and evaluate on the same held-out samples (their step-0 numbers are identical), and the
    ratio of ``token`` to itself is 1.

    Its training claims are tested at a larger size (:func:`test_training_lowers_the_kl`): 6
    steps of 16 completions have no power for them: the drop of KL(pi||ref) from the high-KL
    start, over the standard error of the two held-out estimates, averages about 4.9 against
    the one-sided threshold 4.41 (Bonferroni over 12 comparisons), and 256 held-out samples per
    start leave the gap between the starts a standard error of 0.85 nats.
    """
    with models_cached_in(distill_module, models):
        r = run_quick("distill", tmp_path)
    runs = r["runs"]
    assert set(runs) == {"high KL", "low KL"}
    for methods in runs.values():
        assert set(methods) == {m.name for m in METHODS}
        first = [(s["kl"][0], s["kl_rev"][0], s["step"]) for s in methods["token"]]
        for name, seeds in methods.items():
            assert [(s["kl"][0], s["kl_rev"][0], s["step"]) for s in seeds] == first, name
    for start in runs:
        assert r["final"][start]["token"]["ratio_to_token"] == pytest.approx(1.0)


# The training claims' size: the quick models and learning rate, 60 steps (not 6) evaluated at
# the start and the end only, and the starts compared on 2048 held-out samples each (not 256).
LONGER = replace(QUICK, steps=60, eval_every=60)
GAP_SAMPLES = 2048


def _train(student, teacher, method: Method, sizes: Sizes, seed: int) -> dict[str, list[float]]:
    """The experiment's run of ``method`` from ``student``: its held-out curves. The teacher's
    own samples (for KL(ref||pi), not asserted on here) are few."""
    gen = torch.Generator().manual_seed(seed)
    teacher_batch = sample_completions(teacher, prompts(16, generator=gen), generator=gen)
    bar = progress_bar(desc="distill", enabled=False)
    return distill(student, teacher, method, sizes, seed=seed, teacher_batch=teacher_batch, bar=bar)


@pytest.mark.slow
def test_training_lowers_the_kl(models):
    """The quick models, and 60 steps per method (about 30 s in all): one-sided claims at
    family rate RATE, Bonferroni over the 12 of them (threshold 4.41):

    - the high-KL start is farther from the teacher than the low-KL one: the difference of two
      independent held-out means over its standard error. Across model seeds the gap is 5.8
      +- 1.1 nats and, at 2048 samples per start, its standard error 0.31 nats: the threshold,
      1.37 nats, is 4.0 standard deviations of the gap below its mean (about 3e-5 under a
      normal fit);
    - every method lowers KL(pi||ref) from the high-KL start in 60 steps (start minus final over
      the combined standard error of the two independent held-out estimates): the smallest
      method's statistic per run is 16.8 +- 1.9, 6.5 standard deviations above the threshold.
      (At 30 steps the token-local methods have too little margin; at 6, see
      :func:`test_distill_quick`.)
    """
    z = z_for(RATE, len(METHODS) + 1, two_sided=False)
    for claim, stat in _training_z(0, models).items():
        assert stat > z, (claim, stat)


def _training_z(seed: int, cache) -> dict[str, float]:
    """The statistics of :func:`test_training_lowers_the_kl` (each expected far above its
    threshold) for models, training and held-out samples drawn from ``seed``."""
    teacher, starts = _models(QUICK, seed, cache, progress=False)
    # Step 0 only, each start on held-out samples of its own: independent estimates.
    evaluate = replace(QUICK, steps=0, eval_samples=GAP_SAMPLES)
    high, low = (
        _train(starts[s], teacher, METHODS[0], evaluate, i) for i, s in enumerate(starts, seed + 1)
    )
    stats = {"gap": (high["kl"][0] - low["kl"][0]) / math.hypot(high["kl_se"][0], low["kl_se"][0])}
    for method in METHODS:
        kl = _train(starts["high KL"], teacher, method, LONGER, seed)
        drop = kl["kl"][0] - kl["kl"][-1]
        stats[method.name] = drop / math.hypot(kl["kl_se"][0], kl["kl_se"][-1])
    return stats
