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
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

TINY_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "tiny-arith"
TINY_TOOLS_DIR = Path(__file__).resolve().parent / "assets" / "tiny-tools"
TINY_RM_DIR = Path(__file__).resolve().parent / "assets" / "tiny-rm"  # scripts/build_tiny_rm.py
TINY_VISION_DIR = Path(__file__).resolve().parent / "assets" / "tiny-vision"  # scripts/build_tiny_vision_model.py

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)
# Python's string.printable: digits, letters, punctuation and whitespace (space, \t, \n, \r, \x0b, \x0c).
CHARACTERS = string.printable
# The pre-tokenizer split used by Qwen2 (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2/Qwen2's reversible byte -> printable unicode map used by the ByteLevel pre-tokenizer/decoder
    (e.g. space -> "Ġ", newline -> "Ċ"; "!".."~" map to themselves)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_char_tokenizer(model_max_length: int = 64) -> transformers.PreTrainedTokenizerFast:
    """A character-level fast tokenizer: ids 0 and 1 are ``<|pad|>`` and ``<|endoftext|>`` (EOS), then one id
    per printable ASCII character (``string.printable``, space included). No BOS is prepended on encode and
    decoding concatenates the characters back exactly (no spaces added or cleaned up).

    It is built with the `tokenizers` library as a byte-level BPE **without merges** over exactly these
    characters, using Qwen2's own normalizer / pre-tokenizer / decoder. With no merges every character is
    its own token, so this is a character-level tokenizer; the point of the Qwen2-shaped pipeline is that
    transformers 5 loads any directory whose config.json says ``model_type: qwen2`` through
    ``Qwen2Tokenizer``, which rebuilds exactly this pipeline from the saved vocabulary. The tokenizer
    therefore behaves identically whether it is loaded from a tokenizer-only directory (as
    ``TokenizersBackend``) or from the model directory (as ``Qwen2Tokenizer``); a WordLevel model would be
    silently rebuilt as byte-level BPE there and lose its spaces. Characters outside the vocabulary (non-ASCII)
    are dropped on encode, as Qwen2's BPE has no unknown token."""
    b2u = _byte_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[b2u[ord(ch)]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], dropout=None, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
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
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
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


# The chat of the bundled tool model (`model.path: tiny-tools`, docs/tools.md): one special token per role, every
# turn ended by EOS, the tools' names in a system line, calls in the `pythonic` syntax inside the model's turn:
#   <|system|>tools: calculator<|endoftext|><|user|>Calculate 347 * 2918<|endoftext|><|assistant|>
#   [calculator(expression="347 * 2918")]<|endoftext|><|tool|>1012546<|endoftext|><|assistant|>1012546<|endoftext|>
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %} {{ (t.function if t.function is defined else t).name }}"
    "{% endfor %}<|endoftext|>{% endif -%}"
    "{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}<|endoftext|>{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}")


def build_tool_tokenizer(model_max_length: int = 128) -> transformers.PreTrainedTokenizerFast:
    """The character tokenizer of `build_char_tokenizer` with one special token per chat role (appended after
    the characters, so every character keeps its id) and `TOOL_CHAT_TEMPLATE`."""
    tok = build_char_tokenizer(model_max_length)
    tok.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


# The bundled vision-language model (`model.path: tiny-vision`, docs/vision.md): Qwen2.5-VL's architecture, scaled
# down, with the character tokenizer, Qwen2-VL's vision tokens and a one-line chat:
#   user: <|vision_start|><|image_pad|>...<|vision_end|>How many red squares?<|endoftext|>assistant:
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|endoftext|>{% endfor -%}"
    "{%- if add_generation_prompt %}assistant:{% endif -%}")
# the image processor's settings: 4-pixel patches merged 2 x 2, so a 32 x 32 picture is 16 image tokens, one per
# 8 x 8 cell of the `shapes` task
VISION_PATCH = 4
VISION_MERGE = 2


def build_vision_tokenizer(model_max_length: int = 128) -> transformers.PreTrainedTokenizerFast:
    """The character tokenizer of `build_char_tokenizer` with Qwen2-VL's vision tokens (after the characters, so
    every character keeps its id) and `VISION_CHAT_TEMPLATE`."""
    tok = build_char_tokenizer(model_max_length)
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = VISION_CHAT_TEMPLATE
    return tok


def build_vision_image_processor():
    """Qwen2-VL's image processor (PIL backend, no torchvision needed) at the tiny model's patch and merge sizes;
    pictures are resized to between 32 x 32 and 64 x 64 pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=VISION_PATCH, merge_size=VISION_MERGE, temporal_patch_size=2,
                                    min_pixels=32 * 32, max_pixels=64 * 64,
                                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def tiny_vision_config(tokenizer, **overrides):
    """The Qwen2.5-VL config of the bundled vision model: the text model of `tiny_model_config` (128 positions,
    its rotary dimensions split 4/6/6 over time, height and width) and a 2-block vision tower of width 64."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    kwargs = dict(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
                         max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, attention_dropout=0.0),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=VISION_PATCH,
                           spatial_merge_size=VISION_MERGE, temporal_patch_size=2, window_size=32,
                           out_hidden_size=128, fullatt_block_indexes=[1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    kwargs.update(overrides)
    return transformers.Qwen2_5_VLConfig(**kwargs)


GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
GEMMA3_CHAT_TEMPLATE = (  # Gemma 3's layout in words (its turns, an image as <start_of_image>), the roles as text
    "{%- for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<start_of_image>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|endoftext|>{% endfor -%}"
    "{%- if add_generation_prompt %}model:{% endif -%}")
GEMMA3_IMAGE_SIZE = 16  # pixels a side: 4 x 4 patches of 4 pixels, pooled to 2 x 2 = 4 image tokens
GEMMA3_PATCH = 4
GEMMA3_IMAGE_TOKENS = 4


def build_gemma3_tokenizer(model_max_length: int = 128) -> transformers.PreTrainedTokenizerFast:
    """The character tokenizer of `build_char_tokenizer` with Gemma 3's image tokens (after the characters, so
    every character keeps its id) and `GEMMA3_CHAT_TEMPLATE`: the second vision-language family's tests."""
    tok = build_char_tokenizer(model_max_length)
    tok.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS)})
    tok.chat_template = GEMMA3_CHAT_TEMPLATE
    return tok


def build_gemma3_image_processor():
    """Gemma 3's image processor (PIL backend) at the tiny model's picture size, without pan-and-scan."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
                                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_pan_and_scan=False)


def tiny_gemma3_config(tokenizer, **overrides):
    """A Gemma 3 config of about the tiny text model's size: 4 layers of width 128 (every second one a sliding
    window of 64 positions, as Gemma 3 interleaves them), a 1-layer SigLIP tower of width 32 over 16 x 16
    pictures, 4 image tokens a picture."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA3_TOKENS}
    kwargs = dict(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                         sliding_window=64, max_position_embeddings=128, rms_norm_eps=1e-6,
                         layer_types=["sliding_attention", "full_attention"] * 2,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, attention_dropout=0.0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=GEMMA3_IMAGE_SIZE, patch_size=GEMMA3_PATCH, vision_use_head=False),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    kwargs.update(overrides)
    return transformers.Gemma3Config(**kwargs)
