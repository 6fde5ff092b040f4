"""What a forward pass through the policy is given, made in one place: `model_inputs`.

Every forward pass (the training and reference log-probs, the in-process generator's prefill and decoding, the
lean decoding steps) runs over rows of left-padded prompts, possibly followed by completion tokens, and takes its
position ids from here: each token's position counts the attended tokens before it, so padding never shifts a
row's positions (a padding position gets 0, which nothing attends to). What later changes how positions are made
changes this module alone: multimodal rotary positions (a vision-language model's three position axes, from its
image and video grids), or packed rows (positions restarting at each sequence's start).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor       # (B, L)
    attention_mask: torch.Tensor  # (B, L) 1 on the tokens attended to
    position_ids: torch.Tensor    # (B, L)

    @property
    def next_position(self) -> torch.Tensor:
        """(B,) the position of a token appended to each row (the first decoding step's)."""
        return self.attention_mask.sum(-1)

    def forward_kwargs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of a transformers forward."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> ModelInputs:
    """The forward inputs of (B, L) rows of tokens and their attention mask (left-padded prompts, then any
    completion tokens, right-padded)."""
    return ModelInputs(input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0))
