"""How forward passes through the policy run without autograd, and whether its parameters are sharded."""
from __future__ import annotations

import torch


def is_sharded(module) -> bool:
    """Whether any of `module`'s parameters is an FSDP2 shard (a DTensor). Any, not the first: after a forward
    the root module's parameters (embeddings, final norm) can stay gathered as plain tensors while the decoder
    layers' are shards."""
    return hasattr(module, "parameters") and any(hasattr(p, "full_tensor") for p in module.parameters())


def inference(module: torch.nn.Module):
    """A context without autograd for forward passes through `module`: inference mode (no bookkeeping at all),
    except for FSDP2-sharded parameters, whose gathered buffers must stay usable by the training passes."""
    return torch.no_grad() if is_sharded(module) else torch.inference_mode()
