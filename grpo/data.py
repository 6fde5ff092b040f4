"""The training prompt stream: whole batches of examples in a seeded order, reshuffled every epoch; and the
check that every prompt fits the model (`fit_prompts`)."""
from __future__ import annotations

import dataclasses
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from grpo.errors import DataError
from grpo.tasks.base import Example


@dataclass
class PromptStream:
    examples: list[Example]
    batch_size: int
    seed: int
    epoch: int = 0
    position: int = 0  # (epoch, position) is all a resume needs

    def __post_init__(self):
        if not self.examples:
            raise DataError("the training set is empty")
        self._order = self._shuffled(self.epoch)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    @property
    def drawn(self) -> int:
        """How many examples were drawn before the next one (the next one's index in the stream)."""
        return self.epoch * len(self.examples) + self.position

    def restore(self, epoch: int, position: int) -> None:
        self.epoch, self.position = epoch, position
        self._order = self._shuffled(epoch)

    def next_batch(self) -> list[Example]:
        out = []
        while len(out) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.examples[self._order[self.position]])
            self.position += 1
        return out


def fit_prompts(examples: list[Example], render: Callable, tokenizer, *, add_special_tokens: bool,
                limit: int, truncate: str, what: str, why: str, image_prompts=None) -> list[Example]:
    """Every prompt must have tokens, and at most `limit` once rendered (`render`: the chat template, or as is).
    One too long is refused (with the count and the longest) or, with `truncate="left"`, cut from the left until
    it fits: its first tokens go, the chat template around it stays. `what` names the prompts ("training",
    "held-out"); `why` says where `limit` comes from. Characters the tokenizer drops are warned about once.
    Conversational prompts (`Example.conversation`) are measured whole, rendered; one too long is refused (a
    conversation is not cut). A prompt with images is measured as the sampler will see it, each image widened to
    its tokens (`image_prompts`: the model's `grpo.images.ImagePrompts`); one too long is refused (an image is not
    cut)."""
    if not examples:
        return examples
    if image_prompts is not None:
        _fit_images(examples, render, image_prompts, limit=limit, what=what, why=why)
    if examples[0].conversation is not None:
        return _fit_conversations(examples, render, tokenizer, limit=limit, what=what, why=why)
    raw = tokenizer([e.prompt for e in examples], add_special_tokens=False)["input_ids"]
    empty = [e.prompt for e, ids in zip(examples, raw) if not ids]
    if empty:
        one = len(empty) == 1
        raise DataError(f"{len(empty)} {what} prompt{'' if one else 's'} tokenize{'s' if one else ''} to nothing (e.g. "
                        f"{empty[0]!r}): empty, or only characters the tokenizer has no token for")
    _warn_dropped(examples, tokenizer, what)

    def length(text: str) -> int:
        return len(tokenizer(render(text), add_special_tokens=add_special_tokens)["input_ids"])

    overhead = length("")  # the template's own tokens; a prompt's rendered length is about this plus its own
    near = [i for i, ids in enumerate(raw) if len(ids) + overhead > limit - 8]  # only these are rendered
    too_long = [(i, n) for i in near if (n := length(examples[i].prompt)) > limit]
    if not too_long:
        return examples
    if truncate != "left":
        i, n = max(too_long, key=lambda t: t[1])
        raise DataError(f"{len(too_long)} of {len(examples)} {what} prompts have more than {limit} tokens ({why}); "
                        f"the longest has {n}: {examples[i].prompt[:60]!r}... Shorten them, lower "
                        "rollout.max_new_tokens, or cut them from the left with data.truncate_prompts=left")
    out = list(examples)
    for i, n in too_long:
        keep = len(raw[i]) - (n - limit)
        while True:
            text = tokenizer.decode(raw[i][len(raw[i]) - keep:]) if keep > 0 else ""  # its last `keep` tokens
            n = length(text)
            if n <= limit or keep <= 0:
                break
            keep -= n - limit
        if n > limit:
            raise DataError(f"a {what} prompt cannot fit in {limit} tokens ({why}) even cut to nothing: the chat "
                            f"template alone has {overhead}")
        out[i] = dataclasses.replace(examples[i], prompt=text)
    warnings.warn(f"data.truncate_prompts=left: {len(too_long)} of {len(examples)} {what} prompts were cut from the "
                  f"left to {limit} tokens ({why})", stacklevel=2)
    return out


def _fit_images(examples: list[Example], render: Callable, image_prompts, *, limit: int, what: str,
                why: str) -> None:
    """`fit_prompts` for the prompts that hold images: rendered with them, each image's placeholder widened to its
    tokens (from the image's size: no pixels are processed), at most `limit` tokens."""
    lengths = [(e, image_prompts.length(render(e.conversation if e.conversation is not None else e.prompt, e.images),
                                        f"a {what} prompt ({e.prompt[:40]!r})"))
               for e in examples if e.images]
    too_long = [(e, n) for e, n in lengths if n > limit]
    if too_long:
        e, n = max(too_long, key=lambda t: t[1])
        sizes = ", ".join(f"{im.width}x{im.height}" for im in e.images[:3]) + (", ..." if len(e.images) > 3 else "")
        raise DataError(f"{len(too_long)} of {len(examples)} {what} prompts with images have more than {limit} "
                        f"tokens once their images are widened to their tokens ({why}); the longest has {n} with "
                        f"{len(e.images)} image{'s' * (len(e.images) != 1)} ({sizes}) and the text "
                        f"{e.prompt[:60]!r}. Give fewer or smaller images (smaller ones take fewer tokens in the "
                        "Qwen2-VL family: its image processor's max_pixels) or lower rollout.max_new_tokens (prompts "
                        "with images are not cut)")


def _fit_conversations(examples: list[Example], render: Callable, tokenizer, *, limit: int, what: str,
                       why: str) -> list[Example]:
    """`fit_prompts` for conversational prompts: each rendered through the chat template (which writes its own
    special tokens) must have at most `limit` tokens."""
    lengths = [len(tokenizer(render(e.conversation), add_special_tokens=False)["input_ids"]) for e in examples]
    too_long = [(i, n) for i, n in enumerate(lengths) if n > limit]
    if too_long:
        i, n = max(too_long, key=lambda t: t[1])
        raise DataError(f"{len(too_long)} of {len(examples)} {what} prompts (conversations) have more than {limit} "
                        f"tokens once rendered through the chat template ({why}); the longest has {n}, its last "
                        f"user message {examples[i].prompt[:60]!r}... Shorten them or lower rollout.max_new_tokens "
                        "(data.truncate_prompts cuts text prompts only)")
    return examples


def _warn_dropped(examples: list[Example], tokenizer, what: str) -> None:
    """Warn once about characters of the prompts that the tokenizer has no token for (and so drops): each
    distinct character is encoded and decoded once, not every prompt."""
    chars = set().union(*(e.prompt for e in examples)) - set(" \t\n")
    lost = {ch for ch in chars if ch not in tokenizer.decode(tokenizer(ch, add_special_tokens=False)["input_ids"])}
    if lost:
        counts = {ch: sum(ch in e.prompt for e in examples) for ch in lost}
        shown = ", ".join(repr(c) for c, _ in sorted(counts.items(), key=lambda t: (-t[1], t[0]))[:5])
        hit = [e.prompt for e in examples if any(ch in e.prompt for ch in lost)]
        warnings.warn(f"the tokenizer has no token for some characters of the {what} prompts, and drops them: "
                      f"{shown}{' and others' if len(counts) > 5 else ''}, in {len(hit)} of {len(examples)} "
                      f"prompts (e.g. {hit[0][:80]!r}); the model never sees them", stacklevel=3)
