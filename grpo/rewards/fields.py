"""The examples' side of the reward call convention (`grpo.rewards`): every field of the examples (`answer`
and any extra column) as a keyword argument holding one value per completion."""
from __future__ import annotations

from collections.abc import Sequence

from grpo.tasks.base import Example


def example_fields(examples: Sequence[Example], repeat: int = 1) -> dict[str, list]:
    """Reward keyword arguments: `answer` and every extra field, one value per completion."""
    keys = ["answer"] + sorted({k for e in examples for k in e.fields})
    out: dict[str, list] = {k: [] for k in keys}
    for e in examples:
        for k in keys:
            value = e.answer if k == "answer" else e.fields.get(k)
            out[k].extend([value] * repeat)
    return out
