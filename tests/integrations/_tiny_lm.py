"""A tiny causal LM and tokenizer built from a config, saved to a folder (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ["<pad>", "<eos>", "<unk>"] + [chr(ord("a") + i) for i in range(13)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    out.padding_side = "left"
    return out


def save_tiny_lm(folder: Path, *, seed: int, hidden_size: int = 16) -> str:
    """A one-layer Llama with the tokenizer above, saved under ``folder``; returns its path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return str(folder)
