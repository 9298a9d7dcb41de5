"""klest inside TRL's trainers, end to end on CPU: a tiny LM built from a config, a toy reward.

Each trainer trains for a few steps with gradient accumulation 2 and truncated completions
masked out; on a batch the trainer saw, the term it adds to TRL's policy loss is checked,
value and gradient, against klest computed here from an independent forward pass.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import klest

pytest.importorskip("trl", reason="the klest[trl] extra (installed by make test)")
pytest.importorskip("datasets")

from trl import DistillationConfig, GRPOConfig, RLOOConfig

from klest.integrations.trl import (
    DistillationTrainer,
    KLTerm,
    RLOOTrainer,
)
from tests.integrations._trl_helpers import (
    ACCUMULATION,
    BETA,
    assert_divergence_value_close,
    assert_grads_close,
    assert_normwise_close,
    common_args,
    completion_logits,
    completion_logps,
    exact_distillation_kls,
    expected_term,
    groups_by_hand,
    grpo,
    kl_added_to_the_loss,
    perturbed,
    prompts,
    record_batches,
    save_tiny_lm,
    sequence_level_by_hand,
    token_sizes,
    tokenizer,
    tolerance,
    trainable,
    vocabulary_sizes,
)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("policy"), seed=0)


@pytest.mark.parametrize(("num_iterations", "loss_type"), [(1, "dapo"), (2, "dapo"), (1, "grpo")])
def test_grpo_trains_with_klests_kl_term_and_it_is_what_the_loss_adds(
    tiny_lm, tmp_path, num_iterations, loss_type
):
    """num_iterations=2 reuses each generation batch: the samples are off-policy the second time
    (TRL keeps the sampling policy's log-probs, which klest takes as logp_behavior). The term
    does not follow the loss type's normalization (TRL's own KL would: "grpo" averages each
    completion's tokens, "dapo" divides by the generation batch's tokens)."""
    kl = KLTerm(estimator="k3", grad="cumulative", baseline="loo")
    args = GRPOConfig(
        num_generations=2,
        num_iterations=num_iterations,
        loss_type=loss_type,
        mask_truncated_completions=True,
        **common_args(tmp_path),
    )
    trainer = grpo(tiny_lm, args, kl=kl)
    perturbed(trainer)
    seen = record_batches(trainer)
    trainer.train()
    assert len(seen) == 2 * ACCUMULATION
    logged = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert len(logged) == 2 and all(v == v and v >= 0.0 for v in logged)  # k3 is >= 0, not NaN

    trainer.model.train()
    batch = seen[-1]
    assert ("old_per_token_logps" in batch) == (num_iterations > 1)
    got = kl_added_to_the_loss(trainer, batch)
    expected, expected_grads = expected_term(
        trainer, batch, kl, scale=1 / trainer.current_gradient_accumulation_steps
    )
    model = trainer.model
    logp = completion_logps(model, batch)
    mask = batch["completion_mask"].bool()
    tol = tolerance(*token_sizes(logp, batch["ref_per_token_logps"]), mask, torch.float32)
    assert_normwise_close(got.value, expected, tol, scale=got.scale, what="value")
    assert_grads_close(got.grads, expected_grads, tol, scale=got.grad_scale)
    # beta = 1 is no special case: the term scales with beta (klest's, not TRL's, at any beta).
    trainer.beta = 1.0
    try:
        got_1 = kl_added_to_the_loss(trainer, batch)
    finally:
        trainer.beta = BETA
    assert_normwise_close(got_1.value, expected / BETA, tol, scale=got_1.scale, what="beta = 1")
    expected_1 = [None if e is None else e / BETA for e in expected_grads]
    assert_grads_close(got_1.grads, expected_1, tol, scale=got_1.grad_scale, what="beta = 1")

    # ... and it is not TRL's own term (k3 differentiated as a per-token loss).
    log_r = batch["ref_per_token_logps"] - logp
    trl_k3 = torch.where(mask, log_r.exp() - log_r - 1, 0.0)
    trl_term = BETA * (trl_k3.sum(-1) / mask.sum(-1).clamp(min=1)).mean() / ACCUMULATION
    params = trainable(model)
    trl_grads = torch.autograd.grad(trl_term, params, allow_unused=True)
    size = sum(float(g.abs().sum()) for g in got.grads if g is not None)
    diff = sum(
        float((g - t).abs().sum())
        for g, t in zip(got.grads, trl_grads, strict=True)
        if t is not None
    )
    assert diff > 0.05 * size


@pytest.mark.parametrize(
    ("bias_correction", "grad"), [(True, "token"), (False, "autodiff")], ids=["ratio", "plain"]
)
def test_kl_term_can_reproduce_trls_own_loss_value_and_gradient(
    tiny_lm, tmp_path, bias_correction, grad
):
    """TRL's k3 term is KLTerm(grad="token") with its importance ratio (use_bias_correction_kl,
    the default) and KLTerm(grad="autodiff") without, at TRL's scale "seq-mean-token-mean".

    With loss_type="grpo" TRL averages each completion's tokens, then the completions; klest's
    sequence mean leaves empty completions out, so none is masked here.
    """
    kl = KLTerm(estimator="k3", grad=grad, baseline=None, reduction="seq-mean-token-mean")
    args = GRPOConfig(
        num_generations=2,
        loss_type="grpo",
        use_bias_correction_kl=bias_correction,
        **common_args(tmp_path),
    )
    ours = perturbed(grpo(tiny_lm, args, kl=kl))
    seen = record_batches(ours)
    with pytest.warns(klest.KLGradientWarning):
        ours.train()
    ours.model.train()
    batch = seen[-1]
    from trl import GRPOTrainer as TRLGRPOTrainer

    params = trainable(ours.model)
    with pytest.warns(klest.KLGradientWarning):
        got = ours._compute_loss(ours.model, batch)
    theirs = TRLGRPOTrainer._compute_loss(ours, ours.model, batch)
    logp = completion_logps(ours.model, batch)
    sizes = token_sizes(logp, batch["ref_per_token_logps"])
    tol = tolerance(*sizes, batch["completion_mask"], torch.float32)
    assert_normwise_close(got, theirs, tol, what="value")
    assert_grads_close(
        torch.autograd.grad(got, params, allow_unused=True),
        torch.autograd.grad(theirs, params, allow_unused=True),
        tol,
    )


def _zero_reward(completions, **_):
    return [0.0 for _ in completions]


def _rloo(cls, tiny_lm, tmp_path, config: dict | None = None, **kwargs):
    settings = {"num_generations": 2, "mask_truncated_completions": True, **(config or {})}
    args = RLOOConfig(**settings, **common_args(tmp_path))
    return perturbed(
        cls(
            model=tiny_lm,
            reward_funcs=_zero_reward,
            args=args,
            train_dataset=prompts(),
            processing_class=tokenizer(),
            **kwargs,
        )
    )


def _logps_with_parameters(model, batch, parameters: dict) -> torch.Tensor:
    """The completion log-probs under other values of the model's parameters (restored after)."""
    current = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(parameters[n])
            return completion_logps(model, batch)
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(current[n])


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_rloo_moves_the_kl_from_the_reward_into_the_loss(tiny_lm, tmp_path, num_iterations):
    """num_iterations=2: the one generation batch is trained on again after an update, so the
    last micro-batch's samples come from the policy before training (behavior log-probs
    computed here from those parameters)."""
    kl = KLTerm()
    config = {"num_iterations": num_iterations}
    trainer = _rloo(RLOOTrainer, tiny_lm, tmp_path, config=config, kl=kl)
    sampler = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    seen = record_batches(trainer)
    trainer.train()
    assert len(seen) == 2 * ACCUMULATION
    assert trainer.beta == BETA  # restored after each scoring step
    # The task reward is 0, so without a KL in the reward every advantage is 0 ...
    assert all(torch.count_nonzero(b["advantages"]) == 0 for b in seen)
    batch = seen[-1]
    trainer.model.train()
    got = kl_added_to_the_loss(trainer, batch)
    assert ("old_per_token_logps" in batch) == (num_iterations > 1)
    behavior = _logps_with_parameters(trainer.model, batch, sampler) if num_iterations > 1 else None
    expected, expected_grads = expected_term(trainer, batch, kl, scale=1.0, logp_behavior=behavior)
    assert float(expected) > 0.0
    sizes = token_sizes(completion_logps(trainer.model, batch), batch["ref_per_token_logps"])
    tol = tolerance(*sizes, batch["completion_mask"], torch.float32)
    assert_normwise_close(got.value, expected, tol, scale=got.scale, what="value")
    assert_grads_close(got.grads, expected_grads, tol, scale=got.grad_scale)


