"""Argument checks shared by the `grpo.algo` functions: every error names the argument at fault."""
from __future__ import annotations

from collections.abc import Iterable

import torch


class RewardRangeError(ValueError):
    """Rewards outside the range an advantage needs (MaxRL's [0, 1]): the reward functions' output, which the
    trainer reports as one line (`grpo.collect`)."""


def check_choice(name: str, value: str, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")


def check_tensor(name: str, x: object, ndim: int | tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in dims:
        want = " or ".join(str(d) for d in dims)
        raise ValueError(f"{name} must have {want} dimension(s), got shape {tuple(x.shape)}")
    return x


def check_same_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                         "they must match exactly (no broadcasting)")


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
