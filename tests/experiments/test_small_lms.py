"""Small GPT-2 models trained on the review language: training works, and the cache is exact."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers", reason="the klest[hf] extra (installed by make test)")

from klest.experiments.reviews import NEUTRAL, ReviewStyle, log_prob, sample_reviews
from klest.experiments.small_lms import (
    Architecture,
    Training,
    build_gpt2,
    review_log_prob,
    trained_gpt2,
)
from tests._stats import z_for
from tests._tolerance import assert_close_to_rounding, logit_scale

TINY = Architecture(n_embd=16, n_layer=1, n_head=2)
SHORT = ReviewStyle(max_sentences=2)


def _kl_from_grammar(model, style: ReviewStyle, n: int, seed: int) -> tuple[float, float]:
    """KL(grammar || model) = E_grammar[log p_grammar - log p_model], its Monte Carlo mean and
    standard error over ``n`` fresh reviews."""
    reviews = sample_reviews(style, n, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        gap = log_prob(reviews, style) - review_log_prob(model, reviews).double()
    return float(gap.mean()), float(gap.std() / math.sqrt(n))


def test_training_moves_the_model_towards_the_grammar(tmp_path):
    """The exact grammar log-probs against the model's: training lowers KL(grammar || model) by
    more than its noise, and the trained KL is not negative beyond its noise (2 one-sided
    comparisons at family rate RATE)."""
    z = z_for(comparisons=2, two_sided=False)
    untrained = build_gpt2(TINY, max_length=SHORT.max_length, seed=0).eval()
    before, se_before = _kl_from_grammar(untrained, SHORT, 2000, seed=1)
    model, _ = trained_gpt2(TINY, Training(SHORT, steps=150, seed=0), cache_dir=tmp_path)
    after, se_after = _kl_from_grammar(model, SHORT, 2000, seed=1)
    assert before - after > z * math.hypot(se_before, se_after)
    assert after > -z * se_after


def test_a_cached_model_is_the_trained_one_and_keys_differ_by_training(tmp_path):
    training = Training(SHORT, steps=5, seed=3)
    first, folder = trained_gpt2(TINY, training, cache_dir=tmp_path)
    again, folder_again = trained_gpt2(TINY, training, cache_dir=tmp_path)
    assert folder == folder_again and (folder / "training.json").exists()
    for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    _, other = trained_gpt2(TINY, Training(SHORT, steps=5, seed=4), cache_dir=tmp_path)
    fan = ReviewStyle(max_sentences=2, positive=0.9)
    _, tuned = trained_gpt2(
        TINY, Training(fan, steps=2, seed=3), start_from=folder, cache_dir=tmp_path
    )
    assert len({folder, other, tuned}) == 3
    with pytest.raises(ValueError, match="positions"):
        trained_gpt2(TINY, Training(NEUTRAL, steps=2), start_from=folder, cache_dir=tmp_path)


def test_review_log_prob_is_the_sum_of_next_token_log_probs():
    model = build_gpt2(TINY, max_length=SHORT.max_length, seed=0).eval()
    reviews = sample_reviews(SHORT, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = review_log_prob(model, reviews)
        for row, value in zip(reviews, got, strict=True):
            n = int((row != 0).sum())  # <bos> ... <eos>, unpadded
            raw = model(input_ids=row[None, : n - 1]).logits[0]
            logits = raw.log_softmax(-1)
            by_hand = sum(float(logits[t - 1, row[t]]) for t in range(1, n))
            # two float32 forward passes (the padded batch, the row alone): each log-prob rounds
            # at its position's logit scale, through the model's sums over its width and the
            # log-softmax (32 roundings, twice); a sum over the row's positions
            scale = float(logit_scale(raw).sum())
            assert_close_to_rounding(value, torch.tensor(by_hand), ulps=64, scale=scale)
