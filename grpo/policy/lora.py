"""Merging a peft LoRA layer's adapters into its weight, for the code that reads weights rather than running
the adapted forward (the vLLM engine's weight sync, the lean decoding's merged view). Depends on torch only, so
the rollout modules can use it without importing the config or model loading."""
from __future__ import annotations

import torch


def lora_merged_weight(layer) -> torch.Tensor:
    """W + ΔW of a peft LoRA layer's active adapters, as the adapted layer computes it: a new tensor (the layer
    and its weights are not touched). For the vLLM engine's weights and the lean decoding's merged view."""
    w = layer.base_layer.weight.detach().clone()
    adapters = set(layer.lora_A) | set(getattr(layer, "lora_embedding_A", {}))
    for adapter in layer.active_adapters:
        if adapter in adapters:
            w += layer.get_delta_weight(adapter).to(w.dtype)
    return w
