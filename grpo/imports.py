"""What a config names by 'module:Name' (a reward, a tool, an environment, a rollout backend), imported with an
error that names the config field, and the one rule by which grpo calls a user's class or factory
(`call_builder`)."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from grpo.errors import ConfigError


def import_object(name: str, *, field: str, what: str):
    """The object a config names as 'module:Name' (a reward, a tool, an environment, a rollout backend); a
    ConfigError that names the config `field` when it is not of that form, its module does not import (missing,
    or raising as it is imported) or the module has no such name."""
    module, sep, attr = name.partition(":")
    if not sep or not module.strip() or not attr.strip():
        raise ConfigError(f"{field}: {name!r} is not of the form 'module:Name' (for example my_pkg.envs:MyEnv)")
    try:
        mod = _import_module(module)
    except Exception as e:  # noqa: BLE001 - a missing module, or one that raises (SyntaxError, ...) as it imports
        raise ConfigError(f"{field}: cannot import {what} {name!r}: {type(e).__name__}: {e}") from None
    obj = mod
    for part in attr.split("."):  # module:Class.factory works too
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{field}: cannot import {what} {name!r}: {module} has no {attr!r}") from None
    return obj


def import_callable(name: str, *, field: str, what: str):
    """The callable a config names as 'module:function' (a reward, a tool); a ConfigError that names the config
    `field` when it cannot be imported (`import_object`) or is not callable."""
    fn = import_object(name, field=field, what=what)
    if not callable(fn):
        raise ConfigError(f"{field}: {name!r} is not callable")
    return fn


def _import_module(module: str):
    """Import `module`, looking in the current directory last, as `python -m` users expect of `grpo train`."""
    import importlib
    import os
    import sys

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        return importlib.import_module(module)


def call_builder(make: Callable, available: Mapping[str, Any], *, field: str, what: str) -> Any:
    """`make(**kw)`, with `kw` the entries of `available` that its signature names (all of them if it takes
    `**kwargs`): so a user's class or factory declares what it needs (`def __init__(self, tokenizer, cfg)`)
    and gets nothing else. A required parameter that `available` lacks is a ConfigError naming `field` and what
    is available; so is a TypeError raised by the call itself before it starts."""
    try:
        params = inspect.signature(make).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called bare
        return make()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return make(**available)
    kw, missing = {}, []
    for p in params:
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name in available:
            kw[p.name] = available[p.name]
        elif p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            missing.append(p.name)
    if missing:
        raise ConfigError(f"{field}: {what} {_name(make)} takes {', '.join(map(repr, missing))}, which grpo does not "
                          f"give; it may take any of {', '.join(available)} (by name)")
    return make(**kw)


def _name(obj) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def qualified_name(obj) -> str | None:
    """'module:qualname' of a class or function (None for other objects, lambdas and local definitions): what
    a run's config records for a Python object it was given, so that the config says what ran."""
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or "<" in qual:
        return None
    return f"{module}:{qual}"


def accepts(make: Callable, name: str) -> bool:
    """Whether `call_builder` would give `make` the argument `name` (its signature names it, or takes **kwargs)."""
    try:
        params = inspect.signature(make).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
               for p in params)
