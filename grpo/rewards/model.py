"""A reward model as a reward function: `rm:<path>` in the rewards list (docs/rewards.md#reward-models).

Any `AutoModelForSequenceClassification` with one label scores each completion: its logit is the reward (TRL's
convention). It reads its own tokenizer: with a chat template, the prompt as the user's message and the completion
as the assistant's (a multi-turn episode: its messages as they were exchanged); without one, prompt + completion
as plain text. It runs batched, without gradients, on the trainer's device or its own (`reward_model.*`), in
bfloat16 where asked; it is never trained and never in the optimiser. Its scores are logged as
`reward/<name>`, the name being the model directory's (`rm:models/my-rm` -> `reward/my-rm`).

`rm:tiny-rm` is the bundled one (`scripts/build_tiny_rm.py`, docs/rewards.md): a verifier of the built-in
arithmetic tasks learnt from the bundled policy's own samples.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from grpo.config import RewardModelConfig
from grpo.errors import ConfigError, DataError

PREFIX = "rm:"


class RewardModel:
    """`rm:<path>`: loaded by `load()` (the trainer calls it while it builds the run; a check of the config does
    not), called as any reward function."""

    def __init__(self, path: str, options: RewardModelConfig | None = None, *, device: str = "cpu",
                 field: str = "rewards"):
        """`options`: the config's `reward_model` section (None: its defaults); `device`: where it runs unless
        `options.device` says."""
        if not path.strip():
            raise ConfigError(f"{field}: {PREFIX!r} names no reward model; write rm:<directory or Hub id>")
        options = options or RewardModelConfig()
        self.path, self.device, self.bf16 = path, options.device or device, options.bf16
        self.batch_size, self.max_length, self.field = options.batch_size, options.max_length, field
        self.__name__ = Path(path.rstrip("/")).name or path
        self.model = self.tokenizer = None

    def __repr__(self) -> str:
        return f"RewardModel({self.path!r})"

    @property
    def spec(self) -> str:
        return PREFIX + self.path

    def load(self) -> RewardModel:
        """Load the model and its tokenizer (once), refusing what cannot score: more than one label, no padding
        token."""
        if self.model is not None:
            return self
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        from grpo.models import check_model_path, resolve_model_path

        where = f"{self.field}: {self.spec}"
        source = resolve_model_path(self.path)
        check_model_path(source, where)
        local = Path(source).expanduser()
        source = str(local) if local.exists() else source
        try:
            config = AutoConfig.from_pretrained(source)
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: cannot load it ({_first_line(e)})") from None
        if config.num_labels != 1:
            raise ConfigError(f"{where} has {config.num_labels} labels; a reward model has one, its score "
                              "(AutoModelForSequenceClassification with num_labels=1)")
        if tokenizer.pad_token_id is None:
            raise ConfigError(f"{where}: its tokenizer has no padding token, which batched scoring needs (set one "
                              "in the model's tokenizer_config.json)")
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        try:
            model = AutoModelForSequenceClassification.from_pretrained(source, dtype=dtype)
        except (OSError, ValueError, RuntimeError) as e:
            raise ConfigError(f"{where}: cannot load its weights ({_first_line(e)})") from None
        model.config.pad_token_id = tokenizer.pad_token_id  # it finds each row's last token by the padding
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise DataError(f"reward_model.device={self.device!r} but PyTorch sees no CUDA device")
        model.to(self.device).eval().requires_grad_(False)
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"  # a long input keeps the completion, which the score reads last
        self.model, self.tokenizer = model, tokenizer
        return self

    def texts(self, prompts: Sequence[str], completions: Sequence[str],
              messages: Sequence[list[dict]] | None = None) -> list[str]:
        """What the model reads for each completion."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            convs = list(messages) if messages is not None else [
                [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                for p, c in zip(prompts, completions, strict=True)]
            return [tok.apply_chat_template(m, tokenize=False) for m in convs]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 messages: Sequence[list[dict]] | None = None, **_) -> list[float]:
        self.load()
        texts = self.texts(prompts, completions, messages)
        limit = self.max_length or _context(self.model, self.tokenizer)
        templated = bool(getattr(self.tokenizer, "chat_template", None))  # the template wrote its special tokens
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[i:i + self.batch_size], padding=True, truncation=limit is not None,
                                   max_length=limit, return_tensors="pt",
                                   add_special_tokens=not templated).to(self.device)
            logits = self.model(**batch).logits  # (B, 1)
            scores += logits[:, 0].float().tolist()
        return scores


def _context(model, tokenizer) -> int | None:
    """The longest input the model takes: its positions (a tokenizer's model_max_length is only a hint, and often
    a sentinel), else the tokenizer's."""
    positions = getattr(model.config, "max_position_embeddings", None)
    hint = getattr(tokenizer, "model_max_length", None)
    return positions or (hint if hint and hint < 10**6 else None)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
