"""What the TRL integration's tests share: a tiny LM saved where TRL loads it, the prompts and the
reward, the trainers' common config, the recorded micro-batches, and the KL term a trainer adds
to TRL's loss next to klest's term computed from an independent forward pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets
import torch
from trl import GRPOConfig

import klest
from klest.integrations.trl import GRPOTrainer, KLTerm
from klest.testbeds import tiny_causal_lm, word_tokenizer

BETA = 0.1
ACCUMULATION = 2
LETTERS = [chr(ord("a") + i) for i in range(13)]


def tokenizer(padding_side: str = "left"):
    words = word_tokenizer(LETTERS)
    words.padding_side = padding_side
    return words


def save_tiny_lm(folder, *, seed: int, hidden_size: int = 16) -> str:
    """A one-layer Llama and its tokenizer, saved where TRL can load them (and their copy)."""
    model = tiny_causal_lm(
        vocab_size=len(LETTERS) + 3, hidden_size=hidden_size, num_layers=1, num_heads=2, seed=seed
    )
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return str(folder)


def prompts():
    return datasets.Dataset.from_dict({"prompt": ["a b", "c d e", "f", "g h"] * 4})


def reward(completions, **_):
    return [c.count("a") / 6 for c in completions]


def common_args(tmp_path) -> dict:
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_completion_length=6,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=2,
        beta=BETA,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        seed=0,
        # TRL defaults to bf16 autocast; the reference forward passes here are float32.
        bf16=False,
    )


def grpo(tiny_lm, args: GRPOConfig, *, padding_side: str = "left", **kwargs) -> GRPOTrainer:
    """klest's GRPOTrainer on the tiny model, the prompts and the reward of these tests (and
    ``eval_dataset`` or ``kl`` from ``kwargs``)."""
    return GRPOTrainer(
        model=tiny_lm,
        reward_funcs=reward,
        args=args,
        train_dataset=prompts(),
        processing_class=tokenizer(padding_side),
        **kwargs,
    )


def perturbed(trainer, seed: int = 0):
    """Move the policy away from the reference, so the KL and its gradient are not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
    return trainer


def record_batches(trainer, keep: Callable[[dict], Any] = lambda batch: batch) -> list:
    """Wrap the trainer's loss so the micro-batches it trains on are kept (``keep(batch)`` of
    each, taken as the loss is called)."""
    seen: list = []
    inner = trainer._compute_loss

    def recording(*args):
        seen.append(keep(dict(args[-1]) if len(args) == 2 else dict(args[1])))
        return inner(*args)

    trainer._compute_loss = recording
    return seen


def completion_logits(model, batch, *, temperature: float = 1.0) -> torch.Tensor:
    """The logits that produced each completion token (column t - 1 predicts column t), from
    one plain forward pass over prompt + completion, divided by the sampling temperature."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    n = batch["completion_ids"].shape[1]
    return model(input_ids=ids, attention_mask=attention).logits[:, -n - 1 : -1] / temperature


def completion_logps(model, batch, *, temperature: float = 1.0) -> torch.Tensor:
    """log pi(y_t | y_<t) of the completion tokens under softmax(logits / temperature)."""
    logits = completion_logits(model, batch, temperature=temperature)
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0]


def groups_by_hand(batch) -> torch.Tensor:
    ids: dict[tuple, int] = {}
    rows = [
        tuple(t for t, m in zip(p.tolist(), mk.tolist(), strict=True) if m)
        for p, mk in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)
    ]
    return torch.tensor([ids.setdefault(r, len(ids)) for r in rows])


def trainable(model) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def kl_added_to_the_loss(trainer, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The trainer's loss minus TRL's own with beta = 0, and that difference's gradient."""
    model = trainer.model
    full = trainer._compute_loss(model, batch)
    beta, trainer.beta = trainer.beta, 0.0
    try:
        policy_only = trainer._compute_loss(model, batch)
    finally:
        trainer.beta = beta
    added = full - policy_only
    return added.detach(), list(torch.autograd.grad(added, trainable(model), allow_unused=True))


def klest_term(logp, batch, kl: KLTerm, *, beta: float, scale: float, logp_behavior=None):
    """beta * scale * klest's term on the policy's log-probs ``logp`` of the batch's completions
    (TRL's reference log-probs, groups by hand)."""
    return (
        beta
        * scale
        * klest.kl_penalty(
            logp,
            batch["ref_per_token_logps"].float(),
            mask=batch["completion_mask"].bool(),
            estimator=kl.estimator,
            grad=kl.grad,
            baseline=kl.baseline,
            group=groups_by_hand(batch),
            direction=kl.direction,
            reduction=kl.reduction,
            logp_behavior=logp_behavior,
        )
    )


_FROM_THE_BATCH = object()


def expected_term(trainer, batch, kl: KLTerm, scale: float, logp_behavior=_FROM_THE_BATCH):
    """BETA * scale * klest's term on an independent forward pass; the samples' behavior
    log-probs are TRL's own (``old_per_token_logps``) unless given."""
    if logp_behavior is _FROM_THE_BATCH:
        logp_behavior = batch.get("old_per_token_logps")
    model = trainer.model
    logp = completion_logps(model, batch)
    term = klest_term(logp, batch, kl, beta=BETA, scale=scale, logp_behavior=logp_behavior)
    return term.detach(), list(torch.autograd.grad(term, trainable(model), allow_unused=True))


def assert_grads_close(got, expected):
    for g, e in zip(got, expected, strict=True):
        if e is None:
            assert g is None or torch.count_nonzero(g) == 0
        else:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def exact_distillation_kls(logits, logits_teacher, beta: float) -> torch.Tensor:
    """Each position's divergence between student and teacher, from materialized logits ``[B, T,
    V]``: KL(student || teacher) at beta = 1, KL(teacher || student) at 0, and in between TRL's
    generalized JSD with mixture m = beta teacher + (1 - beta) student."""
    logq, logq_t = logits.log_softmax(-1), logits_teacher.log_softmax(-1)
    q, p = logq.exp(), logq_t.exp()
    if beta == 1.0:
        return (q * (logq - logq_t)).sum(-1)
    if beta == 0.0:
        return (p * (logq_t - logq)).sum(-1)
    log_m = (beta * p + (1 - beta) * q).log()
    return beta * (p * (logq_t - log_m)).sum(-1) + (1 - beta) * (q * (logq - log_m)).sum(-1)


def sequence_level_by_hand(kl, logp, mask) -> torch.Tensor:
    """Per token: KL_t's value, with the gradient of KL_t + log pi(y_t) * sg(sum_{s>t} KL_s)
    over the valid tokens (the sequence-level KL's score term, no baseline)."""
    kl = torch.where(mask, kl, 0.0)
    future = kl.detach().flip(-1).cumsum(-1).flip(-1) - kl.detach()
    surrogate = kl + torch.where(mask, logp, 0.0) * future
    return surrogate - surrogate.detach() + kl.detach()
