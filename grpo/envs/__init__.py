"""Environments: how a prompt becomes a finished episode (`Environment`, envs/base.py). `ENVIRONMENTS` names
them (`rollout.environment`); `build_environment` makes the configured one."""
from __future__ import annotations

from collections.abc import Callable

from grpo.envs.base import Environment
from grpo.envs.single_turn import SingleTurn, prompt_formatter


def _single_turn(tokenizer, model_cfg, rollout_cfg) -> Environment:
    return SingleTurn(prompt_formatter(tokenizer, model_cfg))


# name -> builder(tokenizer, model_cfg, rollout_cfg); a new environment adds one entry here (and its options, if
# any, to the rollout section or a section of its own)
ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"single_turn": _single_turn}


def build_environment(tokenizer, model_cfg, rollout_cfg) -> Environment:
    """The environment `rollout.environment` names, for this tokenizer and the `model.*` and `rollout.*`
    sections."""
    return ENVIRONMENTS[rollout_cfg.environment](tokenizer, model_cfg, rollout_cfg)


__all__ = ["ENVIRONMENTS", "Environment", "SingleTurn", "build_environment", "prompt_formatter"]
