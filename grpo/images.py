"""Images in prompts, the data side: reading them (`load_image`, one line naming the row for a bad one) and rendering
a prompt with its images into token ids and `grpo.vision.Images` (`ImagePrompts`).

A vision-language model's prompt is text with one placeholder per image; its image processor turns each image into
pixel values (and, in the Qwen2-VL family, a grid size), and the placeholder is widened to the tokens the model
replaces with the image's features, as the family's own processor does (`Qwen2_5_VLProcessor` and `Gemma3Processor`,
`replace_image_token`). Qwen2-VL's processor class cannot be built without torchvision (it insists on a video
processor), so every prompt is rendered here from its two parts, the tokenizer (with the chat template) and the
image processor, both loaded from the model's directory by transformers. What a forward pass
needs of the images (their tensors, positions, placeholder ids) is `grpo.vision`'s.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.errors import ConfigError, DataError
from grpo.vision import Images, is_multimodal


def load_image(value: Any, where: str):
    """An RGB PIL image from a PIL image, a file path, bytes, or a `datasets` Image cell ({"bytes", "path"}); a
    DataError naming `where` (the row) for anything unreadable, empty or of another kind."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray)):
            if not value:
                raise DataError(f"{where}: the image is empty (0 bytes)")
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, Path)):
            path = Path(value)
            if not path.is_file():
                raise DataError(f"{where}: no image file {str(path)!r}")
            if path.stat().st_size == 0:
                raise DataError(f"{where}: the image file {str(path)!r} is empty")
            image = Image.open(path)
        else:
            raise DataError(f"{where}: an image must be a PIL image, a file path or bytes, got "
                            f"{type(value).__name__}")
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: not a readable image ({e})") from None
    if image.width == 0 or image.height == 0:
        raise DataError(f"{where}: the image has zero size ({image.width}x{image.height})")
    if image.mode != "RGB":
        if image.mode not in ("L", "LA", "RGBA", "P", "I", "I;16", "F", "CMYK", "YCbCr", "1"):
            raise DataError(f"{where}: image mode {image.mode!r} cannot be read as RGB")
        image = image.convert("RGB")
    return image


def load_images(value: Any, where: str) -> tuple:
    """A row's images: one image or a list of them (`load_image` each); None or [] gives none."""
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(load_image(v, f"{where}, image {k}" if len(items) > 1 else where) for k, v in enumerate(items))


@dataclass(frozen=True)
class VisionPrompt:
    """A rendered prompt that holds images: its text (one `image_token` placeholder per image, as the chat
    template writes it) and the images, in order."""

    text: str
    images: tuple


