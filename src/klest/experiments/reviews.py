"""A synthetic language of short reviews, with a sentiment reward: data for small LMs made here.

The language-model experiments train their models on text this module generates, so nothing is
downloaded and every number is reproducible from a seed. A review is a start token, one to
``max_sentences`` sentences, and an end token::

    <bos> the food was very good . i hated the staff . <eos>

A sentence is ``the NOUN was [very|really] [not] ADJ .`` or ``i VERB the NOUN .``; adjectives and
verbs are positive or negative. A :class:`ReviewStyle` sets the probabilities (how often a
sentence is positive, intensified, negated; which nouns; how many sentences), so two styles give
two distributions over the same vocabulary: a reference and a policy or student that differs
from it by a chosen amount.

The reward (:func:`sentiment`) reads any token sequence, grammatical or not: each sentence (up
to a ``.``) scores +1 per positive word and -1 per negative one, doubled by an intensifier and
flipped by ``not``; the reward is the mean sentence score clipped to [-1, 1], 0 without a
sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
NOUNS = ("food", "service", "room", "staff", "view", "price", "bed", "music")
POSITIVE_ADJECTIVES = ("good", "great", "lovely", "superb", "fine")
NEGATIVE_ADJECTIVES = ("bad", "awful", "poor", "dull", "rude")
POSITIVE_VERBS = ("loved", "liked", "enjoyed")
NEGATIVE_VERBS = ("hated", "disliked", "regretted")
INTENSIFIERS = ("very", "really")
FUNCTION_WORDS = ("the", "was", "not", "i", ".", "review", ":")

VOCAB: tuple[str, ...] = (
    PAD,
    BOS,
    EOS,
    *FUNCTION_WORDS,
    *NOUNS,
    *POSITIVE_ADJECTIVES,
    *NEGATIVE_ADJECTIVES,
    *POSITIVE_VERBS,
    *NEGATIVE_VERBS,
    *INTENSIFIERS,
)
"""The vocabulary: ids are positions in this tuple (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2)."""

ID = {w: i for i, w in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID = ID[PAD], ID[BOS], ID[EOS]
_POLARITY = torch.zeros(len(VOCAB))
for _w in POSITIVE_ADJECTIVES + POSITIVE_VERBS:
    _POLARITY[ID[_w]] = 1.0
for _w in NEGATIVE_ADJECTIVES + NEGATIVE_VERBS:
    _POLARITY[ID[_w]] = -1.0


@dataclass(frozen=True)
class ReviewStyle:
    """The probabilities of one way of writing reviews.

    Attributes:
      positive: probability that a sentence is positive.
      intensified: probability of ``very``/``really`` in an adjective sentence.
      negated: probability of ``not`` in an adjective sentence (it flips the polarity the
        writer means, so the adjective's own polarity is the opposite).
      verb_sentence: probability of the ``i VERB the NOUN .`` form.
      noun_weights: unnormalized weights of :data:`NOUNS` (None: uniform).
      max_sentences: sentences are 1 to ``max_sentences``, uniformly.
    """

    positive: float = 0.5
    intensified: float = 0.3
    negated: float = 0.15
    verb_sentence: float = 0.3
    noun_weights: tuple[float, ...] | None = None
    max_sentences: int = 3

    def __post_init__(self) -> None:
        for name in ("positive", "intensified", "negated", "verb_sentence"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"ReviewStyle.{name} must be in [0, 1], got {p}")
        if self.max_sentences < 1:
            raise ValueError(f"ReviewStyle.max_sentences must be >= 1, got {self.max_sentences}")
        if self.noun_weights is not None and (
            len(self.noun_weights) != len(NOUNS) or min(self.noun_weights) < 0
        ):
            raise ValueError(
                f"ReviewStyle.noun_weights must be {len(NOUNS)} non-negative weights, got "
                f"{self.noun_weights}"
            )

    @property
    def max_length(self) -> int:
        """The longest review in tokens, start and end tokens included."""
        return 2 + 7 * self.max_sentences  # the longest sentence has 7 tokens


NEUTRAL = ReviewStyle()
"""Balanced reviews: the reference language."""

ENTHUSIAST = ReviewStyle(
    positive=0.97,
    intensified=0.8,
    negated=0.02,
    verb_sentence=0.6,
    noun_weights=(8, 1, 1, 1, 4, 1, 1, 1),
    max_sentences=3,
)
"""Nearly always positive, emphatic reviews, mostly about the food and the view: a policy
several nats away from :data:`NEUTRAL`."""


def _choice(weights: Tensor, n: int, generator: torch.Generator) -> Tensor:
    return torch.multinomial(weights.expand(n, -1), 1, generator=generator)[:, 0]


def sample_reviews(style: ReviewStyle, n: int, *, generator: torch.Generator) -> Tensor:
    """``n`` reviews as token ids ``[n, style.max_length]``, right-padded with ``<pad>``.

    Every review starts with ``<bos>`` and ends with ``<eos>``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out = torch.full((n, style.max_length), PAD_ID, dtype=torch.long)
    out[:, 0] = BOS_ID
    nouns = torch.tensor(style.noun_weights or (1.0,) * len(NOUNS), dtype=torch.float64)
    n_sentences = torch.randint(1, style.max_sentences + 1, (n,), generator=generator)
    column = torch.ones(n, dtype=torch.long)
    rows = torch.arange(n)

    def put(word_ids: Tensor, where: Tensor) -> None:
        out[rows[where], column[where]] = word_ids[where]
        column[where] += 1

    def constant(word: str) -> Tensor:
        return torch.full((n,), ID[word], dtype=torch.long)

    def pick(words: tuple[str, ...], weights: Tensor | None = None) -> Tensor:
        w = torch.ones(len(words), dtype=torch.float64) if weights is None else weights
        ids = torch.tensor([ID[x] for x in words])
        return ids[_choice(w, n, generator)]

    def coin(p: float) -> Tensor:
        return torch.rand(n, generator=generator, dtype=torch.float64) < p

    for s in range(style.max_sentences):
        active = n_sentences > s
        positive, verb_form = coin(style.positive), coin(style.verb_sentence)
        intensified, negated = coin(style.intensified), coin(style.negated)
        noun = pick(NOUNS, nouns)
        verb = torch.where(positive, pick(POSITIVE_VERBS), pick(NEGATIVE_VERBS))
        # "not ADJ" means the opposite of ADJ: a positive sentence negates a negative adjective.
        adjective_positive = positive ^ negated
        adjective = torch.where(
            adjective_positive, pick(POSITIVE_ADJECTIVES), pick(NEGATIVE_ADJECTIVES)
        )
        verbs, adjectives = active & verb_form, active & ~verb_form
        put(constant("i"), verbs)
        put(verb, verbs)
        put(constant("the"), verbs)
        put(noun, verbs)
        put(constant("the"), adjectives)
        put(noun, adjectives)
        put(constant("was"), adjectives)
        put(pick(INTENSIFIERS), adjectives & intensified)
        put(constant("not"), adjectives & negated)
        put(adjective, adjectives)
        put(constant("."), active)
    put(constant(EOS), torch.ones(n, dtype=torch.bool))
    return out


def sentiment(tokens: Tensor, mask: Tensor | None = None) -> Tensor:
    """The reward of each token sequence ``[..., T]`` (ids of :data:`VOCAB`): in [-1, 1].

    Each sentence (the tokens up to a ``.``; an unfinished sentence counts too) scores the sum
    of its words' polarities, times 2 with an intensifier, times -1 with ``not``; the reward is
    the mean score over the sentences, clipped to [-1, 1], and 0 for a sequence without one.
    Tokens where ``mask`` is False are ignored.
    """
    if mask is None:
        mask = torch.ones_like(tokens, dtype=torch.bool)
    ids = tokens.clamp(0, len(VOCAB) - 1)
    polarity = _POLARITY.to(tokens.device)[ids] * mask
    intensified = ((tokens == ID["very"]) | (tokens == ID["really"])) & mask
    negated = (tokens == ID["not"]) & mask
    stop = (tokens == ID["."]) & mask
    # Sentence index of each token: the number of full stops before it.
    sentence = torch.cumsum(stop.long(), dim=-1) - stop.long()
    n_slots = tokens.shape[-1] + 1
    flat = sentence.reshape(-1, tokens.shape[-1])

    def per_sentence(x: Tensor) -> Tensor:
        out = torch.zeros(flat.shape[0], n_slots, dtype=torch.float32, device=tokens.device)
        return out.scatter_add_(1, flat, x.reshape(flat.shape).float())

    score = per_sentence(polarity)
    score = score * torch.where(per_sentence(intensified) > 0, 2.0, 1.0)
    score = score * torch.where(per_sentence(negated) > 0, -1.0, 1.0)
    used = per_sentence((mask & (polarity != 0)) | stop) > 0
    count = used.sum(-1)
    mean = torch.where(count > 0, (score * used).sum(-1) / count.clamp(min=1), 0.0)
    return mean.clamp(-1.0, 1.0).reshape(tokens.shape[:-1])


def decode(tokens: Tensor) -> str:
    """The words of one sequence of ids, padding dropped."""
    return " ".join(VOCAB[int(t)] for t in tokens if int(t) != PAD_ID)


def log_prob(tokens: Tensor, style: ReviewStyle) -> Tensor:
    """The exact log-probability of each review ``[..., T]`` under ``style`` (-inf off the grammar).

    A review has one derivation, so this is the sum of the log-probabilities of its choices:
    the number of sentences, then per sentence its form, polarity, noun, verb or intensifier,
    negation and adjective. Padding after ``<eos>`` is ignored.
    """
    nouns = torch.tensor(style.noun_weights or (1.0,) * len(NOUNS), dtype=torch.float64)
    noun_logp = dict(zip(NOUNS, (nouns / nouns.sum()).log().tolist(), strict=True))

    def log(p: float) -> float:
        return float(torch.tensor(p, dtype=torch.float64).log())

    def one(words: list[str]) -> float:
        if len(words) < 3 or words[0] != BOS or EOS not in words:
            return float("-inf")
        body = words[1 : words.index(EOS)]
        if any(w == PAD for w in body) or any(w != PAD for w in words[words.index(EOS) + 1 :]):
            return float("-inf")
        sentences: list[list[str]] = []
        while body:
            if "." not in body:
                return float("-inf")
            cut = body.index(".")
            sentences.append(body[:cut])
            body = body[cut + 1 :]
        if not 1 <= len(sentences) <= style.max_sentences:
            return float("-inf")
        total = -log(style.max_sentences)
        for s in sentences:
            total += _sentence_log_prob(s, style, noun_logp, log)
        return total

    flat = tokens.reshape(-1, tokens.shape[-1]).tolist()
    out = torch.tensor([one([VOCAB[i] for i in row]) for row in flat], dtype=torch.float64)
    return out.reshape(tokens.shape[:-1])


def _sentence_log_prob(s: list[str], style: ReviewStyle, noun_logp: dict, log) -> float:
    """log P(sentence) without its full stop; -inf if the grammar cannot produce it."""
    inf = float("-inf")
    if len(s) == 4 and s[0] == "i" and s[2] == "the" and s[3] in noun_logp:
        if s[1] in POSITIVE_VERBS:
            polarity = log(style.positive)
        elif s[1] in NEGATIVE_VERBS:
            polarity = log(1 - style.positive)
        else:
            return inf
        return log(style.verb_sentence) + polarity - log(3) + noun_logp[s[3]]
    if len(s) < 4 or s[0] != "the" or s[1] not in noun_logp or s[2] != "was":
        return inf
    rest = s[3:]
    total = log(1 - style.verb_sentence) + noun_logp[s[1]]
    if rest[0] in INTENSIFIERS:
        total += log(style.intensified) - log(len(INTENSIFIERS))
        rest = rest[1:]
    else:
        total += log(1 - style.intensified)
    negated = bool(rest) and rest[0] == "not"
    rest = rest[1:] if negated else rest
    total += log(style.negated) if negated else log(1 - style.negated)
    if len(rest) != 1:
        return inf
    if rest[0] in POSITIVE_ADJECTIVES:
        adjective_positive = True
    elif rest[0] in NEGATIVE_ADJECTIVES:
        adjective_positive = False
    else:
        return inf
    # The adjective is positive when the sentence is positive and not negated, or negative and
    # negated; the sentence's polarity is drawn independently of the negation.
    meant_positive = adjective_positive != negated
    total += log(style.positive) if meant_positive else log(1 - style.positive)
    return total - log(len(POSITIVE_ADJECTIVES))


__all__ = [
    "BOS",
    "BOS_ID",
    "ENTHUSIAST",
    "EOS",
    "EOS_ID",
    "ID",
    "INTENSIFIERS",
    "NEGATIVE_ADJECTIVES",
    "NEGATIVE_VERBS",
    "NEUTRAL",
    "NOUNS",
    "PAD",
    "PAD_ID",
    "POSITIVE_ADJECTIVES",
    "POSITIVE_VERBS",
    "VOCAB",
    "ReviewStyle",
    "decode",
    "log_prob",
    "sample_reviews",
    "sentiment",
]
