"""Row-aligned batches: the one `map`, `select` and `concat` behind every batch type of the loop.

A batch type (`grpo.rollout.Rollout` from a generator, the scored rows of `grpo.collect`, `grpo.experience.Experience`
for the update) is a dataclass deriving from `Rows` whose fields say, through `column(...)`, what they are along
its N rows:
- `padded`: (N, W) tensors; joined parts are padded to the widest, on the right (completions) or on the left
  (prompts), with a fill value or the pad id the join is given (`PAD`);
- `rows`: tensors whose first dimension is the rows (rewards, flags, versions);
- `items`: lists with one item per row (texts, episodes);
- `by_name`: dicts of `rows` tensors (each reward function's values);
- `nested`: another `Rows` with the same rows (the rollout inside the scored rows);
- `group` and `groups`: a (N,) long tensor of indices into a list of per-group items (the examples): selecting
  keeps the groups the rows use, in order of first use; joining offsets the indices;
- `whole`: a figure of the whole batch, not per row: kept by `select`, taken from the first part by `concat`.
Any field may be None: it stays None, and a joined field is None unless every part has it.

One implementation means one set of rules for moving rows: between devices (`map`), between processes (the
chosen groups of dynamic sampling), into micro-batches or a replay queue later.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import field, fields
from typing import Any, TypeVar

import torch

PAD = object()  # a `padded` column's fill: the pad id given to `concat`
KINDS = ("padded", "rows", "items", "by_name", "nested", "group", "groups", "whole")

R = TypeVar("R", bound="Rows")


def column(kind: str, *, fill: Any = 0, left: bool = False, **kw):
    """A dataclass field of a `Rows` type (`kw`: `field`'s, e.g. default=None)."""
    if kind not in KINDS:
        raise ValueError(f"column kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return field(metadata={"rows": (kind, fill, left)}, **kw)


class Rows:
    """Base of the batch types: `len`, `map`, `select` and `concat` from the fields' `column` declarations."""

    def __len__(self) -> int:
        for f in fields(self):
            kind, value = _kind(f), getattr(self, f.name)
            if value is not None and kind in ("padded", "rows", "items", "nested", "group"):
                return len(value)
        raise TypeError(f"{type(self).__name__} has no row column to count")

    def map(self: R, fn: Callable[[torch.Tensor], torch.Tensor]) -> R:
        """The same rows with `fn` applied to each tensor (None stays None; lists are shared, not copied)."""
        def one(kind, x):
            if x is None or kind in ("items", "groups"):
                return x
            if kind == "by_name":
                return {k: fn(v) for k, v in x.items()}
            if kind == "nested":
                return x.map(fn)
            return fn(x) if isinstance(x, torch.Tensor) else x  # a `whole` figure may be a dict of floats
        return type(self)(**{f.name: one(_kind(f), getattr(self, f.name)) for f in fields(self)})

    def to(self: R, device) -> R:
        """The same rows with their tensors on `device`."""
        return self.map(lambda x: x.to(device))

    def select(self: R, rows: Sequence[int]) -> R:
        """These rows, in this order."""
        rows = list(rows)
        index = {}  # per device, made once

        def pick(t: torch.Tensor) -> torch.Tensor:
            if t.device not in index:
                index[t.device] = torch.as_tensor(rows, dtype=torch.long, device=t.device)
            return t.index_select(0, index[t.device])

        out = {}
        groups = None  # (the group column's name, old group -> new) once the group column is seen
        for f in fields(self):
            kind, x = _kind(f), getattr(self, f.name)
            if x is None or kind == "whole":
                out[f.name] = x
            elif kind in ("padded", "rows"):
                out[f.name] = pick(x)
            elif kind == "items":
                out[f.name] = [x[i] for i in rows]
            elif kind == "by_name":
                out[f.name] = {k: pick(v) for k, v in x.items()}
            elif kind == "nested":
                out[f.name] = x.select(rows)
            elif kind == "group":
                old = x.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=x.device)).tolist()
                renumber = {g: i for i, g in enumerate(dict.fromkeys(old))}
                groups = renumber
                out[f.name] = torch.tensor([renumber[g] for g in old], dtype=x.dtype, device=x.device)
        for f in fields(self):
            if _kind(f) == "groups" and getattr(self, f.name) is not None:
                if groups is None:
                    raise TypeError(f"{type(self).__name__}.{f.name} has no group column")
                out[f.name] = [getattr(self, f.name)[g] for g in groups]
        return type(self)(**out)

    @classmethod
    def concat(cls: type[R], parts: Sequence[R], pad_id: int = 0) -> R:
        """The rows of `parts` one after another (one part: itself). `padded` columns are padded to the widest
        part, prompts on the left and completions on the right; `PAD` columns with `pad_id`."""
        if not parts:
            raise ValueError(f"cannot join no {cls.__name__} parts")
        if len(parts) == 1:
            return parts[0]
        out = {}
        for f in fields(cls):
            kind, fill, left = f.metadata["rows"]
            values = [getattr(p, f.name) for p in parts]
            if kind == "whole":
                out[f.name] = values[0]
            elif any(v is None for v in values):
                out[f.name] = None
            elif kind == "padded":
                out[f.name] = _pad_cat(values, pad_id if fill is PAD else fill, left)
            elif kind == "rows":
                out[f.name] = torch.cat(values)
            elif kind in ("items", "groups"):
                out[f.name] = [item for v in values for item in v]
            elif kind == "by_name":
                out[f.name] = {k: torch.cat([v[k] for v in values]) for k in values[0]}
            elif kind == "nested":
                out[f.name] = type(values[0]).concat(values, pad_id)
            elif kind == "group":
                groups = next(g.name for g in fields(cls) if _kind(g) == "groups")
                offsets = [0]
                for p in parts[:-1]:
                    offsets.append(offsets[-1] + len(getattr(p, groups)))
                out[f.name] = torch.cat([v + k for v, k in zip(values, offsets)])
        return cls(**out)


def _kind(f) -> str:
    return f.metadata["rows"][0]


def _pad_cat(tensors: list[torch.Tensor], value, left: bool) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        fill = t.new_full((t.shape[0], width - t.shape[1]), value)
        padded.append(torch.cat([fill, t] if left else [t, fill], dim=1))
    return torch.cat(padded)
