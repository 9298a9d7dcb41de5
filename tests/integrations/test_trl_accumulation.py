"""The TRL drop-ins under gradient accumulation (2 micro-batches per optimizer step), checked on
every micro-batch as the trainer computes it, against values computed at that moment from an
independent forward pass:

- the distillation loss of a micro-batch is its sum of exact per-token KLs divided by
  ``num_items_in_batch``, the valid tokens of the whole accumulation window (TRL's count), so
  the window's losses add up to the mean KL over all its tokens;
- the ``kl`` metric a GRPO / RLOO trainer logs is the KL estimate (klest's k3 value: the mean
  over completions of their summed k3), not the loss term scaled for accumulation (GRPO divides
  the term by the accumulation steps) nor multiplied by beta.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="the klest[trl] extra (installed by make test)")
pytest.importorskip("datasets")

from trl import DistillationConfig, GRPOConfig, RLOOConfig

from klest.integrations.trl import DistillationTrainer, KLTerm, RLOOTrainer
from tests.integrations._trl_helpers import (
    ACCUMULATION,
    BETA,
    assert_divergence_value_close,
    assert_normwise_close,
    common_args,
    completion_logits,
    completion_logps,
    exact_distillation_kls,
    grpo,
    perturbed,
    prompts,
    save_tiny_lm,
    token_sizes,
    tokenizer,
    tolerance,
)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("policy"), seed=0)


def test_distillation_loss_is_normalised_over_the_accumulation_window(tiny_lm, tmp_path):
    teacher = save_tiny_lm(tmp_path / "teacher", seed=1)
    args = DistillationConfig(**{**common_args(tmp_path), "beta": 1.0})
    trainer = DistillationTrainer(
        model=tiny_lm,
        teacher_model=teacher,
        args=args,
        train_dataset=prompts(),
        processing_class=tokenizer(),
    )
    seen = []
    inner = trainer._compute_loss

    def recording(student, batch, num_items_in_batch):
        out = inner(student, batch, num_items_in_batch)
        with torch.no_grad():
            logits = completion_logits(student, batch)
            logits_t = completion_logits(trainer.teacher_model, batch)
        seen.append((batch, num_items_in_batch, out[0].detach(), logits, logits_t))
        return out

    trainer._compute_loss = recording
    trainer.train()
    assert len(seen) == args.max_steps * ACCUMULATION
    for step in range(args.max_steps):
        window = seen[step * ACCUMULATION : (step + 1) * ACCUMULATION]
        tokens = sum(int(b["completion_mask"].sum()) for b, *_ in window)
        # the window's count is not a micro-batch's own (which a per-micro-batch mean uses)
        assert all(0 < int(b["completion_mask"].sum()) < tokens for b, *_ in window)
        for i, (batch, num_items, loss, logits, logits_t) in enumerate(window):
            assert float(num_items) == tokens, (step, i)
            mask = batch["completion_mask"].bool()
            kls = torch.where(mask, exact_distillation_kls(logits, logits_t, 1.0), 0.0)
            expected = kls.sum() / tokens
            what = f"step {step} micro-batch {i}"
            assert_divergence_value_close(
                loss, expected, logits, logits_t, mask, torch.float32, what
            )


def _logged_kl_matches_the_estimate(trainer):
    """Train; at each micro-batch compute the k3 estimate from an independent forward pass
    (before the loss's own), and compare each logged ``kl`` with its step's mean."""
    expected: list[tuple[float, float]] = []
    inner = trainer._compute_loss

    def recording(model, batch):
        with torch.no_grad():
            logp = completion_logps(model, batch)
        ref = batch["ref_per_token_logps"].float()
        mask = batch["completion_mask"].bool()
        log_r = ref - logp
        k3 = torch.where(mask, log_r.exp() - 1 - log_r, 0.0)
        rows = mask.any(-1)
        value = float(k3.sum(-1)[rows].sum() / rows.sum().clamp(min=1))
        tol = tolerance(*token_sizes(logp, ref), mask, torch.float32)
        expected.append((value, tol))
        return inner(model, batch)

    trainer._compute_loss = recording
    trainer.train()
    logged = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert len(logged) == trainer.args.max_steps
    assert len(expected) == trainer.args.max_steps * ACCUMULATION
    for step, got in enumerate(logged):
        window = expected[step * ACCUMULATION : (step + 1) * ACCUMULATION]
        want = sum(v for v, _ in window) / ACCUMULATION
        tol = max(t for _, t in window)
        assert want > 0.0
        assert_normwise_close(torch.tensor(got), torch.tensor(want), tol, what=f"step {step}")


def test_grpo_logs_the_kl_estimate_not_the_accumulation_scaled_term(tiny_lm, tmp_path):
    args = GRPOConfig(num_generations=2, **common_args(tmp_path))
    trainer = perturbed(grpo(tiny_lm, args, kl=KLTerm()))
    assert trainer.beta == BETA
    _logged_kl_matches_the_estimate(trainer)


def test_rloo_logs_the_kl_estimate(tiny_lm, tmp_path):
    args = RLOOConfig(num_generations=2, **common_args(tmp_path))
    trainer = RLOOTrainer(
        model=tiny_lm,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=prompts(),
        processing_class=tokenizer(),
        kl=KLTerm(),
    )
    _logged_kl_matches_the_estimate(perturbed(trainer))
