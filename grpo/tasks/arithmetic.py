"""Built-in tasks for the bundled tiny model: arithmetic with operator precedence and linear evaluation.

Both enumerate a small, complete problem space and split it by a stable hash of the prompt, so the train
and held-out splits are disjoint and identical for every seed; the seed only orders the training stream.

- ``arithmetic``: ``"Calculate 2 + 2 * 6 ="`` → ``14``. Three single-digit operands, two operators from
  ``+ - *``, evaluated with the usual precedence (``*`` first, then left to right).
- ``linear``: ``"Solve y = 2x + 1 for x = 2, y ="`` → ``5``. ``y = a x ± b`` with single digits.
- ``mixed``: both, interleaved.
- ``products``: ``"Calculate 347 * 2918"`` → ``1012546``: products of two 3–4 digit numbers, too hard to work out
  in one's head (or in a 1 M-parameter model's), for the tool task (docs/tools.md): the bundled ``tiny-tools``
  model learns to call its calculator instead.

`worked_solution` writes the two-step working of a problem (" 2 * 6 = 12, 2 + 12 = 14"), in the right order or
in the wrong one (the grouping mistake " 2 + 2 = 4, 4 * 6 = 24"); the bundled model was warm-started on a mix
of both (docs/tiny-model.md). Completions are scored by `grpo.rewards.last_number`: the last number in the
completion must equal the answer.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from grpo.tasks.base import Example, in_held_out
from grpo.tasks.functions import function_examples
from grpo.tasks.stories import story_examples

HELD_OUT_FRACTION = 0.2
OPS = ("+", "-", "*")


def evaluate(a: int, op1: str, b: int, op2: str, c: int) -> int:
    """``a op1 b op2 c`` with ``*`` binding tighter than ``+``/``-``, and left to right otherwise."""
    apply = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
    if op2 == "*" and op1 != "*":
        return apply[op1](a, b * c)
    return apply[op2](apply[op1](a, b), c)


_APPLY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def worked_solution(example: Example, *, correct: bool = True) -> str:
    """The working of a built-in problem in two steps, ending with its value.

    `correct=False` groups the wrong pair first: for arithmetic the other pair of operands, for linear
    evaluation (x ± b) before multiplying by a. Example: "Calculate 2 + 2 * 6 =" → " 2 * 6 = 12, 2 + 12 = 14";
    with correct=False " 2 + 2 = 4, 4 * 6 = 24".
    """
    f = example.fields
    if f["task"] == "arithmetic":
        (a, b, c), (op1, op2) = f["operands"], f["ops"]
        right_first = op2 == "*" and op1 != "*"  # precedence puts b op2 c first
        if right_first == correct:
            t = _APPLY[op2](b, c)
            return f" {b} {op2} {c} = {t}, {a} {op1} {t} = {_APPLY[op1](a, t)}"
        t = _APPLY[op1](a, b)
        return f" {a} {op1} {b} = {t}, {t} {op2} {c} = {_APPLY[op2](t, c)}"
    a, b, x, sign = f["a"], f["b"], f["x"], f["sign"]
    if correct:
        t = a * x
        return f" {a} * {x} = {t}, {t} {sign} {b} = {_APPLY[sign](t, b)}"
    t = _APPLY[sign](x, b)
    return f" {x} {sign} {b} = {t}, {a} * {t} = {a * t}"


def arithmetic_examples() -> list[Example]:
    out = []
    for a, b, c in itertools.product(range(10), repeat=3):
        for op1, op2 in itertools.product(OPS, repeat=2):
            prompt = f"Calculate {a} {op1} {b} {op2} {c} ="
            fields = {"task": "arithmetic", "operands": [a, b, c], "ops": [op1, op2]}
            out.append(Example(prompt, str(evaluate(a, op1, b, op2, c)), fields))
    return out


def linear_examples() -> list[Example]:
    out = []
    for a, b, x in itertools.product(range(1, 10), range(10), range(10)):
        for sign in "+-":
            prompt = f"Solve y = {a}x {sign} {b} for x = {x}, y ="
            y = a * x + b if sign == "+" else a * x - b
            out.append(Example(prompt, str(y), {"task": "linear", "a": a, "b": b, "sign": sign, "x": x}))
    return out


def product_examples(count: int = 25_000) -> list[Example]:
    """`count` distinct products a * b of 3–4 digit numbers, drawn with a fixed seed (the space is too large
    to enumerate)."""
    rng = random.Random(20261201)
    seen, out = set(), []
    while len(out) < count:
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append(Example(f"Calculate {a} * {b}", str(a * b), {"task": "products", "a": a, "b": b}))
    return out


@dataclass
class BuiltinTask:
    """A built-in task: the full problem list split into train and held-out by prompt hash."""

    name: str
    train: list[Example]
    eval: list[Example]


def _split(examples: list[Example]) -> tuple[list[Example], list[Example]]:
    train = [e for e in examples if not in_held_out(e.prompt, HELD_OUT_FRACTION)]
    held = [e for e in examples if in_held_out(e.prompt, HELD_OUT_FRACTION)]
    return train, held


BUILTIN_TASKS = ("arithmetic", "linear", "mixed", "products", "stories", "functions", "shapes")


def load_builtin_task(name: str, seed: int = 0) -> BuiltinTask:
    """Build a built-in task. The held-out split never depends on `seed`; the train order does, and the
    held-out order is fixed (seed 0) so evaluations compare like with like across runs."""
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {name!r}; choose one of {', '.join(BUILTIN_TASKS)}")
    if name == "shapes":  # pictures: split by the scene, not the prompt text (grpo.tasks.shapes)
        from grpo.tasks.shapes import shape_examples
        train_all, held_all = shape_examples()
        random.Random(seed).shuffle(train_all)
        return BuiltinTask(name, train_all, held_all)
    parts = {"arithmetic": [arithmetic_examples], "linear": [linear_examples],
             "mixed": [arithmetic_examples, linear_examples], "products": [product_examples],
             "stories": [story_examples], "functions": [function_examples]}[name]
    parts = [make() for make in parts]
    train, held = [], []
    for examples in parts:
        t, h = _split(examples)
        train.append(t)
        held.append(h)
    if name == "mixed":
        # Balance the two families in the held-out set: the linear space is smaller, so sample the
        # arithmetic held-out down to the same size for evaluation.
        arith_h = random.Random(0).sample(held[0], k=len(held[1]))
        held = [arith_h, held[1]]
    train_all = [e for part in train for e in part]
    held_all = [e for part in held for e in part]
    random.Random(seed).shuffle(train_all)
    random.Random(0).shuffle(held_all)
    return BuiltinTask(name, train_all, held_all)
