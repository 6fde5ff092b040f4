"""The default environment: one turn. Each prompt is rendered (as is, or through the chat template), the
generator samples G completions, and every completion token is the model's to learn."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from grpo.errors import DataError
from grpo.rollout import Generator, Rollout, Sampling
from grpo.tasks.base import Example


class SingleTurn:
    def __init__(self, render: Callable[[str], str] = str):
        """`render`: prompt text -> the text the model sees (`prompt_formatter`, below)."""
        self.render = render

    def rollout(self, generator: Generator, examples: Sequence[Example], sampling: Sampling,
                seeds: Sequence[int] | None = None) -> Rollout:
        # the generator's loss mask is its completion mask: nothing here is inserted by the environment
        return generator.generate([self.render(e.prompt) for e in examples], sampling, seeds)


def prompt_formatter(tokenizer, cfg) -> Callable[[str], str]:
    """Prompt text → the text the model sees: as is, or through the tokenizer's chat template (`cfg`: the
    `model.*` section, `chat_template` and `system_prompt`)."""
    if not cfg.chat_template:
        return lambda text: text
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("model.chat_template is on but the tokenizer has no chat template; turn it off or use "
                        "a chat model's tokenizer")

    def render(text: str) -> str:
        messages = ([{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else [])
        messages.append({"role": "user", "content": text})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render
