"""Images in prompts, the tensor side: what a forward pass over rows with images needs, and nothing that reads data.

Each row carries its prompt's tensors as one `Images` (`grpo.images.ImagePrompts` makes them: the image processor's
`pixel_values`, and in the Qwen2-VL family `image_grid_thw`), so rows select and join as lists do (`grpo.rows`);
`join` makes the keyword arguments of a forward over some rows, and `model_inputs` adds what depends on the tokens
(`rope_positions`, `token_types`). Images are part of the prompt only: the placeholder
tokens are never sampled (`placeholder_ids`, masked out of the policy's logits wherever it is computed, so the
sampler and the trainer agree on one distribution) and never in a completion's loss mask.

Supported: the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: 3-axis rotary positions from the model's own
`get_rope_index`) and Gemma 3 (plain positions; `token_type_ids` marking the image tokens, which attend to each other
both ways in the prefill and the training pass alike, as its processor gives them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class Images:
    """One row's image tensors, as its prompt's image processor made them."""

    pixel_values: torch.Tensor                 # the row's images, image after image: (patches, D) in the Qwen2-VL
    # family, (pictures, 3, H, W) in Gemma 3 (a pan-and-scan image: the original, then its crops)
    image_grid_thw: torch.Tensor | None = None  # (images, 3) long: each image's grid (Qwen2-VL family)

    @property
    def count(self) -> int:
        """The pictures the row's tokens stand for (Gemma 3 counts each pan-and-scan crop)."""
        return len(self.pixel_values) if self.image_grid_thw is None else len(self.image_grid_thw)


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


# the model types whose forward takes `token_type_ids` marking the image tokens (bidirectional attention among them)
_TOKEN_TYPE_MODELS = ("gemma3",)


def token_types(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"token_type_ids": (B, L) long, 1 on the image tokens} for a model whose image tokens attend to each other
    both ways (Gemma 3); {} for any other. Without them Gemma 3 attends causally within an image, a policy other than
    the one its processor's inputs give, and its prefill and training pass would disagree if one had them."""
    cfg = getattr(model, "config", None)  # a peft model's is its base model's
    if getattr(cfg, "model_type", None) not in _TOKEN_TYPE_MODELS:
        return {}
    return {"token_type_ids": (input_ids == cfg.image_token_id).long()}

