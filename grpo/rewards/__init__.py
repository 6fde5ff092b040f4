"""Reward functions: plain callables `(prompts, completions, **example_fields) -> list`.

This is TRL's convention: `prompts` and `completions` are lists of strings of equal length, and every field
of the examples (every column of the data but the prompt's, under its own name, and the answer column also as
`answer`) arrives as a keyword argument holding one value per completion. With conversational prompts (lists of
messages) a function of your own gets them as TRL gives them: `prompts` the message lists and `completions`
`[{"role": "assistant", "content": text}]` each; grpo's own rewards (the built-ins, `rm:`, `judge`) always get
the text (`reward_inputs`). A function returns one value per completion:
- a float: an outcome reward for the whole completion;
- a list of steps `(end, reward)`: a process reward (DeepSeekMath §4.1.3), one reward per reasoning step, `end`
  being the character offset in the completion text just after the step (`text[:end]` ends with it);
- `None`: "does not apply to this completion"; it is left out of the group statistics.
One function returns floats or step lists, not both. A function may be `async def` (TRL's convention): it is
called the same way and awaited, all of a batch's asynchronous functions concurrently (`grpo.rewards.calls`).
Built-ins are named in `REWARDS`; any importable `module:function` works too, `rm:<path>` a reward model
(`grpo.rewards.model`) and `judge` an LLM judge (`grpo.rewards.judge`). `score` runs them; `grpo.collect` turns
the scores into advantages.
"""
from __future__ import annotations

import functools
import inspect
import math as _math  # grpo.rewards.math_answers (a submodule) would shadow a plain "math"
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from grpo.errors import ConfigError, DataError, GRPOError
from grpo.imports import import_callable
from grpo.rewards.calls import call, call_all
from grpo.rewards.fields import CONVERSATIONS, example_fields, field_names
from grpo.rewards.judge import NAME as JUDGE
from grpo.rewards.judge import Judge
from grpo.rewards.model import PREFIX as RM_PREFIX
from grpo.rewards.model import RewardModel

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


def final_number(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                 messages: Sequence[list[dict]] | None = None, **_) -> list[float]:
    """For multi-turn episodes (`rollout.environment=tools`): 1.0 when the last number of the episode's final
    message, the model's answer, equals the answer; 0.0 when the episode ends on anything else (a tool result,
    a cut-off call). Numbers in the calls and tool results do not count. Without `messages` (single turns) it
    is `last_number`.

    Example: messages [user, assistant '[calculator(expression="12 * 34")]', tool '408', assistant '408'] with
    answer "408" → 1.0; the same ending with the tool message → 0.0.
    """
    if messages is None:
        return last_number(prompts, completions, answer)
    finals = [m[-1]["content"] if m and m[-1].get("role") == "assistant" and "tool_calls" not in m[-1] else ""
              for m in messages]
    return last_number(prompts, finals, answer)


def code(prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float | None]:
    """The fraction of a row's `tests` (Python statements such as asserts) that the completion's code passes,
    run in the sandbox; None for a row without tests. See `grpo.rewards.code.code`."""
    from grpo.rewards.code import code as run
    return run(prompts, completions, **fields)


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


def arithmetic_steps(prompts: Sequence[str], completions: Sequence[str], **fields) -> list:
    """A process reward for the built-in tasks: each worked step ` a op b = c` scores 1.0 when it is the
    corresponding step of the correct working, else 0.0. See `grpo.rewards.steps.arithmetic_steps`."""
    from grpo.rewards.steps import arithmetic_steps as steps
    return steps(prompts, completions, **fields)


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "last_number": last_number, "math": math,
                                 "format": format, "overlong": overlong, "arithmetic_steps": arithmetic_steps,
                                 "final_number": final_number, "code": code}