@pytest.mark.parametrize("trainer_class", ["GRPOTrainer", "RLOOTrainer"])
def test_evaluation_adds_the_kl_term_without_gradient_accumulation_scaling(
    tiny_lm, tmp_path, trainer_class
):
    """TRL evaluates the same loss under torch.no_grad() (the KL term included); there is no
    accumulation in evaluation, so the term is beta * klest's value, unscaled."""
    kl = KLTerm()
    evaluation = {"per_device_eval_batch_size": 4}
    if trainer_class == "GRPOTrainer":
        args = GRPOConfig(num_generations=2, **evaluation, **common_args(tmp_path))
        trainer = perturbed(grpo(tiny_lm, args, kl=kl, eval_dataset=prompts()))
    else:
        trainer = _rloo(RLOOTrainer, tiny_lm, tmp_path, config=evaluation, kl=kl)
        trainer.eval_dataset = prompts()
    seen = record_batches(trainer)
    metrics = trainer.evaluate()
    assert len(seen) == 2 * len(prompts()) // 4  # num_generations=2 per prompt, 4 per batch
    assert torch.isfinite(torch.tensor([metrics["eval_loss"], metrics["eval_kl"]])).all()
    assert metrics["eval_kl"] > 0.0  # k3, with the policy moved away from the reference

    batch = seen[-1]
    trainer.model.eval()
    with torch.no_grad():
        full = trainer._compute_loss(trainer.model, batch)
        beta, trainer.beta = trainer.beta, 0.0
        try:
            policy_only = trainer._compute_loss(trainer.model, batch)
        finally:
            trainer.beta = beta
        logp = completion_logps(trainer.model, batch)
        expected = BETA * klest.kl_penalty(
            logp,
            batch["ref_per_token_logps"],
            mask=batch["completion_mask"].bool(),
            estimator=kl.estimator,
            baseline=kl.baseline,
            group=groups_by_hand(batch),
        )
    sizes = token_sizes(logp, batch["ref_per_token_logps"])
    tol = tolerance(*sizes, batch["completion_mask"], torch.float32)
    scale = max(abs(float(full)), abs(float(policy_only)))  # the terms the difference cancels
    assert_normwise_close(full - policy_only, expected, tol, scale=scale)


