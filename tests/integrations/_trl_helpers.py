"""What the TRL integration's tests share: a tiny LM saved where TRL loads it, the prompts and the
reward, the trainers' common config, the recorded micro-batches, and the KL term a trainer adds
to TRL's loss next to klest's term computed from an independent forward pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import datasets
import torch
from trl import GRPOConfig

import klest
from klest.integrations.trl import GRPOTrainer, KLTerm
from klest.testbeds import tiny_causal_lm, word_tokenizer
from tests._tolerance import logit_scale

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


@dataclasses.dataclass
class AddedTerm:
    """What a trainer adds to TRL's loss: its loss minus TRL's own with beta = 0."""

    value: torch.Tensor
    grads: list[torch.Tensor | None]
    scale: float
    """max(|loss|, |TRL's own loss|): the size of the two terms the difference cancels"""
    grad_scale: float
    """the largest entry of either loss's gradient, likewise"""


def kl_added_to_the_loss(trainer, batch) -> AddedTerm:
    """The trainer's loss minus TRL's own with beta = 0, and that difference's gradient."""
    model = trainer.model
    params = trainable(model)
    full = trainer._compute_loss(model, batch)
    beta, trainer.beta = trainer.beta, 0.0
    try:
        policy_only = trainer._compute_loss(model, batch)
    finally:
        trainer.beta = beta
    added = full - policy_only
    grads = [
        torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
        for loss in (full, policy_only)
    ]
    return AddedTerm(
        added.detach(),
        list(torch.autograd.grad(added, params, allow_unused=True)),
        max(abs(float(full)), abs(float(policy_only))),
        max((float(g.abs().max()) for gs in grads for g in gs if g is not None), default=0.0),
    )


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


UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
"""One rounding moves a value by at most this much of it: bfloat16 keeps 8 significant bits,
float32 24."""

ROUNDINGS = {torch.bfloat16: 4, torch.float32: 512}
"""The roundings on each log-prob's and gradient's way that matter at first order.

bfloat16: the last hidden state, the logits, the log-softmax's output, and the gradient's storage
(a bfloat16 model). Earlier layers' roundings reach the log-probs through RMS norms, which
rescale them, not grow; the float32 sums in between (2^-24 a term) are negligible next to these.

float32: no storage rounding, so what rounds are the sums: the model's over its width (16, its
MLP's 64) and the vocabulary (16), the gradient's over the micro-batch's tokens (up to 16 rows
of about 10), the exact divergence's over the vocabulary; a sum of n terms rounds up to n
times, so some 2 x 256 for the two computations compared (the trainer's and the replica's).
Measured over the TRL tests with ATEN_CPU_CAPABILITY avx512, avx2 and default: at most 70 (a
gradient of the distillation's JSD at beta 0.3, under default), a margin of 7."""


def tolerance(
    sizes: torch.Tensor, differences: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype
) -> float:
    """The normwise tolerance (largest error over largest entry) of a gradient in ``dtype``.

    Each rounding moves a log-prob by up to u |log p| (u = UNIT_ROUNDOFF[dtype]), but the KL term
    and its gradient depend on the log-probs through their differences (log pi - log ref), some
    tenths of a nat between log-probs of a few nats: relative to those differences the error is
    amplified by A = mean(sizes) / mean(|differences|) over the valid positions: the sizes
    |log pi| + |log ref| and differences log pi - log ref of the sampled tokens (GRPO, RLOO: A
    is 3 to 6 here; :func:`token_sizes`), or for the distillation's exact KL, a function of the
    whole logit vectors, the student's expectations of |z| + |z_ref| and |z - z_ref| over the
    vocabulary, z the logits less their mean (softmax ignores a shift; A is about 1 here;
    :func:`vocabulary_sizes`). The gradient's own factor, grad log pi, carries the unamplified
    u. Hence ROUNDINGS[dtype] * u * (1 + A) (no valid position, or no difference: 1 + 0).
    """
    valid = mask.bool()
    size = float(sizes.detach().double()[valid].sum())
    spread = float(differences.detach().double()[valid].abs().sum())
    amplification = size / spread if spread > 0 else 0.0
    return ROUNDINGS[dtype] * UNIT_ROUNDOFF[dtype] * (1 + amplification)


DIVERGENCE_ROUNDINGS = 32
"""The float32 arithmetic of a divergence from two rows of logits, the trainer's and the exact
one here: a log-softmax and a sum over the vocabulary (16), each rounding at the row's logit
scale (tests/_tolerance.py's logit_scale) about sqrt(16) times, twice: 2 x 16 roundings, as in
the logits tests."""


def assert_divergence_value_close(got, expected, logits, logits_teacher, mask, dtype, what=""):
    """The distillation's value, a mean over the valid positions of a divergence between the
    student's and the teacher's logits: within the logits' rounding as amplified for a
    gradient (:func:`tolerance` of the largest entry, bfloat16's storage roundings), plus
    the float32 arithmetic of the divergence itself, ``DIVERGENCE_ROUNDINGS`` of the largest
    valid position's logit scale: a divergence near zero (a JSD at beta 0.3: some 4e-4 here)
    still carries the rounding of log-probs of a few nats."""
    valid = mask.bool()
    amplified = tolerance(*vocabulary_sizes(logits, logits_teacher), mask, dtype)
    scale = logit_scale(logits, logits_teacher)[valid.cpu()]
    arithmetic = DIVERGENCE_ROUNDINGS * torch.finfo(torch.float32).eps
    arithmetic *= float(scale.max()) if scale.numel() else 0.0
    error = abs(float(got) - float(expected))
    bound = amplified * abs(float(expected)) + arithmetic
    assert error <= bound, f"{what}: error {error:.3g} > {bound:.3g} ({error / bound:.3g} times)"


def token_sizes(logp, logp_ref) -> tuple[torch.Tensor, torch.Tensor]:
    """The sizes and differences of :func:`tolerance` for a term on sampled tokens' log-probs."""
    return logp.abs() + logp_ref.abs(), logp - logp_ref


def vocabulary_sizes(logits, logits_ref) -> tuple[torch.Tensor, torch.Tensor]:
    """The sizes and differences of :func:`tolerance` for an exact KL from whole logit vectors."""
    q = logits.softmax(-1)
    z = logits - logits.mean(-1, keepdim=True)
    z_ref = logits_ref - logits_ref.mean(-1, keepdim=True)
    return (q * (z.abs() + z_ref.abs())).sum(-1), (q * (z - z_ref).abs()).sum(-1)


def assert_normwise_close(got, expected, tol: float, *, scale: float = 0.0, what: str = "") -> None:
    """The largest error within ``tol`` of the largest entry of ``expected``, or of ``scale``
    where larger: the size of terms that a difference cancels (:class:`AddedTerm`). Normwise, not
    per entry: an entry near zero carries the rounding of the larger ones it is computed with."""
    got, expected = got.detach().double(), expected.detach().double()
    assert got.shape == expected.shape, f"{what}: shapes {got.shape}, {expected.shape}"
    error = float((got - expected).abs().max()) if got.numel() else 0.0
    size = max(float(expected.abs().max()) if got.numel() else 0.0, scale)
    assert error <= tol * size, (
        f"{what}: error {error:.3g} is {error / max(size, 1e-30):.3g} of the largest entry "
        f"{size:.3g} (tolerance {tol:.3g}; {error / max(tol * size, 1e-300):.3g} times it)"
    )


def assert_grads_close(got, expected, tol: float, *, scale: float = 0.0, what: str = "") -> None:
    """Per parameter: no gradient where none is expected; and the whole gradient as one vector
    within ``tol`` normwise (its rounding errors scale with the pass's intermediate values, not
    with each parameter's share)."""
    pairs = []
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if e is None:
            assert g is None or torch.count_nonzero(g) == 0, f"{what}: parameter {i}"
        else:
            pairs.append((torch.zeros_like(e) if g is None else g, e))
    got_all = torch.cat([g.flatten().float() for g, _ in pairs])
    expected_all = torch.cat([e.flatten().float() for _, e in pairs])
    assert_normwise_close(got_all, expected_all, tol, scale=scale, what=f"{what}: gradient")


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
