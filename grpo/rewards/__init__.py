"""Reward functions: plain callables `(prompts, completions, **example_fields) -> list[float | None]`.

This is TRL's convention: `prompts` and `completions` are lists of strings of equal length, and every field
of the examples (`answer` and any extra column) arrives as a keyword argument holding one value per
completion. `None` means "does not apply to this completion": it is left out of the group statistics.
Built-ins are named in `REWARDS`; any importable `module:function` works too.
"""
from __future__ import annotations

import importlib
import math as _math  # grpo.rewards.math_answers (a submodule) would shadow a plain "math"
import re
from collections.abc import Callable, Sequence

import torch

from grpo.errors import ConfigError, DataError

RewardFn = Callable[..., list]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> str | None:
    """The first (signed, optionally decimal) number in `text`, or None."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def exact_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_) -> list[float]:
    """1.0 when the first number in the completion equals the answer as a number, else 0.0.

    Example: completion " 14" with answer "14" → 1.0; " 14.0" → 1.0; " 1 4" → 0.0; "" → 0.0.
    """
    out = []
    for completion, ans in zip(completions, answer, strict=True):
        got = first_number(completion)
        out.append(1.0 if got is not None and _same_number(got, str(ans)) else 0.0)
    return out


def last_number(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_) -> list[float]:
    """1.0 when the last number in the completion equals the answer, else 0.0: for completions that work the
    answer out before stating it.

    Example: " 2 * 6 = 12, 2 + 12 = 14" with answer "14" → 1.0; " 2 + 2 = 4, 4 * 6 = 24" → 0.0.
    """
    out = []
    for completion, ans in zip(completions, answer, strict=True):
        found = _NUMBER.findall(completion)
        out.append(1.0 if found and _same_number(found[-1], str(ans)) else 0.0)
    return out


def _same_number(a: str, b: str) -> bool:
    try:
        return _math.isclose(float(a), float(b.strip().replace(",", "")), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return a == b.strip()


def math(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **fields) -> list[float]:
    """1.0 when the completion's final answer (boxed, <answer>, #### or last number) is mathematically equal to
    the reference (GSM8K "#### 72", MATH \\boxed{}, or plain), checked with math-verify. See
    `grpo.rewards.math_answers.math_reward`."""
    from grpo.rewards.math_answers import math_reward
    return math_reward(prompts, completions, answer, **fields)


def format(prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float]:  # noqa: A001
    """1.0 for a <think>…</think><answer>…</answer> completion (DeepSeek-R1 style), else 0.0. See
    `grpo.rewards.math_answers.format_reward`."""
    from grpo.rewards.math_answers import format_reward
    return format_reward(prompts, completions, **fields)


def overlong(prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float]:
    """DAPO's soft overlong punishment, in characters (4096 max, 1024 buffer). In a config, `overlong` counts
    tokens instead, against rollout.max_new_tokens and overlong_buffer (see `build_rewards`)."""
    from grpo.rewards.math_answers import overlong as by_chars
    return by_chars(prompts, completions, **fields)


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "last_number": last_number, "math": math,
                                 "format": format, "overlong": overlong}


def build_rewards(names: Sequence[str], *, tokenizer=None, max_new_tokens: int | None = None,
                  overlong_buffer: int = 0) -> list[tuple[str, RewardFn]]:
    """The config's reward functions as (name, function) pairs. `overlong` measures completions in the
    tokenizer's tokens against `max_new_tokens`, ramping over the last `overlong_buffer` tokens (a quarter of
    max_new_tokens when 0)."""
    out = []
    for name in names:
        fn = resolve_reward(name)
        if name == "overlong" and tokenizer is not None and max_new_tokens:
            from grpo.rewards.math_answers import make_overlong_penalty
            buffer = overlong_buffer or max(1, max_new_tokens // 4)
            if buffer > max_new_tokens:
                raise ConfigError(f"overlong_buffer={buffer} is larger than rollout.max_new_tokens={max_new_tokens}")

            def tokens(text: str) -> int:
                return len(tokenizer(text, add_special_tokens=False)["input_ids"])

            fn = make_overlong_penalty(max_new_tokens, buffer, length_fn=tokens)
        out.append((name, fn))
    return out


def resolve_reward(name: str, *, field: str = "rewards") -> RewardFn:
    """A built-in reward by name, or `module:function` imported; errors name the config field."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ConfigError(f"{field}: unknown reward {name!r}; built-in rewards are {', '.join(REWARDS)}, "
                          "or give an importable 'module:function'")
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{field}: cannot import reward {name!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{field}: {name!r} is not callable")
    return fn


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _culprit(fn: RewardFn, prompts, completions, fields) -> int | None:
    """The first completion on which `fn` raises when called on it alone, if any."""
    for i in range(len(completions)):
        try:
            fn(prompts=[prompts[i]], completions=[completions[i]], **{k: [v[i]] for k, v in fields.items()})
        except Exception:
            return i
    return None


def score(fns: Sequence[RewardFn | tuple[str, RewardFn]], weights: Sequence[float] | None, prompts: Sequence[str],
          completions: Sequence[str], fields: dict[str, list]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run every reward function; return the weighted total (N,) and each function's rewards (N,), keyed by
    the name given in a (name, function) pair or else the function's __name__.

    None becomes NaN. A completion that no function scores gets a NaN total (advantage 0); otherwise the
    total sums the functions that apply (NaN-aware, as TRL does).
    """
    named = [f if isinstance(f, tuple) else (reward_name(f), f) for f in fns]
    weights = [1.0] * len(named) if weights is None else list(weights)
    n = len(completions)
    per_fn = {}
    for name, fn in named:
        try:
            values = fn(prompts=list(prompts), completions=list(completions), **fields)
        except Exception as e:  # a user's function: say which one, and on which example
            i = _culprit(fn, prompts, completions, fields)
            where = (f"on prompt {prompts[i]!r} with completion {completions[i]!r}" if i is not None
                     else f"on a batch starting with prompt {prompts[0]!r}")
            raise DataError(f"reward function {name!r} raised {type(e).__name__}: {e} {where}") from e
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise DataError(f"reward function {name!r} returned {got} values for {n} completions; it must "
                            "return one float (or None) per completion")
        try:
            per_fn[name] = torch.tensor([float("nan") if v is None else float(v) for v in values],
                                        dtype=torch.float32)
        except (TypeError, ValueError):
            bad = next(v for v in values if v is not None and not isinstance(v, (int, float)))
            raise DataError(f"reward function {name!r} returned {bad!r}; rewards must be floats or None") from None
    stacked = torch.stack([per_fn[name] * w for (name, _), w in zip(named, weights, strict=True)])  # (F, N)
    total = torch.nansum(stacked, dim=0)
    total[torch.isnan(stacked).all(dim=0)] = float("nan")
    return total, per_fn