class ImagePrompts:
    """Renders `VisionPrompt`s into token ids and `Images` with a model's tokenizer and image processor, widening
    each image's placeholder as the family's own processor does: the Qwen2-VL family's `<|image_pad|>` to one
    token per merged patch of the image's grid; Gemma 3's `<start_of_image>` to its full image sequence (two
    newlines, the begin token, `mm_tokens_per_image` image tokens, the end token, two newlines), and with
    pan-and-scan crops the original's sequence then each crop's, in `Gemma3Processor`'s words."""

    def __init__(self, tokenizer, image_processor, config):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.family = image_family(config)
        name = tokenizer.convert_ids_to_tokens
        if self.family == "qwen2_vl":
            self.placeholder = name(config.image_token_id)  # what the chat template writes, once per image
            self.merge = int(getattr(image_processor, "merge_size", 1) or 1)
        else:  # gemma3
            self.placeholder = name(config.boi_token_index)
            image, end = name(config.image_token_index), name(config.eoi_token_index)
            self.sequence = f"\n\n{self.placeholder}{image * int(config.mm_tokens_per_image)}{end}\n\n"

    def encode(self, prompt: VisionPrompt, where: str = "the prompt") -> tuple[list[int], Images | None]:
        """A prompt's token ids (each placeholder widened to its image's tokens) and its images' tensors."""
        self._check(prompt, where)
        if not prompt.images:
            return self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"], None
        out = self.image_processor(images=list(prompt.images), return_tensors="pt")
        grid = out.get("image_grid_thw")
        if self.family == "qwen2_vl":
            counts = [int(g.prod()) // self.merge ** 2 for g in grid]
        else:
            crops = out.get("num_crops")
            counts = [int(c) for c in crops] if crops is not None else [0] * len(prompt.images)
        ids = self.tokenizer(self._widened(prompt.text, counts), add_special_tokens=False)["input_ids"]
        return ids, Images(out["pixel_values"], None if grid is None else grid.long())

    def length(self, prompt: VisionPrompt, where: str = "the prompt") -> int:
        """The number of ids `encode` gives the prompt, from its images' sizes alone where the image processor
        tells what they become (Qwen2-VL: `get_number_of_image_patches`; Gemma 3 without pan-and-scan: always the
        same), without processing their pixels."""
        self._check(prompt, where)
        if self.family == "qwen2_vl" and hasattr(self.image_processor, "get_number_of_image_patches"):
            counts = [self.image_processor.get_number_of_image_patches(im.height, im.width, {}) // self.merge ** 2
                      for im in prompt.images]
        elif self.family == "gemma3" and not getattr(self.image_processor, "do_pan_and_scan", False):
            counts = [0] * len(prompt.images)
        else:
            return len(self.encode(prompt, where)[0])
        return len(self.tokenizer(self._widened(prompt.text, counts), add_special_tokens=False)["input_ids"])

    def _check(self, prompt: VisionPrompt, where: str) -> None:
        found = prompt.text.count(self.placeholder)
        if found != len(prompt.images):
            raise DataError(f"{where}: the rendered prompt has {found} image placeholders ({self.placeholder}) for "
                            f"{len(prompt.images)} images (the chat template writes one per image entry of a "
                            "message)")

    def _widened(self, text: str, counts: list[int]) -> str:
        """`text` with each image placeholder replaced by what stands for the image in the ids: Qwen2-VL family,
        `counts[k]` image tokens; Gemma 3, its image sequence and `counts[k]` pan-and-scan crops' after it."""
        pieces = text.split(self.placeholder)
        return pieces[0] + "".join(self._one(n) + piece for n, piece in zip(counts, pieces[1:]))

    def _one(self, n: int) -> str:
        if self.family == "qwen2_vl":
            return self.placeholder * n
        if not n:
            return self.sequence
        return (f"Here is the original image {self.sequence} and here are some crops to help you see better "
                + " ".join([self.sequence] * n))


def image_family(config) -> str:
    """How a vision-language model's prompts hold images: 'qwen2_vl' (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or 'gemma3'; a
    ConfigError naming the model type for any other (its processor's rules are not grpo's to guess)."""
    if getattr(config, "vision_start_token_id", None) is not None and getattr(config, "image_token_id", None) is not None:
        return "qwen2_vl"
    if getattr(config, "model_type", None) == "gemma3":
        return "gemma3"
    raise ConfigError(f"model.path: a {getattr(config, 'model_type', 'vision-language')} model; grpo trains "
                      "vision-language models of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and Gemma 3")


# the one line for prompts with images and a model that cannot read them (the trainer's build, the generator)
NO_VISION_TOWER = ("the prompts have images and this model has no vision tower (a vision-language model such as "
                   "Qwen2.5-VL or Gemma 3 reads them; docs/vision.md)")


def image_prompts_for(model, tokenizer, path=None) -> ImagePrompts | None:
    """The `ImagePrompts` of a vision-language model, or of a peft model around one (`image_processor_for`);
    None for a text model."""
    processor = image_processor_for(model, path)
    return None if processor is None else ImagePrompts(tokenizer, processor, model.config)


def image_processor_for(model, path=None):
    """A vision-language model's image processor (PIL backend), loaded from where the model was loaded, else from
    `path`; None for a text model. A peft model around one passes on its config and name (peft forwards them).
    A family grpo does not render is refused here (`image_family`), before any file is read."""
    if not is_multimodal(model):
        return None
    image_family(model.config)
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "") or path
    from transformers import AutoImageProcessor

    try:
        try:
            return AutoImageProcessor.from_pretrained(str(source), backend="pil")
        except TypeError:  # an older transformers without backends
            return AutoImageProcessor.from_pretrained(str(source))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the image processor of {str(source)!r}: {' '.join(str(e).split())[:200]}") \
            from None


def image_messages(text: str, images: tuple) -> list[dict]:
    """A user message holding `images` then `text`, in the content-list form chat templates of VLMs take."""
    return [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
