"""Loading the policy and its tokenizer, and the frozen reference model."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from grpo.config import ModelConfig
from grpo.errors import DataError

TINY = "tiny"


def resolve_model_path(path: str) -> str:
    if path == TINY:
        from grpo.tiny import TINY_MODEL_DIR
        return str(TINY_MODEL_DIR)
    return path


def load_model(cfg: ModelConfig):
    """The policy on its device (eval mode: no dropout, so the sampler and the loss see the same distribution) and its
    tokenizer, with a pad token set when the tokenizer has none (masks never rely on it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(cfg.path)
    local = Path(path)
    if local.exists() and not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
        raise DataError(f"model.path {path!r} is a directory without weights (*.safetensors or *.bin)")
    if not local.exists() and (path.startswith((".", "/", "~")) or path.count("/") > 1):
        raise DataError(f"model.path {path!r} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype))
    except OSError as e:
        raise DataError(f"cannot load model.path {path!r}: {' '.join(str(e).split())[:300]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise DataError("model.device='cuda' but PyTorch sees no CUDA device; use model.device=cpu or auto")
    model.to(device)
    model.eval()
    return model, tokenizer


def frozen_copy(model):
    """A frozen copy of the initial policy: the reference of the KL penalty."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref
