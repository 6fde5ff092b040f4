"""Process rewards for the built-in tasks: one reward per worked step instead of one per completion.

This is process supervision (SPEC 1.3, after DeepSeekMath §4.1.3): a reward function may return, per
completion, a list of steps `(end, reward)` instead of a float, where `end` is the exclusive character offset
of the step's end in the completion text (`text[end - 1]` is the step's last character); the trainer maps it to
a token. `arithmetic_steps` is the built-in one: it checks each equation of the completion's working against the
correct working of the problem (`grpo.tasks.arithmetic.worked_solution`), so the grouping mistake
" 2 + 2 = 4, 4 * 6 = 24" is penalised at the step where it is made, although each equation in it is true.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from grpo.tasks.arithmetic import OPS, worked_solution
from grpo.tasks.base import Example

Step = tuple[int, float]

# One worked step "x op y = z" with integers. The lookbehind stops a match from starting inside a number
# ("12.5 + 1 = 13" must not yield "5 + 1 = 13") or on the binary minus of "3-5 * 2 = 10" (which would read
# "-5 * 2 = 10" as a step with a negative operand); the lookahead rejects a decimal or truncated result.
_STEP = re.compile(r"(?<![\d.])(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*(-?\d+)(?!\.?\d)")

# The fields worked_solution reads, per built-in task: a row lacking any of them is not a built-in problem.
_FIELDS = {"arithmetic": ("operands", "ops"), "linear": ("a", "b", "x", "sign")}


def parse_steps(text: str) -> list[tuple[tuple[int, str, int, int], int]]:
    """The equations `x op y = z` found in `text`, left to right and not overlapping, as
    `((x, op, y, z), end)` with `end` the exclusive offset just after `z`.

    Example: " 2 * 6 = 12, 2 + 12 = 14" → [((2, "*", 6, 12), 11), ((2, "+", 12, 14), 24)].
    """
    return [((int(m[1]), m[2], int(m[3]), int(m[4])), m.end(4)) for m in _STEP.finditer(text)]


def _reference(task: Any, row: dict[str, Any]) -> list[tuple[int, str, int, int]] | None:
    """The steps of the correct working of a built-in problem, or None when the row is not one."""
    names = _FIELDS.get(task) if isinstance(task, str) else None
    if names is None or any(row.get(k) is None for k in names):
        return None
    if task == "arithmetic":
        operands, ops = row["operands"], row["ops"]
        # Malformed fields mean this is not one of our problems: "does not apply" rather than a crash
        # inside worked_solution on someone else's data set that happens to use the same column names.
        if len(operands) != 3 or len(ops) != 2 or any(op not in OPS for op in ops):
            return None
    elif row["sign"] not in ("+", "-"):
        return None
    # Reuse worked_solution rather than re-deriving the order of operations here, so the reference can never
    # drift from the working the tiny model was warm-started on; its text goes through the same parser.
    text = worked_solution(Example("", "", {"task": task, **{k: row[k] for k in names}}), correct=True)
    return [eq for eq, _ in parse_steps(text)]


def arithmetic_steps(prompts: Sequence[str], completions: Sequence[str], task: Sequence[Any] | None = None,
                     **fields: Sequence[Any]) -> list[list[Step] | None]:
    """Per-step rewards for the built-in `arithmetic` and `linear` tasks: a list of `(end, reward)` per
    completion, or None where the row is not a built-in problem.

    Rules:

    - The completion's steps are the equations `x op y = z` (integers, possibly negative, `op` one of
      `+ - *`, spaces optional) found anywhere in the text, left to right and not overlapping; they are
      normally separated by ", ". Each step gives one `(end, reward)`, `end` being the exclusive character
      offset just after `z`, so `text[:end]` ends with the step's result.
    - The reference is the correct working, the steps of `worked_solution(example, correct=True)`. Step j of the
      completion scores 1.0 when it equals step j of the reference (same operands in the same order, operator
      and result, compared as numbers: "-03" is -3, but "6 * 2" is not "2 * 6"), else 0.0; steps beyond the
      reference's count score 0.0. A true equation in the wrong order scores 0.0: the order of the working is
      what is being taught.
    - A completion with no step scores `[(len(text), 0.0)]`: nothing worked out is one wrong step ending at the
      end of the text (end 0 for an empty text).
    - A row whose `task` is neither "arithmetic" nor "linear", or which lacks that task's fields (`operands`
      and `ops`; `a`, `b`, `x` and `sign`), gets None: the function does not apply to it. Calling it without a
      `task` field at all gives None for every row. Other fields (`answer`, …) are accepted and ignored.

    Example: for "Calculate 2 + 2 * 6 =" (operands [2, 2, 6], ops ["+", "*"]) the reference is
    " 2 * 6 = 12, 2 + 12 = 14". The completion " 2 * 6 = 12, 2 + 12 = 14" scores [(11, 1.0), (24, 1.0)]
    (text[:11] is " 2 * 6 = 12"); the grouping mistake " 2 + 2 = 4, 4 * 6 = 24" scores [(10, 0.0), (22, 0.0)];
    " 2 * 6 = 12, 2 + 12 = 15" scores [(11, 1.0), (24, 0.0)]; " 14" scores [(3, 0.0)].
    """
    n = len(completions)
    tasks = [None] * n if task is None else list(task)
    out: list[list[Step] | None] = []
    for i, text in enumerate(completions):
        ref = _reference(tasks[i], {k: v[i] for k, v in fields.items()})
        if ref is None:
            out.append(None)
            continue
        found = parse_steps(text)
        if not found:
            out.append([(len(text), 0.0)])
            continue
        out.append([(end, 1.0 if j < len(ref) and eq == ref[j] else 0.0) for j, (eq, end) in enumerate(found)])
    return out
