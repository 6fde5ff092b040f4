"""The tiny random vision-language models the vision tests run on, one per family grpo renders."""
import torch
import transformers

from grpo.images import ImagePrompts
from grpo.tiny import (build_gemma3_image_processor, build_gemma3_tokenizer, build_vision_image_processor,
                       build_vision_tokenizer, tiny_gemma3_config, tiny_vision_config)


def _qwen2_5_vl():
    """A random Qwen2.5-VL-shape model (the bundled model's shape), its tokenizer and its prompt encoder."""
    tok = build_vision_tokenizer()
    cfg = tiny_vision_config(tok)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    return model, tok, ImagePrompts(tok, build_vision_image_processor(), cfg)


def _gemma3():
    """A random tiny Gemma 3 (sliding and full attention layers, a SigLIP tower), its tokenizer and prompts."""
    tok = build_gemma3_tokenizer()
    cfg = tiny_gemma3_config(tok)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    return model, tok, ImagePrompts(tok, build_gemma3_image_processor(), cfg)


FAMILIES = {"qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3}
