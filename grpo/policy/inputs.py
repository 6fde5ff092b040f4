"""What a forward pass through the policy is given, made in one place: `model_inputs`.

Every forward pass (the training and reference log-probs, the in-process generator's prefill and decoding, the
lean decoding steps) runs over rows of left-padded prompts, possibly followed by completion tokens, and takes its
position ids from here: each token's position counts the attended tokens before it, so padding never shifts a
row's positions (a padding position gets 0, which nothing attends to). `packed_inputs` makes the packed form of
the same batch (`compute.packing`): only the attended tokens, sequence after sequence, each with the position
`model_inputs` gives it, so positions restart at each sequence's start. What later changes how positions are made
changes this module alone: a vision-language model's rows (`images`: their pixel values and image grids) take the
three-axis rotary positions of the Qwen2-VL family from the model's own `get_rope_index` (`grpo.vision`), and
travel in the forward's keyword arguments with Gemma 3's `token_type_ids`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor       # (B, L)
    attention_mask: torch.Tensor  # (B, L) 1 on the tokens attended to
    position_ids: torch.Tensor    # (B, L), or (3, B, L): a Qwen2-VL-family model's rotary axes
    images: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel_values, image_grid_thw,
    # token_type_ids (`grpo.vision`)

    @property
    def next_position(self) -> torch.Tensor:
        """(B,) the position of a token appended to each row (the first decoding step's): one past the largest
        (on every axis: text after images goes on one apart on all three)."""
        if self.position_ids.dim() == 3:
            return self.position_ids.amax(dim=(0, 2)) + 1
        return self.attention_mask.sum(-1)

    def forward_kwargs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of a transformers forward."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids,
                **self.images}


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, images: dict | None = None,
                 model=None) -> ModelInputs:
    """The forward inputs of (B, L) rows of tokens and their attention mask (left-padded prompts, then any
    completion tokens, right-padded). `images`: the rows' image tensors (`grpo.vision.join`), with the `model`
    whose positions they decide."""
    position = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if images:
        from grpo.vision import rope_positions, token_types
        rope = rope_positions(model, input_ids, attention_mask, images.get("image_grid_thw"))
        position = position if rope is None else rope
        images = {**images, **token_types(model, input_ids)}
    return ModelInputs(input_ids, attention_mask, position, dict(images or {}))


@dataclass(frozen=True)
class PackedInputs:
    """The attended tokens of a batch of prompts and completions, with no padding: `packed_inputs`.

    The tokens come sequence by sequence: each prompt (of P), then the completions of the rows that share it
    (B rows; without shared prompts P = B and each row is its prompt followed by its completion, one sequence).
    Each token keeps the position `model_inputs` gives it in its padded row, so positions restart at each
    sequence. `slots` says where each token sits in the padded layout it came from: P·lp prompt slots (prompt g,
    column c at g·lp + c), then B·t1 completion slots (row i, fed completion token c at P·lp + i·t1 + c)."""

    input_ids: torch.Tensor      # (N,) the attended tokens
    position_ids: torch.Tensor   # (N,) each one's position in its sequence
    slots: torch.Tensor          # (N,) long: each one's slot in the padded layout
    prompts: int                 # P
    prompt_width: int            # lp: the prompts' padded width
    rows: int                    # B
    fed_width: int               # t1: completion tokens fed per row (T - 1: the last predicts nothing)
    group: torch.Tensor          # (B,) long: each row's prompt
    wanted: torch.Tensor         # (B, T) bool: the completion tokens whose log-probs are computed
    predictors: torch.Tensor     # (M,) long: for each wanted token (row-major), the index of the token before it


def packed_inputs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor, group: torch.Tensor, first: torch.Tensor) -> PackedInputs:
    """The packed forward inputs of (B, lp) left-padded prompts and (B, T) right-padded completions: the prompt of
    row `first[g]` once for prompt g, and row i's completion after prompt `group[i]` (group = first = arange(B):
    every row its own prompt). The positions are `model_inputs`' at the attended tokens. A completion token's
    log-prob is wanted where it is attended and so is the token before it (the last prompt token for the first)."""
    b, lp = prompt_ids.shape
    t1 = completion_ids.shape[1] - 1
    p = len(first)
    inputs = model_inputs(torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1),
                          torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1))
    ids, attn, position = inputs.input_ids, inputs.attention_mask.bool(), inputs.position_ids
    slab_ids = torch.cat([ids[first, :lp].reshape(-1), ids[:, lp:].reshape(-1)])
    slab_pos = torch.cat([position[first, :lp].reshape(-1), position[:, lp:].reshape(-1)])
    slab_attn = torch.cat([attn[first, :lp].reshape(-1), attn[:, lp:].reshape(-1)])
    device = ids.device
    # sequence order: prompt g (key 2g), then the completions of its rows (key 2g + 1), each in slot order
    key = torch.cat([torch.arange(p, device=device).repeat_interleave(lp) * 2,
                     group.repeat_interleave(t1) * 2 + 1])
    attended = slab_attn.nonzero().squeeze(1)
    slots = attended[torch.sort(key[attended], stable=True).indices]
    where = torch.full((p * lp + b * t1,), -1, dtype=torch.long, device=device)  # slot -> packed index
    where[slots] = torch.arange(len(slots), device=device)
    before = torch.cat([where[group * lp + lp - 1].unsqueeze(1),
                        where[p * lp:].view(b, t1)], dim=1)  # (B, T): the token before each completion token
    wanted = completion_mask.bool() & (before >= 0)
    return PackedInputs(slab_ids[slots], slab_pos[slots], slots, p, lp, b, t1, group, wanted, before[wanted])
