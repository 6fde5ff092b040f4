"""The task seam: a task is two lists of examples (train and held-out) plus a reward.

An `Example` carries the prompt text, the reference answer (None when the data has none) and any extra fields;
the extra fields reach reward functions as keyword arguments (TRL's convention), so a reward can use more than
the answer. A conversational prompt (TRL's conversational format: a list of `{"role", "content"}` messages,
system and few-shot turns included) is kept whole in `conversation` and rendered through the chat template;
`prompt` is then the text of its last user message (what logs, error messages and the judge's `{prompt}` show).
`images` are the prompt's pictures, for a vision-language model (`grpo.vision`): a text prompt shows them before its
text in one user message; a conversation places them at its messages' `{"type": "image"}` entries.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    conversation: list[dict[str, Any]] | None = None  # the messages of a conversational prompt, else None
    images: tuple = ()  # the prompt's images (RGB PIL images, `grpo.images.load_image`), shown before its text


class Task(Protocol):
    name: str
    train: list[Example]
    eval: list[Example]


def in_held_out(prompt: str, fraction: float) -> bool:
    """Stable split by a hash of the prompt text: the same prompt is in the same split for every seed,
    so a model warm-started on the train split has never seen a held-out prompt."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return h / 2**64 < fraction
