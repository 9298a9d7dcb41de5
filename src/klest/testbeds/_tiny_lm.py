"""A small causal LM and a word-level tokenizer built from a config: nothing is downloaded.

For tests, examples and experiments that need a real ``transformers`` model offline (and for
:meth:`klest.testbeds.LanguageModelTestbed.tiny`). Both need ``transformers`` (the ``klest[hf]``
extra), imported when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from klest._checks import check_positive_int

__all__ = ["tiny_causal_lm", "word_tokenizer"]


def _transformers(what: str) -> Any:
    """The ``transformers`` module, or an ImportError naming the extra that installs it."""
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError(
            f"klest.testbeds.{what} needs transformers: install the extra with "
            "pip install 'klest[hf]'"
        ) from err
    return transformers


def tiny_causal_lm(
    *,
    vocab_size: int,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 128,
    pad_token_id: int | None = 0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = 1,
    seed: int | None = 0,
) -> Any:
    """A small ``transformers.LlamaForCausalLM`` built from a config: nothing is downloaded.

    For tests, examples and experiments that need a real causal LM offline. The weights are
    Llama's random initialization under ``torch.manual_seed(seed)`` (the global generator is
    reseeded; ``seed=None`` draws from it as it stands); the MLP is twice the hidden size.
    Save it with ``save_pretrained`` where a trainer wants a path.

    Args:
      vocab_size: the number of tokens.
      hidden_size: the width (a multiple of ``num_heads``).
      num_layers: decoder layers.
      num_heads: attention heads (as many key/value heads).
      max_positions: the longest sequence.
      pad_token_id: padding's id (None: none).
      bos_token_id: the start token's id (None: none).
      eos_token_id: the end token's id (None: none).
      seed: the seed of the initialization (None: the global generator's current state).

    Returns:
      The model, in training mode, float32.

    Example:
      >>> model = tiny_causal_lm(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2)
      >>> model(input_ids=torch.tensor([[3, 4, 5]])).logits.shape
      torch.Size([1, 3, 16])
    """
    transformers = _transformers("tiny_causal_lm")
    check_positive_int("vocab_size", vocab_size, allow_none=False)
    check_positive_int("num_layers", num_layers, allow_none=False)
    check_positive_int("num_heads", num_heads, allow_none=False)
    if check_positive_int("hidden_size", hidden_size, allow_none=False) % num_heads:
        raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}")
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def word_tokenizer(
    words: Sequence[str], *, pad: str = "<pad>", eos: str = "<eos>", unk: str = "<unk>"
) -> Any:
    """A whitespace word-level ``PreTrainedTokenizerFast`` over ``words``: nothing downloaded.

    Ids: ``pad`` 0, ``eos`` 1, ``unk`` 2, then ``words`` in order (so it matches
    :func:`tiny_causal_lm`'s default ``pad_token_id=0, eos_token_id=1``). Prompts are padded on
    the left, as generation wants.

    Args:
      words: the vocabulary, without the three special tokens; no whitespace inside a word.
      pad: the padding token.
      eos: the end token.
      unk: the token of unknown words.

    Returns:
      The tokenizer; ``len(tokenizer) == len(words) + 3``.

    Example:
      >>> tok = word_tokenizer(["a", "b", "c"])
      >>> tok("a c b")["input_ids"]
      [3, 5, 4]
    """
    _transformers("word_tokenizer")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [pad, eos, unk, *words]
    if len(set(vocab)) != len(vocab) or any(not w or any(c.isspace() for c in w) for w in vocab):
        raise ValueError(
            f"words must be distinct non-empty strings without whitespace, other than the "
            f"special tokens {pad!r}, {eos!r}, {unk!r}; got {list(words)!r}"
        )
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=unk))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token=pad, eos_token=eos, unk_token=unk
    )
    tokenizer.padding_side = "left"
    return tokenizer
