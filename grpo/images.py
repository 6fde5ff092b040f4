"""Images in prompts, the data side: reading them (`load_image`, one line naming the row for a bad one) and rendering
a prompt with its images into token ids and `grpo.vision.Images` (`ImagePrompts`).

A vision-language model's prompt is text with one placeholder per image; its image processor turns each image into
patches and a grid size, and the placeholder is widened to one token per merged patch, as the model's own processor
does (`Qwen2_5_VLProcessor.replace_image_token`). The processor class itself cannot be built without torchvision (it
insists on a video processor), so the prompt is rendered here from its two parts, the tokenizer (with the chat
template) and the image processor, both loaded from the model's directory by transformers. What a forward pass
needs of the images (their tensors, positions, placeholder ids) is `grpo.vision`'s.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.errors import DataError
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
    """Renders `VisionPrompt`s into token ids and `Images` with a model's tokenizer and image processor."""

    def __init__(self, tokenizer, image_processor, config):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(config, "image_token_index")
        self.image_token = None if tokenizer is None else tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.merge = int(getattr(image_processor, "merge_size", 1) or 1)

    @classmethod
    def load(cls, path, tokenizer, config) -> ImagePrompts:
        from transformers import AutoImageProcessor

        try:
            processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
        except TypeError:  # an older transformers without backends
            processor = AutoImageProcessor.from_pretrained(str(path))
        return cls(tokenizer, processor, config)

    def encode(self, prompt: VisionPrompt, where: str = "the prompt") -> tuple[list[int], Images | None]:
        """A prompt's token ids (each placeholder widened to its image's tokens) and its images' tensors."""
        text = prompt.text
        found = text.count(self.image_token)
        if found != len(prompt.images):
            raise DataError(f"{where}: the rendered prompt has {found} image placeholders for {len(prompt.images)} "
                            "images (the chat template writes one per image entry of a message)")
        if not prompt.images:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        out = self.image_processor(images=list(prompt.images), return_tensors="pt")
        grid = out.get("image_grid_thw")
        pieces = text.split(self.image_token)
        widened = [pieces[0]]
        for k, piece in enumerate(pieces[1:]):
            n = int(grid[k].prod()) // self.merge ** 2 if grid is not None else self._tokens_per_image()
            widened.append(self.image_token * n + piece)
        ids = self.tokenizer("".join(widened), add_special_tokens=False)["input_ids"]
        return ids, Images(out["pixel_values"], None if grid is None else grid.long())

    def _tokens_per_image(self) -> int:
        for attr in ("image_seq_len", "mm_tokens_per_image", "image_seq_length"):
            n = getattr(self.image_processor, attr, None) or getattr(self.tokenizer, attr, None)
            if n:
                return int(n)
        raise DataError("this model's image processor does not say how many tokens an image takes")


def image_prompts_for(model, tokenizer, path=None) -> ImagePrompts | None:
    """The `ImagePrompts` of a vision-language model, or of a peft model around one (its image processor loaded
    from where the model was loaded, else from `path`); None for a text model."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not is_multimodal(model):
        return None
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "") or path
    try:
        return ImagePrompts.load(source, tokenizer, model.config)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the image processor of {str(source)!r}: {' '.join(str(e).split())[:200]}") \
            from None


def image_messages(text: str, images: tuple) -> list[dict]:
    """A user message holding `images` then `text`, in the content-list form chat templates of VLMs take."""
    return [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