def test_trls_own_rloo_puts_the_kl_in_the_reward(tiny_lm, tmp_path):
    """... while TRL's RLOO, on the same set-up, gives advantages from its k1 reward penalty."""
    from trl import RLOOTrainer as TRLRLOOTrainer

    trainer = _rloo(TRLRLOOTrainer, tiny_lm, tmp_path)
    seen = record_batches(trainer)
    trainer.train()
    assert any(torch.count_nonzero(b["advantages"]) > 0 for b in seen)


def _distillation_trainer(tiny_lm, tmp_path, config: dict | None = None, **kwargs):
    teacher = save_tiny_lm(tmp_path / "teacher", seed=1)
    common = common_args(tmp_path)
    beta = kwargs.pop("beta", 1.0)
    common.update(beta=beta, **(config or {}))
    args = DistillationConfig(**common)
    return DistillationTrainer(
        model=tiny_lm,
        teacher_model=teacher,
        args=args,
        train_dataset=prompts(),
        processing_class=tokenizer(),
        **kwargs,
    )


def _distillation_step(tiny_lm, tmp_path, **kwargs):
    """Train a few steps; on the last batch, the trainer's loss and both models' logits."""
    trainer = _distillation_trainer(tiny_lm, tmp_path, **kwargs)
    seen = record_batches(trainer)
    trainer.train()
    batch = seen[-1]
    student = trainer.model
    out = trainer._compute_loss(student, batch, None)
    logits = completion_logits(student, batch)
    with torch.no_grad():
        logits_t = completion_logits(trainer.teacher_model, batch)
    return student, batch, out, logits, logits_t


def _assert_same_loss(loss, expected, model, logits, logits_t, mask):
    """Value and gradient, within the float32 tolerance of an exact KL from the logits."""
    assert_divergence_value_close(loss, expected, logits, logits_t, mask, torch.float32, "value")
    tol = tolerance(*vocabulary_sizes(logits, logits_t), mask, torch.float32)
    params = trainable(model)
    assert_grads_close(
        torch.autograd.grad(loss, params, allow_unused=True),
        torch.autograd.grad(expected, params, allow_unused=True),
        tol,
    )


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.3])
def test_distillation_loss_is_the_exact_divergence_from_materialized_logits(
    tiny_lm, tmp_path, beta
):
    """beta = 1: KL(student || teacher); 0: KL(teacher || student); in between TRL's generalized
    JSD with mixture beta teacher + (1 - beta) student (TRL's own function gives the same value,
    checked in tests/logits/test_jsd.py), each written out from the materialized logits."""
    student, batch, (loss, _, n_valid), logits, logits_t = _distillation_step(
        tiny_lm, tmp_path, beta=beta
    )
    mask = batch["completion_mask"].bool()
    per_position = exact_distillation_kls(logits, logits_t, beta)
    expected = torch.where(mask, per_position, 0.0).sum() / mask.sum().clamp(min=1)
    assert int(n_valid) == int(mask.sum())
    _assert_same_loss(loss, expected, student, logits, logits_t, mask)


