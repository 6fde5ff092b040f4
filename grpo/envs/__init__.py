"""Environments: how a prompt becomes a finished episode (`Environment`, envs/base.py). `ENVIRONMENTS` names
them (`rollout.environment`); `build_environment` makes the configured one."""
from __future__ import annotations

from collections.abc import Callable

from grpo.envs.base import Environment
from grpo.errors import DataError
from grpo.envs.single_turn import SingleTurn, prompt_formatter


def _single_turn(model, tokenizer, cfg, all_finished) -> Environment:
    return SingleTurn(prompt_formatter(tokenizer, cfg.model))


def _tools(model, tokenizer, cfg, all_finished) -> Environment:
    from grpo.envs.tools import ToolEnvironment
    from grpo.rollout.base import stop_tokens
    from grpo.sandbox import Limits
    from grpo.envs.tool_calls import load_tools

    t = cfg.tools
    tools = load_tools(t.names, timeout_s=t.timeout_s, max_chars=t.result_chars,
                       sandbox_limits=Limits.from_config(cfg.sandbox))
    _, pad = stop_tokens(model, tokenizer)
    return ToolEnvironment(tokenizer, tools, t.parser, pad_id=pad, context=model_context(model, cfg),
                           max_turns=t.max_turns, max_tokens=t.max_tokens, system_prompt=cfg.model.system_prompt,
                           all_finished=all_finished)


def model_context(model, cfg) -> int:
    """The most positions (prompt and completion) the model takes: its max_position_embeddings, or less where
    the vLLM engine is told so (vllm.max_model_len)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    positions = int(getattr(base.config, "max_position_embeddings", 0) or 32768)
    if cfg.rollout.backend == "vllm" and cfg.vllm.max_model_len:
        positions = min(positions, cfg.vllm.max_model_len)
    return positions


def prompt_limit(model, cfg) -> tuple[int, str]:
    """The most tokens a rendered prompt may have: the model's context minus rollout.max_new_tokens; and those
    figures in words, for errors."""
    context = model_context(model, cfg)
    limit = context - cfg.rollout.max_new_tokens
    why = f"the model's context of {context} minus rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
    if limit < 1:
        raise DataError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt in the "
                        f"model's context of {context} positions")
    return limit, why


def max_episode_tokens(cfg, model) -> int:
    """The most tokens an episode holds after its prompt (L_max of the constant normaliser): one turn's
    rollout.max_new_tokens, or for multi-turn episodes tools.max_tokens (else the model's context)."""
    if cfg.rollout.environment == "single_turn":
        return cfg.rollout.max_new_tokens
    return cfg.tools.max_tokens or model_context(model, cfg)


# name -> builder(model, tokenizer, cfg, all_finished) with `cfg` a whole `grpo.config.Config`, as a backend's;
# a new environment adds one entry here (and its options, if any, to a section of its own)
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"single_turn": _single_turn, "tools": _tools}


def build_environment(model, tokenizer, cfg, *, all_finished: Callable[[bool], bool] | None = None) -> Environment:
    """The environment `cfg.rollout.environment` names (`cfg`: a whole `grpo.config.Config`), for this tokenizer
    and model. `all_finished(done)`: True only when every process is done (several processes)."""
    return ENVIRONMENTS[cfg.rollout.environment](model, tokenizer, cfg, all_finished)


__all__ = ["ENVIRONMENTS", "Environment", "SingleTurn", "build_environment", "max_episode_tokens", "model_context",
           "prompt_formatter", "prompt_limit"]
