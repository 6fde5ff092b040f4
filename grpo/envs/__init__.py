"""Environments: how a prompt becomes a finished episode (`Environment`, envs/base.py). `ENVIRONMENTS` names
them (`rollout.environment`); `build_environment` makes the configured one."""
from __future__ import annotations

from collections.abc import Callable

from grpo.budgets import model_context
from grpo.envs.base import Environment
from grpo.envs.single_turn import SingleTurn, prompt_formatter


def _single_turn(model, tokenizer, cfg, all_finished) -> Environment:
    return SingleTurn(prompt_formatter(tokenizer, cfg.model))


def _tools(model, tokenizer, cfg, all_finished) -> Environment:
    from grpo.envs.tool_calls import load_tools
    from grpo.envs.tools import ToolEnvironment
    from grpo.rollout.base import stop_tokens
    from grpo.sandbox import Limits

    t = cfg.tools
    tools = load_tools(t.names, timeout_s=t.timeout_s, max_chars=t.result_chars,
                       sandbox_limits=Limits.from_config(cfg.sandbox))
    _, pad = stop_tokens(model, tokenizer)
    return ToolEnvironment(tokenizer, tools, t.parser, pad_id=pad, context=model_context(model, cfg),
                           max_turns=t.max_turns, max_tokens=t.max_tokens, system_prompt=cfg.model.system_prompt,
                           all_finished=all_finished, chat_template_kwargs=cfg.model.chat_template_kwargs)


# name -> builder(model, tokenizer, cfg, all_finished) with `cfg` a whole `grpo.config.Config`, as a backend's;
# a new environment adds one entry here (and its options, if any, to a section of its own)
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"single_turn": _single_turn, "tools": _tools}


def build_environment(model, tokenizer, cfg, *, all_finished: Callable[[bool], bool] | None = None) -> Environment:
    """The environment `cfg.rollout.environment` names (`cfg`: a whole `grpo.config.Config`), for this tokenizer
    and model. `all_finished(done)`: True only when every process is done (several processes)."""
    return ENVIRONMENTS[cfg.rollout.environment](model, tokenizer, cfg, all_finished)


__all__ = ["ENVIRONMENTS", "Environment", "SingleTurn", "build_environment", "prompt_formatter"]
