"""The examples' side of the reward call convention (`grpo.rewards`): every field of the examples (`answer`, when
the examples have one, and every other column under its own name) as a keyword argument holding one value per
completion; and, for conversational prompts, the conversations (under `CONVERSATIONS`, which `grpo.rewards.score`
takes out: they become the `prompts` of the functions that take TRL's conversational form)."""
from __future__ import annotations

from collections.abc import Sequence

from grpo.tasks.base import Example

CONVERSATIONS = "_grpo_conversations"  # not a keyword any reward sees: `reward_inputs` turns it into `prompts`


def example_fields(examples: Sequence[Example], repeat: int = 1) -> dict[str, list]:
    """Reward keyword arguments: `answer` (when any example has one) and every extra field, one value per
    completion; the conversations under CONVERSATIONS when the prompts are conversational."""
    keys = (["answer"] if any(e.answer is not None for e in examples) else []) \
        + sorted({k for e in examples for k in e.fields})
    out: dict[str, list] = {k: [] for k in keys}
    for e in examples:
        for k in keys:
            value = e.answer if k == "answer" else e.fields.get(k)
            out[k].extend([value] * repeat)
    if examples and examples[0].conversation is not None:
        out[CONVERSATIONS] = [e.conversation for e in examples for _ in range(repeat)]
    return out


def field_names(examples: Sequence[Example]) -> set[str]:
    """The names of the keyword arguments the examples give the rewards (`example_fields`'s, less CONVERSATIONS)."""
    return set(example_fields(examples)) - {CONVERSATIONS}