def build_rewards(names: Sequence[str], *, tokenizer=None, max_new_tokens: int | None = None,
                  overlong_buffer: int = 0, sandbox_limits=None, reward_model=None, device: str = "cpu",
                  judge=None, run_dir=None, vllm_cfg=None, seed: int = 0) -> list[tuple[str, RewardFn]]:
    """The config's reward functions as (name, function) pairs. `overlong` counts the tokens each completion
    generated (EOS included) against `max_new_tokens`, ramping over the last `overlong_buffer` tokens (a quarter
    of max_new_tokens when 0). `code` runs under `sandbox_limits` (`grpo.sandbox.Limits`; None: the defaults).
    A reward model (`rm:<path>`) is loaded now, as `reward_model` (the config's `reward_model` section; None: its
    defaults) says, on its device or else `device` (the policy's). The `judge` is set up by `judge` (the config's
    `judge` section), a launched server's log going to `run_dir`, `vllm_cfg` sizing it."""
    out = []
    for name in names:
        fn = resolve_reward(name, sandbox_limits=sandbox_limits, reward_model=reward_model, device=device,
                            judge=judge, run_dir=run_dir, vllm_cfg=vllm_cfg, seed=seed)
        if isinstance(fn, RewardModel):
            fn.load()
            name = fn.__name__  # logged as reward/<its directory's name>
        if name == "overlong" and tokenizer is not None and max_new_tokens:
            from grpo.rewards.math_answers import make_overlong_penalty
            buffer = overlong_buffer or max(1, max_new_tokens // 4)  # at most max_new_tokens (grpo.validate)

            def tokens(text: str) -> int:
                return len(tokenizer(text, add_special_tokens=False)["input_ids"])

            fn = make_overlong_penalty(max_new_tokens, buffer, length_fn=tokens, generated_tokens=True)
        out.append((name, fn))
    return out


def resolve_reward(name: str, *, field: str = "rewards", sandbox_limits=None, reward_model=None,
                   device: str = "cpu", judge=None, run_dir=None, vllm_cfg=None, seed: int = 0) -> RewardFn:
    """A built-in reward by name, `module:function` imported, `rm:<path>` a reward model (not yet loaded:
    `RewardModel.load`), or `judge` an LLM judge (`grpo.rewards.judge`, set up by `judge`: the config's section;
    None: its defaults); errors name the config field. `code` runs its executions under `sandbox_limits`
    (`grpo.sandbox.Limits`, e.g. from the config's `sandbox.*`; None: the defaults)."""
    if name == JUDGE:
        if field == "eval.reward":
            raise ConfigError(f"{field}: the judge's score is no verdict of 1 for a correct completion; decide "
                              "correctness with a reward that gives one (last_number, math, ...)")
        from grpo.config import JudgeConfig
        return Judge(judge or JudgeConfig(), run_dir=run_dir, vllm_cfg=vllm_cfg, seed=seed)
    if name.startswith(RM_PREFIX):
        if field == "eval.reward":
            raise ConfigError(f"{field}: {name!r} is a reward model, whose score is no verdict of 1 for a correct "
                              "completion; decide correctness with a reward that gives one (last_number, math, ...)")
        return RewardModel(name[len(RM_PREFIX):], reward_model, device=device, field=field)
    if name == "code" and sandbox_limits is not None:
        from grpo.rewards.code import make_code_reward
        return make_code_reward(sandbox_limits)
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        python = (", or the name of a Python reward function given to grpo.train(rewards=[...])"
                  if field.startswith("eval.") else "")
        raise ConfigError(f"{field}: unknown reward {name!r}; built-in rewards are {', '.join(REWARDS)}, "
                          f"or give an importable 'module:function', a reward model as 'rm:<path>', or 'judge'{python}")
    return import_callable(name, field=field, what="reward")


def take_figures(fns) -> dict[str, float]:
    """What the reward functions `fns` kept of their calls since last asked (`take_figures()`: a judge's failures,
    requests and seconds), summed over the functions, and forgotten by them; {} when none keeps any."""
    out: dict[str, float] = {}
    for fn in fns:
        for k, v in (fn.take_figures() if hasattr(fn, "take_figures") else {}).items():
            out[k] = out.get(k, 0.0) + v
    return out


def close_rewards(fns) -> None:
    """Stop what reward functions hold (`close()`: a judge's launched server), each object once."""
    for fn in {id(f): f for f in fns}.values():
        if hasattr(fn, "close"):
            fn.close()


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def recorded_name(fn: RewardFn) -> str:
    """How a reward function given from Python is named in its run's config (`rewards`): 'module:qualname', which
    `rewards` imports again when the function is defined at the top level of an importable module."""
    if isinstance(fn, RewardModel):  # named in a config as it was given
        return fn.spec
    if isinstance(fn, Judge):
        return JUDGE
    named = fn if hasattr(fn, "__qualname__") else type(fn)  # a callable object: its class
    return f"{getattr(named, '__module__', None) or type(fn).__module__}:{named.__qualname__}"


def is_own(fn: RewardFn) -> bool:
    """Whether `fn` is one of grpo's rewards (a built-in, a reward model, the judge, the code sandbox's), which
    always take text prompts and completions, whatever the form of the data."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return (getattr(fn, "__module__", None) or "").startswith("grpo.")


def reward_inputs(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], fields: dict[str, list]) -> dict:
    """The keyword arguments of `fn` for a batch: `prompts`, `completions` and the examples' `fields`
    (`example_fields`). When the fields carry conversations (conversational prompts), a function of the user's gets
    TRL's conversational form: `prompts` the message lists and each completion as `[{"role": "assistant",
    "content": text}]`; grpo's own rewards (`is_own`) get the text."""
    fields = dict(fields)
    chats = fields.pop(CONVERSATIONS, None)
    if chats is None or is_own(fn):
        return {"prompts": list(prompts), "completions": list(completions), **fields}
    return {"prompts": [list(c) for c in chats], "completions": [[{"role": "assistant", "content": c}] for c in
                                                                  completions], **fields}


def missing_fields(fn: RewardFn, kwargs: dict) -> list[str]:
    """The parameters `fn` requires (no default) that `kwargs` lacks: the fields it needs and the examples lack."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in kwargs]


def needs_fields_error(name: str, missing: list[str], kwargs: dict, *, field: str = "") -> DataError:
    """The one line for a reward function that needs fields the examples lack."""
    have = ", ".join(k for k in kwargs if k not in ("prompts", "completions")) or "none"
    why = (" (the data has no answer column: data.answer_column names it; every other column reaches the rewards "
           "under its own name)" if "answer" in missing else " (every column of the data reaches the rewards under "
           "its own name)")
    where, fix = (f"{field} ", f"; set {field} to a reward these examples can feed (from Python, the name of one of "
                               "the functions given to grpo.train(rewards=[...]))") if field else ("", "")
    return DataError(f"{where}reward function {name!r} needs {', '.join(map(repr, missing))}, which the examples "
                     f"lack{why}; the examples' fields are: {have}{fix}")


def _culprit(fn: RewardFn, prompts, completions, fields) -> int | None:
    """The first completion on which `fn` raises when called on it alone, if any."""
    for i in range(len(completions)):
        try:
            call(fn, **reward_inputs(fn, [prompts[i]], [completions[i]], {k: [v[i]] for k, v in fields.items()}))
        except Exception:
            return i
    return None


Step = tuple[int, float]  # (end: character offset just after the step, reward)


@dataclass
class Scores:
    """What the reward functions said of N completions. Every field is there whatever the functions returned,
    so that processes whose shares happen to get no step (or no outcome) reward still do the same work."""

    total: torch.Tensor                 # (N,) weighted sum over the functions that apply (NaN if none does)
    per_fn: dict[str, torch.Tensor]     # name -> (N,) unweighted; a process function's value is its step mean
    outcome: torch.Tensor               # (N,) weighted sum of the outcome (float) values (NaN where none applies)
    steps: list[list[Step]]             # per completion, the weighted steps of every process function, in order
                                        # of `end` (empty where none applies)


def score(fns: Sequence[RewardFn | tuple[str, RewardFn]], weights: Sequence[float] | None, prompts: Sequence[str],
          completions: Sequence[str], fields: dict[str, list]) -> Scores:
    """Run every reward function on the N completions, each function once, keyed by the name given in a
    (name, function) pair or else the function's __name__ (a repeated name gets a suffix: `f`, `f_2`).

    None becomes NaN. A completion that no function scores gets a NaN total (advantage 0); otherwise the
    total sums the functions that apply (NaN-aware, as TRL does). Float values and step lists are kept apart
    (`Scores.outcome`, `Scores.steps`): their advantages are normalised separately (`grpo.collect`).
    """
    named = [f if isinstance(f, tuple) else (reward_name(f), f) for f in fns]
    weights = [1.0] * len(named) if weights is None else list(weights)
    n = len(completions)
    per_fn, weighted, outcome, steps = {}, [], [], [[] for _ in range(n)]
    # every `async def` function is awaited concurrently while the plain ones run (grpo.rewards.calls)
    inputs = [reward_inputs(fn, prompts, completions, fields) for _, fn in named]
    called = call_all([fn for _, fn in named], inputs)
    for (name, fn), w, (values, e), kwargs in zip(named, weights, called, inputs, strict=True):
        name = _unique(name, per_fn)
        if isinstance(e, GRPOError):  # one line of its own (a judge that failed, a template it cannot fill)
            raise e
        if isinstance(e, TypeError) and (missing := missing_fields(fn, kwargs)):
            raise needs_fields_error(name, missing, kwargs) from e
        if e is not None:  # a user's function: say which one, and on which example
            i = _culprit(fn, prompts, completions, fields)
            where = (f"on prompt {prompts[i]!r} with completion {completions[i]!r}" if i is not None
                     else f"on a batch starting with prompt {prompts[0]!r}")
            raise DataError(f"reward function {name!r} raised {type(e).__name__}: {e} {where}") from e
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise DataError(f"reward function {name!r} returned {got} values for {n} completions; it must "
                            "return one float, list of (end, reward) steps, or None per completion")
        if any(isinstance(v, (list, tuple)) for v in values):
            parsed = [_steps(name, v, completions[i]) for i, v in enumerate(values)]
            per_fn[name] = torch.tensor([sum(r for _, r in p) / len(p) if p else float("nan") for p in parsed],
                                        dtype=torch.float32)
            for mine, p in zip(steps, parsed):
                mine.extend((end, w * r) for end, r in p or [])
        else:  # floats and None (a process function that applies to none of these completions lands here too)
            for i, v in enumerate(values):
                _check_value(name, v, prompts[i], completions[i])
            per_fn[name] = torch.tensor([float("nan") if v is None else float(v) for v in values],
                                        dtype=torch.float32)
            outcome.append(per_fn[name] * w)
        weighted.append(per_fn[name] * w)
    return Scores(_nansum(weighted, n), per_fn, _nansum(outcome, n), [sorted(s, key=lambda t: t[0]) for s in steps])


def _nansum(rows: list[torch.Tensor], n: int) -> torch.Tensor:
    """The NaN-aware sum of (N,) tensors; NaN where every one is NaN (or there are none)."""
    if not rows:
        return torch.full((n,), float("nan"))
    stacked = torch.stack(rows)  # (F, N)
    total = torch.nansum(stacked, dim=0)
    total[torch.isnan(stacked).all(dim=0)] = float("nan")
    return total


def _unique(name: str, taken: dict) -> str:
    if name not in taken:
        return name
    k = 2
    while f"{name}_{k}" in taken:
        k += 1
    return f"{name}_{k}"


def _check_value(name: str, v, prompt: str, completion: str) -> None:
    """An outcome reward must be None or a finite real number: a string such as "1.0" is refused, not converted,
    and a NaN or an infinity is an error, never taken for "does not apply" (that is None)."""
    if v is None:
        return
    where = f"on prompt {prompt!r} with completion {completion!r}"
    if not isinstance(v, numbers.Real):
        raise DataError(f"reward function {name!r} returned {v!r} ({type(v).__name__}) {where}; rewards must be "
                        "floats, lists of (end, reward) steps, or None")
    if not _math.isfinite(float(v)):
        raise DataError(f"reward function {name!r} returned {float(v)} {where}; a reward must be a finite number, "
                        "or None where it does not apply")


def _steps(name: str, value, text: str) -> list[Step] | None:
    """One completion's value from a process function, checked: None, or a list of (end, reward)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise DataError(f"reward function {name!r} returned step lists for some completions and {value!r} for "
                        "another; a function returns floats or lists of (end, reward) steps, not both")
    out = []
    for step in value:
        try:
            end, reward = step
            end_ok = isinstance(end, int) and not isinstance(end, bool) and isinstance(reward, numbers.Real)
            reward = float(reward)
        except (TypeError, ValueError):
            end_ok = False
        if not end_ok or not 0 <= end <= len(text) or not _math.isfinite(reward):
            raise DataError(f"reward function {name!r} returned the step {step!r} for completion {text!r}; a step "
                            f"is (end, reward) with end an int in 0..{len(text)} (a character offset just after "
                            "the step) and reward a finite number")
        out.append((end, reward))
    return out
