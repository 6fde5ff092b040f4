"""Token budgets of a run, from the model's context and the config: the positions the model takes
(`model_context`), the longest rendered prompt (`prompt_limit`) and the longest episode after its prompt
(`max_episode_tokens`)."""
from __future__ import annotations

from grpo.errors import DataError


def model_context(model, cfg) -> int:
    """The most positions (prompt and completion) the model takes: its max_position_embeddings, or less where
    the vLLM engine is told so (vllm.max_model_len)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    positions = int(getattr(base.config, "max_position_embeddings", 0) or 32768)
    if cfg.rollout.backend in ("vllm", "vllm_server") and cfg.vllm.max_model_len:
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
