"""The built-in task ``stories``: one-step word problems in plain English, for a real pretrained model.

``"Mia has 7 apples. She buys 5 more. How many apples does Mia have now? Answer with a number."`` → ``12``.

Each problem is a short story with two small numbers and one operation (adding, taking away, or equal
groups), in one of several phrasings. The space is enumerated completely (names × objects × stories ×
numbers) and split by a stable hash of the prompt, like the other built-in tasks, so the held-out prompts are
never trained on. The answer is never negative. Completions are scored by `grpo.rewards.last_number`.

SmolLM2-135M-Instruct solves about a third of them greedily through its chat template (docs/smollm2.md):
it half-knows the arithmetic and often states the answer and keeps talking; that is what GRPO sharpens.
"""
from __future__ import annotations

import itertools

from grpo.tasks.base import Example

NAMES = (("Mia", "She", "her"), ("Tom", "He", "his"), ("Ana", "She", "her"), ("Sam", "He", "his"),
         ("Lily", "She", "her"), ("Ben", "He", "his"))
THINGS = ("apples", "books", "coins", "pencils", "stickers", "cookies", "marbles", "cards")
INSTRUCTION = " Answer with a number."

# (kind, template): {n} name, {p} pronoun, {q} possessive, {t} things, {a}, {b} the numbers
STORIES = (
    ("add", "{n} has {a} {t}. {p} buys {b} more. How many {t} does {n} have now?"),
    ("add", "{n} had {a} {t}, and a friend gave {n} {b} more. How many {t} does {n} have now?"),
    ("add", "There are {a} {t} in a box. {n} puts {b} more {t} in the box. How many {t} are in the box now?"),
    ("sub", "{n} has {a} {t}. {p} gives {b} of them to a friend. How many {t} does {n} have left?"),
    ("sub", "{n} had {a} {t} and lost {b}. How many {t} does {n} have left?"),
    ("sub", "There are {a} {t} on the table. {n} takes {b} of them. How many {t} are still on the table?"),
    ("mul", "{n} has {a} bags with {b} {t} in each bag. How many {t} does {n} have in all?"),
    ("mul", "{n} buys {a} packs of {t}. Each pack holds {b} {t}. How many {t} does {n} buy?"),
)


def story_examples() -> list[Example]:
    """Every story problem: adding and taking away with 2–20 and 1–9, equal groups of 2–9 times 2–9."""
    out = []
    for (name, pron, poss), things, (kind, story) in itertools.product(NAMES, THINGS, STORIES):
        if kind == "mul":
            pairs = itertools.product(range(2, 10), range(2, 10))
        else:
            pairs = ((a, b) for a, b in itertools.product(range(2, 21), range(1, 10)) if kind == "add" or b < a)
        for a, b in pairs:
            answer = {"add": a + b, "sub": a - b, "mul": a * b}[kind]
            prompt = story.format(n=name, p=pron, q=poss, t=things, a=a, b=b) + INSTRUCTION
            out.append(Example(prompt, str(answer), {"task": "stories", "kind": kind, "a": a, "b": b}))
    return out
