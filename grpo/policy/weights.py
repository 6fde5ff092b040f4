"""The policy's weights as one whole: its full, unsharded state dict on the CPU with tied weights once (a
collective under FSDP2), as checkpoints store it and the reference resets read it."""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict on the CPU (a collective under FSDP: every process must call it), with
    tied weights stored once."""
    sd = get_model_state_dict(model, options=FULL)
    tied = tied_names(model)
    return {k: v.contiguous() for k, v in sd.items() if k not in tied}


def tied_names(model) -> set[str]:
    """Names of parameters that are the same object as an earlier one (tied embeddings, say)."""
    first, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.add(name)
        first.setdefault(id(p), name)
    return tied
