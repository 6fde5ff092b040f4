"""The bundled tiny model: a character-level tokenizer and a small Qwen2-architecture config.

The weights in `TINY_MODEL_DIR` are produced by ``scripts/build_tiny_model.py`` (see docs/tiny-model.md):
a few-million-parameter Qwen2ForCausalLM warm-started on the train split of the ``mixed`` built-in task so
that it samples the right answer often but not reliably, which leaves GRPO visible room on a laptop CPU.

The tokenizer is one token per character (printable ASCII), so a prompt such as
``"Calculate 2 + 2 * 6 ="`` is 21 tokens and the completion ``" 14"`` + EOS is 4.
"""
from __future__ import annotations

import string
from pathlib import Path

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

TINY_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "tiny-arith"

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
# Python's string.printable: digits, letters, punctuation and whitespace (space, \t, \n, \r, \x0b, \x0c).
CHARACTERS = string.printable


def build_char_tokenizer(model_max_length: int = 64) -> transformers.PreTrainedTokenizerFast:
    """A character-level fast tokenizer: ids 0-2 are ``<|pad|>``, ``<|endoftext|>``, ``<|unk|>``, then one id
    per printable ASCII character. Every character is its own pre-token, decoding concatenates tokens
    (no spaces added), no BOS is prepended, and a character outside the vocabulary encodes as ``<|unk|>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    return fast


def tiny_model_config(tokenizer, **overrides) -> transformers.Qwen2Config:
    """The Qwen2 config of the bundled model (the same model class as Qwen2-Math-1.5B, scaled down):
    tied embeddings, 64 positions, special-token ids taken from `tokenizer` (BOS = EOS, as in Qwen2).
    Keyword arguments override any field."""
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=576,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=64,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_sliding_window=False,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=True,
    )
    kwargs.update(overrides)
    return transformers.Qwen2Config(**kwargs)
