"""The synthetic review language: its exact probabilities, its sampler, and its reward."""

from __future__ import annotations

import math

import pytest
import torch

from klest.experiments.reviews import (
    BOS,
    ENTHUSIAST,
    EOS,
    ID,
    INTENSIFIERS,
    NEGATIVE_ADJECTIVES,
    NEGATIVE_VERBS,
    NEUTRAL,
    NOUNS,
    PAD,
    POSITIVE_ADJECTIVES,
    POSITIVE_VERBS,
    ReviewStyle,
    decode,
    log_prob,
    sample_reviews,
    sentiment,
)
from tests._stats import Z

ONE_SENTENCE = ReviewStyle(max_sentences=1, noun_weights=(3, 1, 1, 1, 2, 1, 1, 1), negated=0.3)


def _ids(words: list[str], length: int) -> list[int]:
    return [ID[w] for w in words] + [ID[PAD]] * (length - len(words))


def _every_one_sentence_review(style: ReviewStyle) -> torch.Tensor:
    """All reviews of one sentence, written out by hand from the grammar."""
    sentences = [["i", v, "the", n] for v in POSITIVE_VERBS + NEGATIVE_VERBS for n in NOUNS]
    for n in NOUNS:
        for intensifier in [[], *[[w] for w in INTENSIFIERS]]:
            for negation in [[], ["not"]]:
                for a in POSITIVE_ADJECTIVES + NEGATIVE_ADJECTIVES:
                    sentences.append(["the", n, "was", *intensifier, *negation, a])
    rows = [_ids([BOS, *s, ".", EOS], style.max_length) for s in sentences]
    return torch.tensor(rows)


def test_the_exact_probabilities_of_all_reviews_sum_to_one():
    every = _every_one_sentence_review(ONE_SENTENCE)
    total = log_prob(every, ONE_SENTENCE).exp().sum()
    assert math.isclose(float(total), 1.0, rel_tol=1e-12)


@pytest.mark.parametrize(
    "style", [ONE_SENTENCE, NEUTRAL, ENTHUSIAST], ids=["one", "neutral", "fan"]
)
def test_samples_are_on_the_grammar_and_their_log_probs_average_to_the_entropy(style):
    """Sampled reviews have finite exact log-probs; for one sentence (enumerable), the mean
    -log p of the samples equals the exact entropy within Z standard errors."""
    samples = sample_reviews(style, 4000, generator=torch.Generator().manual_seed(0))
    lp = log_prob(samples, style)
    assert torch.isfinite(lp).all()
    assert (samples[:, 0] == ID[BOS]).all() and ((samples == ID[EOS]).sum(1) == 1).all()
    if style is ONE_SENTENCE:
        every = log_prob(_every_one_sentence_review(style), style)
        entropy = -(every.exp() * every).sum()
        se = lp.std() / math.sqrt(len(lp))
        assert abs(float(-lp.mean() - entropy)) <= Z * float(se)


def test_off_grammar_sequences_have_probability_zero():
    length = NEUTRAL.max_length
    bad = [
        [BOS, "the", "food", "was", "good", EOS],  # no full stop
        [BOS, "the", "food", "good", ".", EOS],  # no "was"
        [BOS, "i", "good", "the", "food", ".", EOS],  # an adjective for a verb
        ["the", "food", "was", "good", ".", EOS],  # no start token
        [BOS, "the", "food", "was", "good", "."],  # no end token
    ]
    lp = log_prob(torch.tensor([_ids(w, length) for w in bad]), NEUTRAL)
    assert (lp == float("-inf")).all()


@pytest.mark.parametrize(
    ("words", "reward"),
    [
        (["the", "food", "was", "good", "."], 1.0),
        (["the", "food", "was", "not", "good", "."], -1.0),
        (["the", "food", "was", "very", "bad", ".", "i", "loved", "the", "view", "."], -0.5),
        (["the", "room", "was", "fine", ".", "the", "bed", "was", "dull", "."], 0.0),
        (["i", "hated", "the", "staff"], -1.0),  # an unfinished sentence counts
        (["the", "food", "was", "."], 0.0),
        ([], 0.0),
    ],
)
def test_sentiment_by_hand(words, reward):
    tokens = torch.tensor([_ids([BOS, *words, EOS], 16)])
    assert float(sentiment(tokens)) == pytest.approx(reward)


def test_sentiment_ignores_masked_tokens_and_styles_differ_in_it():
    tokens = torch.tensor([_ids([BOS, "the", "food", "was", "bad", ".", EOS], 8)])
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[0, 4] = False
    assert float(sentiment(tokens, mask)) == 0.0
    g = torch.Generator().manual_seed(1)
    neutral = sentiment(sample_reviews(NEUTRAL, 2000, generator=g)).mean()
    fan = sentiment(sample_reviews(ENTHUSIAST, 2000, generator=g)).mean()
    assert abs(float(neutral)) < 0.1 and float(fan) > 0.9
    assert decode(torch.tensor(_ids([BOS, "i", "liked", "the", "bed", ".", EOS], 9))) == (
        "<bos> i liked the bed . <eos>"
    )


def test_bad_styles_are_refused():
    with pytest.raises(ValueError, match="positive"):
        ReviewStyle(positive=1.5)
    with pytest.raises(ValueError, match="noun_weights"):
        ReviewStyle(noun_weights=(1.0, 2.0))
    with pytest.raises(ValueError, match="max_sentences"):
        ReviewStyle(max_sentences=0)
