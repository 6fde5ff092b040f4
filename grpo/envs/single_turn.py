"""The default environment: one turn. Each prompt is rendered (as is, or through the chat template), the
generator samples G completions, and every completion token is the model's to learn."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from grpo.errors import DataError
from grpo.rollout import Generator, Rollout, Sampling
from grpo.tasks.base import Example

Prompt = str | list[dict[str, Any]]  # text, or a conversation (a list of {"role", "content"} messages)


def prompt_of(example: Example) -> Prompt:
    """What an example's prompt is to the renderer: its conversation, if it is one, else its text."""
    return example.conversation if example.conversation is not None else example.prompt


class SingleTurn:
    def __init__(self, render: Callable[[Prompt], str] = str):
        """`render`: prompt text or conversation -> the text the model sees (`prompt_formatter`, below)."""
        self.render = render

    def rollout(self, generator: Generator, examples: Sequence[Example], sampling: Sampling,
                seeds: Sequence[int] | None = None) -> Rollout:
        # the generator's loss mask is its completion mask: nothing here is inserted by the environment
        return generator.generate([self.render(prompt_of(e), e.images) if e.images else self.render(prompt_of(e))
                                   for e in examples], sampling, seeds)


def prompt_formatter(tokenizer, cfg) -> Callable[[Prompt], str]:
    """Prompt → the text the model sees (`cfg`: the `model.*` section: `chat_template`, `system_prompt`,
    `chat_template_kwargs`). A text prompt goes as is, or, with `chat_template` on, as a user message through the
    tokenizer's chat template; a conversation (TRL's conversational format) always goes through the template,
    `system_prompt` placed first when it has no system message. Both end with the generation prompt, also after a
    final assistant message (not continued: TRL's GRPOTrainer renders its prompts so). `render(prompt, images)`
    with images gives a `grpo.images.VisionPrompt`: a text prompt as the images then the text in one user message,
    a conversation as it is (its image parts, one per image, in their places), through the template."""
    kwargs = dict(getattr(cfg, "chat_template_kwargs", None) or {})
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError("model.chat_template is on but the tokenizer has no chat template; turn it off or use "
                        "a chat model's tokenizer")

    def template(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def render(prompt: Prompt, images: tuple = ()):
        if images:  # a `grpo.images.VisionPrompt`: always through the template, which writes the placeholders
            from grpo.images import VisionPrompt, image_messages
            if not getattr(tokenizer, "chat_template", None):
                raise DataError("the prompts have images, which a vision-language model's chat template places; this "
                                "tokenizer has no chat template")
            if not isinstance(prompt, str):  # its image parts are the images' places (grpo.tasks.hf)
                given = list(prompt)
                messages = given if any(m["role"] == "system" for m in given) else system + given
                return VisionPrompt(template(messages), tuple(images))
            return VisionPrompt(template(system + image_messages(prompt, images)), tuple(images))
        if not isinstance(prompt, str):
            if not getattr(tokenizer, "chat_template", None):
                raise DataError("the prompts are conversations (lists of messages), which are rendered through the "
                                "tokenizer's chat template, and this tokenizer has none; give text prompts, a chat "
                                "model, or a tokenizer with a chat template (grpo.train(processing_class=...))")
            given = list(prompt)
            return template(given if any(m["role"] == "system" for m in given) else system + given)
        if not cfg.chat_template:
            return prompt
        return template(system + [{"role": "user", "content": prompt}])

    return render
