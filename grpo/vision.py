"""Images in prompts: reading them, rendering a prompt with its images, and the tensors that travel with its rows.

A vision-language model's prompt is text with one placeholder per image; its image processor turns each image into
patches (`pixel_values`, (patches, D)) and a grid size (`image_grid_thw`, (images, 3)), and the placeholder is
widened to one token per merged patch, as the model's own processor does (`Qwen2_5_VLProcessor.replace_image_token`).
The processor class itself cannot be built without torchvision (it insists on a video processor), so the prompt is
rendered here from its two parts, the tokenizer (with the chat template) and the image processor, both loaded from
the model's directory by transformers.

Each row carries its prompt's tensors as one `Images` (a dict-free pair, so rows select and join as lists do,
`grpo.rows`); `join` makes the keyword arguments of a forward over some rows. Images are part of the prompt only:
the placeholder tokens are never sampled (`placeholder_ids`, masked out of the policy's logits wherever it is
computed, so the sampler and the trainer agree on one distribution) and never in a completion's loss mask.

Supported: the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: 3-axis rotary positions from the model's own
`get_rope_index`) and single-axis families whose processor widens one image token per image (Gemma 3,
Idefics3/SmolVLM: positions are plain, `image_grid_thw` absent).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo.errors import DataError

# a placeholder token's logit, wherever the policy's distribution is computed: its probability is exactly 0, and
# unlike -inf it keeps the entropy's p·z finite (0 · -1e30 = 0) and survives a division by the temperature
PLACEHOLDER_LOGIT = -1e30

# the config attributes that name a multimodal model's special tokens: none is ever sampled
_PLACEHOLDER_ATTRS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                      "image_token_index", "boi_token_index", "eoi_token_index")


def is_multimodal(model_or_config) -> bool:
    """Whether a model (or its config) has a vision tower."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return getattr(cfg, "vision_config", None) is not None


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


@dataclass(frozen=True)
class Images:
    """One row's image tensors, as its prompt's image processor made them."""

    pixel_values: torch.Tensor                 # (patches, D) the row's images' patches, image after image
    image_grid_thw: torch.Tensor | None = None  # (images, 3) long: each image's grid (Qwen2-VL family)

    @property
    def count(self) -> int:
        return 0 if self.image_grid_thw is None else len(self.image_grid_thw)


def join(rows: list[Images | None] | None, device=None) -> dict[str, torch.Tensor]:
    """The image keyword arguments of a forward over these rows (in their order): pixel values and grids
    concatenated; {} when no row has images."""
    rows = [r for r in (rows or []) if r is not None]
    if not rows:
        return {}
    out = {"pixel_values": torch.cat([r.pixel_values for r in rows])}
    if rows[0].image_grid_thw is not None:
        out["image_grid_thw"] = torch.cat([r.image_grid_thw for r in rows])
    return {k: v.to(device) if device is not None else v for k, v in out.items()}


def placeholder_ids(model_or_config) -> list[int]:
    """The ids of a multimodal model's image and video placeholder and delimiter tokens (none for a text model)."""
    cfg = getattr(model_or_config, "config", model_or_config)
    ids = {getattr(cfg, a, None) for a in _PLACEHOLDER_ATTRS}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def mask_placeholders(logits: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """`logits` (..., V) with the `banned` ids' set to PLACEHOLDER_LOGIT (a new tensor; as is without any)."""
    if banned is None:
        return logits
    return logits.index_fill(-1, banned.to(logits.device), PLACEHOLDER_LOGIT)


def _rope_owner(model):
    """The module whose `get_rope_index` gives a Qwen2-VL-family model's 3-axis positions, or None."""
    seen = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        if callable(getattr(m, "get_rope_index", None)):
            return m
        for name in ("model", "base_model", "module"):
            child = getattr(m, name, None)
            if isinstance(child, torch.nn.Module):
                stack.append(child)
    return None


def rope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   image_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """(3, B, L) the rotary positions of a Qwen2-VL-family model from its own `get_rope_index` (padding at 0,
    image tokens on their grid, text after them one apart); None for a model with one position per token."""
    owner = _rope_owner(model)
    if owner is None or image_grid_thw is None:
        return None
    image_id = getattr(getattr(owner, "config", None), "image_token_id", None)
    types = (input_ids == image_id).int()
    position, _ = owner.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=image_grid_thw,
                                       attention_mask=attention_mask)
    return position


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
    """The `ImagePrompts` of a vision-language model (its image processor loaded from `path`, else from where the
    model was loaded); None for a text model."""
    if not is_multimodal(model):
        return None
    source = path or getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    try:
        return ImagePrompts.load(source, tokenizer, model.config)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the image processor of {str(source)!r}: {' '.join(str(e).split())[:200]}") \
            from None


def image_messages(text: str, images: tuple) -> list[dict]:
    """A user message holding `images` then `text`, in the content-list form chat templates of VLMs take."""
    return [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}]}]
