"""Small GPT-2 language models trained here on :mod:`klest.experiments.reviews`, and cached.

The language-model experiments need a reference model, a policy or student that differs from it,
and a larger teacher: all are ``transformers.GPT2LMHeadModel`` built from a config and trained
in a plain PyTorch loop on freshly sampled reviews (next-token cross-entropy), in seconds to
minutes on two CPU cores. A trained model is saved under ``cache_dir`` with a key made of
everything that determines it (architecture, style, steps, learning rate, batch, seed), and
loaded from there by later runs; so experiments reuse their models and stay deterministic.

Needs ``transformers`` (the ``klest[hf]`` extra, included in ``klest[experiments]`` use).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klest._progress import progress_bar
from klest.experiments.reviews import (
    BOS_ID,
    ENTHUSIAST,
    EOS_ID,
    NEUTRAL,
    PAD_ID,
    VOCAB,
    ReviewStyle,
    sample_reviews,
)

CACHE_VERSION = 1
"""Bumped whenever training changes, so stale cached models are not reused."""

DEFAULT_CACHE = Path("runs") / "_models"


@dataclass(frozen=True)
class Architecture:
    """A GPT-2 shape: width, depth, heads."""

    n_embd: int
    n_layer: int
    n_head: int


STUDENT = Architecture(n_embd=32, n_layer=2, n_head=2)
REFERENCE = Architecture(n_embd=64, n_layer=2, n_head=4)
TEACHER = Architecture(n_embd=96, n_layer=3, n_head=4)


@dataclass(frozen=True)
class Training:
    """What a model is trained on and how: the data's style, steps, learning rate, batch, seed."""

    style: ReviewStyle
    steps: int
    lr: float = 3e-3
    batch_size: int = 64
    seed: int = 0