def test_distillation_sequence_level_adds_the_future_kl_score_term(tiny_lm, tmp_path):
    student, batch, (loss, _, _), logits, logits_t = _distillation_step(
        tiny_lm, tmp_path, sequence_level=True
    )
    mask = batch["completion_mask"].bool()
    logp = logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    # By hand: sum_t KL_t + sum_t log pi(y_t) * sg(sum_{s>t} KL_s), over the valid tokens.
    by_hand = sequence_level_by_hand(exact_distillation_kls(logits, logits_t, 1.0), logp, mask)
    expected = by_hand.sum() / mask.sum().clamp(min=1)
    _assert_same_loss(loss, expected, student, logits, logits_t, mask)


def test_bad_options_are_refused_with_their_names(tiny_lm, tmp_path):
    with pytest.raises(ValueError, match="grad"):
        KLTerm(grad="pathwise")
    with pytest.raises(ValueError, match="baseline applies"):
        KLTerm(grad="token", baseline="loo")
    with pytest.raises(ValueError, match="reduction"):
        KLTerm(reduction="none")
    for exact in ("exact-kl", "exact-kl+loo"):
        # GRPO / RLOO hold the reference's sampled-token log-probs only, not its logits
        with pytest.raises(ValueError, match=r"needs the reference's logits.*sampled tokens"):
            KLTerm(baseline=exact)
        with pytest.raises(ValueError, match="conditional expectation of vOPD"):
            _distillation_trainer(tiny_lm, tmp_path, beta=1.0, sequence_level=True, baseline=exact)
    with pytest.raises(TypeError, match="KLTerm"):
        grpo(
            tiny_lm, GRPOConfig(num_generations=2, **common_args(tmp_path)), kl={"estimator": "k3"}
        )
    for beta in (0.0, 0.5):
        with pytest.raises(ValueError, match="sequence_level"):
            _distillation_trainer(tiny_lm, tmp_path, beta=beta, sequence_level=True)


def test_sampling_other_than_softmax_over_temperature_is_named(tiny_lm, tmp_path):
    """The log-probs are those of softmax(logits / temperature): with top-k / top-p sampling the
    completions come from another distribution. The sequence-level distillation gradient is
    refused; GRPO's and RLOO's KL terms warn (TRL's own term is biased the same way)."""
    with pytest.raises(ValueError, match=r"samples with top_k=5"):
        _distillation_trainer(tiny_lm, tmp_path, config={"top_k": 5}, sequence_level=True)
    with pytest.raises(ValueError, match=r"generation_kwargs\['typical_p'\]"):
        config = {"generation_kwargs": {"typical_p": 0.9}}
        _distillation_trainer(tiny_lm, tmp_path, config=config, sequence_level=True)
    _distillation_trainer(tiny_lm, tmp_path, config={"top_k": 5})  # per-token loss: exact KLs
    with pytest.warns(klest.KLGradientWarning, match=r"top_p=0\.9, repetition_penalty=1\.2"):
        config = GRPOConfig(
            num_generations=2, top_p=0.9, repetition_penalty=1.2, **common_args(tmp_path)
        )
        grpo(tiny_lm, config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", klest.KLGradientWarning)
        grpo(tiny_lm, GRPOConfig(num_generations=2, **common_args(tmp_path)))
        _distillation_trainer(tiny_lm, tmp_path, sequence_level=True)


def test_distillation_refuses_heads_whose_logits_are_scaled_or_soft_capped():
    """The fused distillation loss reads the output layer's weight: a config that scales the
    logits (any factor but 1, including 0) or soft-caps them is refused by name; factor 1 (or
    none) returns the Linear head itself."""
    from types import SimpleNamespace

    from klest.integrations.trl import _plain_lm_head

    head = torch.nn.Linear(4, 6)

    def model(**config):
        cfg = SimpleNamespace(**config)
        return SimpleNamespace(
            config=SimpleNamespace(get_text_config=lambda: cfg), get_output_embeddings=lambda: head
        )

    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        for factor in (0.0, 0.5, 2.0):
            with pytest.raises(NotImplementedError, match=f"scales its logits \\({name}\\)"):
                _plain_lm_head(model(**{name: factor}), "teacher")
        for factor in (None, 1, 1.0):
            assert _plain_lm_head(model(**{name: factor}), "student") is head
    with pytest.raises(NotImplementedError, match="soft-caps"):
        _plain_lm_head(model(final_logit_softcapping=30.0), "teacher")
