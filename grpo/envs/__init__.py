"""Environments: how a prompt becomes a finished episode (`Environment`, envs/base.py). `ENVIRONMENTS` names the
built-in ones; `rollout.environment` takes one of those names or a user's 'module:Name'; `build_environment`
makes the configured one, or the one the Python API was given (`grpo.train(environment=..., tools=[...])`).

A user's environment (docs/tools.md, "Your own environment") is an object with `rollout(generator, examples,
sampling, seeds)`, given as is, or a class or factory that makes one. A class or factory is called with the
keyword arguments its signature names among `model`, `tokenizer`, `cfg` (the whole `grpo.config.Config`),
`all_finished` (see `build_environment`) and `tools` (name -> `grpo.envs.tool_calls.Tool`: the tools given, else
`tools.names`'s), all of them if it takes `**kwargs` (`grpo.imports.call_builder`)."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from grpo.budgets import model_context
from grpo.envs.base import Environment
from grpo.envs.single_turn import SingleTurn, prompt_formatter
from grpo.errors import ConfigError
from grpo.imports import accepts, call_builder, import_object, qualified_name


def _single_turn(model, tokenizer, cfg, all_finished) -> Environment:
    return SingleTurn(prompt_formatter(tokenizer, cfg.model))


def _tools(model, tokenizer, cfg, all_finished, tools: Sequence | None = None) -> Environment:
    from grpo.envs.tools import ToolEnvironment
    from grpo.rollout.base import stop_tokens

    t = cfg.tools
    _, pad = stop_tokens(model, tokenizer)
    return ToolEnvironment(tokenizer, _load_tools(cfg, tools), t.parser, pad_id=pad,
                           context=model_context(model, cfg), max_turns=t.max_turns, max_tokens=t.max_tokens,
                           system_prompt=cfg.model.system_prompt, all_finished=all_finished,
                           chat_template_kwargs=cfg.model.chat_template_kwargs)


def _load_tools(cfg, tools: Sequence | None) -> dict:
    """The run's tools: `tools` (the Python API's: functions and names) if given, else `tools.names`."""
    from grpo.envs.tool_calls import load_tools
    from grpo.sandbox import Limits

    return load_tools(cfg.tools.names if tools is None else tools, timeout_s=cfg.tools.timeout_s,
                      max_chars=cfg.tools.result_chars, sandbox_limits=Limits.from_config(cfg.sandbox),
                      field="tools.names" if tools is None else "tools")


# name -> builder(model, tokenizer, cfg, all_finished) with `cfg` a whole `grpo.config.Config`, as a backend's;
# a new built-in environment adds one entry here (and its options, if any, to a section of its own)
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"single_turn": _single_turn, "tools": _tools}


def _is_environment(obj) -> bool:
    return not inspect.isclass(obj) and callable(getattr(obj, "rollout", None))


def resolve_environment(spec, *, field: str = "rollout.environment"):
    """What `spec` stands for, checked: a built-in name (returned as is), an Environment object (as is), or a
    class or factory that makes one. A 'module:Name' string is imported first. A ConfigError naming `field` when
    it does not import, names nothing, or names something that is none of these."""
    if isinstance(spec, str):
        if spec in ENVIRONMENTS:
            return spec
        if ":" not in spec:
            raise ConfigError(f"{field}={spec!r} is not an environment; choose one of "
                              f"{', '.join(map(repr, ENVIRONMENTS))}, or give an importable 'module:Name' (an "
                              "Environment class, a factory or an object)")
        obj = import_object(spec, field=field, what="environment")
    else:
        obj = spec
    if _is_environment(obj):
        return obj
    if inspect.isclass(obj):
        if not callable(getattr(obj, "rollout", None)):
            raise ConfigError(f"{field}: {_label(spec)} is a class without a rollout method; an environment has "
                              "rollout(generator, examples, sampling, seeds) -> Rollout (docs/tools.md)")
        return obj
    if callable(obj):
        return obj  # a factory: what it returns is checked when it is called
    raise ConfigError(f"{field}: {_label(spec)} is a {type(obj).__name__}, not an environment (an object with "
                      "rollout(generator, examples, sampling, seeds)), an Environment class or a factory")


def build_environment(model, tokenizer, cfg, *, all_finished: Callable[[bool], bool] | None = None,
                      tools: Sequence | None = None, environment=None) -> Environment:
    """The run's environment, for this tokenizer and model (`cfg`: a whole `grpo.config.Config`).
    `all_finished(done)`: True only when every process is done (several processes); None: one process.

    `environment` (the Python API's `grpo.train(environment=...)`): an Environment object, used as is, or a
    class or factory, called as the module docstring says; None: `cfg.rollout.environment` (a built-in name or
    'module:Name'). `tools`: a list of Python functions and/or tool names ('calculator', 'module:function'),
    used instead of `tools.names`. Tools imply multi-turn tool calling, as TRL's `tools=` does: with tools and
    the default `single_turn` the environment is `tools`. A user's environment gets them as its `tools` argument
    (one that takes none is refused, so tools are never dropped silently).

    `cfg` is not changed: `grpo.train` records what it was given in the run's config (`tool_names`,
    `environment_name`)."""
    field = "rollout.environment" if environment is None else "environment"
    tools = None if tools is None else list(tools)
    spec = resolve_environment(cfg.rollout.environment if environment is None else environment, field=field)
    if isinstance(spec, str):
        if tools is not None and spec == "single_turn":
            spec = "tools"
        if tools is not None and not cfg.model.chat_template:
            raise ConfigError("tools are given: tool calling renders episodes with the chat template, set "
                              "model.chat_template=true")
        if tools is not None and spec != "tools":
            raise ConfigError(f"tools are given, and rollout.environment={spec!r} takes none: use "
                              "rollout.environment=tools or an environment of your own that takes tools")
        return _tools(model, tokenizer, cfg, all_finished, tools) if tools is not None else \
            ENVIRONMENTS[spec](model, tokenizer, cfg, all_finished)
    if _is_environment(spec):
        if tools is not None:
            raise ConfigError("tools are given with an environment object, which cannot take them: give its class "
                              "or factory (with a tools parameter) instead, or leave tools out")
        env = spec
    else:
        if tools is not None and not accepts(spec, "tools"):
            raise ConfigError(f"tools are given, and the environment {_label(spec)} takes no tools parameter: add "
                              "one (it gets name -> grpo.envs.tool_calls.Tool) or leave tools out")
        available = {"model": model, "tokenizer": tokenizer, "cfg": cfg,
                     "all_finished": all_finished or (lambda done: done)}
        if accepts(spec, "tools"):
            available["tools"] = _load_tools(cfg, tools)
        env = call_builder(spec, available, field=field, what="the environment")
        if not _is_environment(env):
            raise ConfigError(f"{field}: {_label(spec)} returned a {type(env).__name__}, which has no "
                              "rollout(generator, examples, sampling, seeds) method")
    return env


def tool_names(tools: Sequence) -> list[str]:
    """How a run's config records the tools the Python API gave (`tools.names`): a name as given, a function as
    'module:function' (its bare name when it is a local definition or a lambda)."""
    return [t if isinstance(t, str) else (qualified_name(t) or getattr(t, "__name__", repr(t))) for t in tools]


def environment_name(spec, env) -> str:
    """How a run's config records the environment the Python API gave (`rollout.environment`): its class or
    factory as 'module:Name', else (an object, a lambda, a local definition) the built environment's class."""
    made = None if _is_environment(spec) else qualified_name(spec)
    return made or qualified_name(type(env)) or type(env).__name__


def _label(spec) -> str:
    return repr(spec) if isinstance(spec, str) else (qualified_name(spec) or type(spec).__name__)


__all__ = ["ENVIRONMENTS", "Environment", "SingleTurn", "build_environment", "environment_name", "prompt_formatter",
           "resolve_environment", "tool_names"]