def build_gpt2(arch: Architecture, *, max_length: int, seed: int) -> Any:
    """A randomly initialized GPT-2 over :data:`~klest.experiments.reviews.VOCAB`."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=len(VOCAB),
        n_positions=max_length,
        n_embd=arch.n_embd,
        n_layer=arch.n_layer,
        n_head=arch.n_head,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def train_on_reviews(model: Any, training: Training, *, progress: bool = False) -> list[float]:
    """Next-token cross-entropy on fresh reviews of ``training.style``; returns the losses.

    Padding after ``<eos>`` is not a target; the model learns to stop.
    """
    generator = torch.Generator().manual_seed(training.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(training.steps, 1))
    model.train()
    losses = []
    for _ in progress_bar(range(training.steps), desc="training", enabled=progress):
        batch = sample_reviews(training.style, training.batch_size, generator=generator)
        targets = batch[:, 1:].masked_fill(batch[:, 1:] == PAD_ID, -100)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def _key(arch: Architecture, training: Training, start: str | None) -> str:
    spec = {
        "version": CACHE_VERSION,
        "arch": asdict(arch),
        "training": asdict(training),
        "start": start,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return digest


def trained_gpt2(
    arch: Architecture,
    training: Training,
    *,
    start_from: Path | None = None,
    cache_dir: Path = DEFAULT_CACHE,
    progress: bool = False,
) -> tuple[Any, Path]:
    """A GPT-2 trained on reviews, from the cache when it is there; and its folder.

    Args:
      arch: the shape (ignored with ``start_from``, whose shape it must be).
      training: data style, steps, learning rate, batch, seed.
      start_from: fine-tune this saved model instead of a random initialization.
      cache_dir: where trained models are kept (default ``runs/_models``).
      progress: show a progress bar while training.

    Returns:
      The model in eval mode, and the folder it is saved in (a path a trainer can load).
    """
    import transformers

    start = None if start_from is None else Path(start_from).name
    folder = Path(cache_dir) / f"gpt2-{_key(arch, training, start)}"
    if (folder / "config.json").exists():
        return transformers.GPT2LMHeadModel.from_pretrained(folder).eval(), folder
    max_length = training.style.max_length
    if start_from is None:
        model = build_gpt2(arch, max_length=max_length, seed=training.seed)
    else:
        model = transformers.GPT2LMHeadModel.from_pretrained(start_from)
        if model.config.n_positions < max_length:
            raise ValueError(
                f"the model in {start_from} holds {model.config.n_positions} positions; reviews "
                f"of this style are up to {max_length} tokens long"
            )
    losses = train_on_reviews(model, training, progress=progress)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "training.json").write_text(
        json.dumps(
            {"arch": asdict(arch), "training": asdict(training), "start": start, "losses": losses}
        )
    )
    return model, folder


def review_log_prob(model: Any, reviews: torch.Tensor) -> torch.Tensor:
    """log p_model of each review ``[N, T]`` (from ``<bos>``, right-padded): the sum over its
    tokens after ``<bos>`` up to and including ``<eos>`` of the next-token log-probabilities
    (the logits at column t - 1 score the token at column t)."""
    logits = model(input_ids=reviews[:, :-1], attention_mask=(reviews[:, :-1] != PAD_ID).long())
    logp = logits.logits.float().log_softmax(-1)
    targets = reviews[:, 1:]
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != PAD_ID, token_logp, 0.0).sum(-1)


MAX_LENGTH = max(NEUTRAL.max_length, ENTHUSIAST.max_length)
"""The longest review of the shipped styles (prompt included): the default sampling horizon."""


@dataclass
class Batch:
    """Completions of prompts of one length ``k``: tokens ``[n, horizon]`` (prompt included),
    and for the completion positions ``k .. horizon - 1``: the valid-token mask ``[n, L]``."""

    tokens: Tensor
    k: int
    mask: Tensor


@torch.no_grad()
def sample_completions(
    model: Any,
    prompts: Tensor,
    *,
    generator: torch.Generator,
    horizon: int = MAX_LENGTH,
    progress: bool = False,
) -> Batch:
    """Complete each prompt ``[n, k]`` (all of length k) by sampling from ``model`` at
    temperature 1 with the whole distribution (no top-k, no top-p) up to ``horizon`` tokens;
    tokens after ``<eos>`` are ``<pad>`` and masked out. ``progress``: count the positions
    sampled (tens of thousands of rows take seconds a position)."""
    n, k = prompts.shape
    tokens = torch.full((n, horizon), PAD_ID, dtype=torch.long)
    tokens[:, :k] = prompts
    done = torch.zeros(n, dtype=torch.bool)
    mask = torch.zeros(n, horizon - k, dtype=torch.bool)
    positions = progress_bar(range(k, horizon), desc="sampling", leave=False, enabled=progress)
    for t in positions:
        logits = model(input_ids=tokens[:, :t]).logits[:, -1].double()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
        mask[:, t - k] = ~done
        tokens[:, t] = torch.where(done, PAD_ID, nxt)
        done |= nxt == EOS_ID
        if bool(done.all()):
            break
    return Batch(tokens, k, mask)


def completion_log_probs(model: Any, batch: Batch) -> tuple[Tensor, Tensor]:
    """``model``'s next-token logits along the completions ``[n, L, V]`` (float64) and the
    sampled tokens' log-probs ``[n, L]`` (the logits at column t - 1 score the token at t)."""
    logits = model(input_ids=batch.tokens[:, :-1]).logits[:, batch.k - 1 :].double()
    targets = batch.tokens[:, batch.k :]
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logits, torch.where(batch.mask, logp, 0.0)


@contextmanager
def small_lm_session(quick: bool) -> Iterator[Path]:
    """The setting of an experiment on these models: torch on one thread (tiny models: more
    threads only add overhead; restored after), and the model cache it yields: a temporary
    folder for a ``--quick`` run (deleted after), :data:`DEFAULT_CACHE` otherwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp) if quick else DEFAULT_CACHE
    finally:
        torch.set_num_threads(threads)


__all__ = [
    "DEFAULT_CACHE",
    "MAX_LENGTH",
    "REFERENCE",
    "STUDENT",
    "TEACHER",
    "Architecture",
    "Batch",
    "Training",
    "build_gpt2",
    "completion_log_probs",
    "review_log_prob",
    "sample_completions",
    "small_lm_session",
    "train_on_reviews",
    "trained_gpt2",
]
