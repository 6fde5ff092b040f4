"""How forward passes through the policy run without autograd, whether its parameters are sharded, and whether it
recomputes activations."""
from __future__ import annotations

import torch


def is_sharded(module) -> bool:
    """Whether any of `module`'s parameters is an FSDP2 shard (a DTensor). Any, not the first: after a forward
    the root module's parameters (embeddings, final norm) can stay gathered as plain tensors while the decoder
    layers' are shards."""
    return hasattr(module, "parameters") and any(hasattr(p, "full_tensor") for p in module.parameters())


def is_checkpointing(model) -> bool:
    """Whether gradient (activation) checkpointing is on for `model`."""
    # transformers 5 renamed is_gradient_checkpointing (now deprecated) to is_activation_checkpointing
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def inference(module: torch.nn.Module):
    """A context without autograd for forward passes through `module`: inference mode (no bookkeeping at all),
    except for FSDP2-sharded parameters, whose gathered buffers must stay usable by the training passes."""
    return torch.no_grad() if is_sharded(module) else torch.inference_mode()
