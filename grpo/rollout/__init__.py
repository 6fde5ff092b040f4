"""Rollout backends: sample G completions per prompt. `BACKENDS` names them (`rollout.backend`); training,
`grpo eval` and `grpo sample` all build theirs with `build_generator`."""
from __future__ import annotations

from collections.abc import Callable

from grpo.rollout.base import EVAL, SAMPLE, TRAIN, Generator, Rollout, Sampling, rollout_sampling, sampling_seed
from grpo.rollout.hf import HFGenerator, sample_next


def _hf(model, tokenizer, model_cfg, rollout_cfg, all_finished) -> Generator:
    return HFGenerator(model, tokenizer, all_finished=all_finished, add_special_tokens=not model_cfg.chat_template,
                       autocast_bf16=model_cfg.autocast_bf16, lean=rollout_cfg.lean_decoding)


# name -> builder(model, tokenizer, model_cfg, rollout_cfg, all_finished); a new backend adds one entry here
BACKENDS: dict[str, Callable[..., Generator]] = {"hf": _hf}


def build_generator(model, tokenizer, model_cfg, rollout_cfg, *,
                    all_finished: Callable[[bool], bool] | None = None) -> Generator:
    """The generator `rollout.backend` names, sampling from `model` (`grpo.config.ModelConfig` and
    `RolloutConfig` sections). `all_finished(done)`: True only when every process's batch is done, for backends
    whose decoding steps are collective (the in-process generator under FSDP)."""
    return BACKENDS[rollout_cfg.backend](model, tokenizer, model_cfg, rollout_cfg, all_finished)


__all__ = ["BACKENDS", "EVAL", "SAMPLE", "TRAIN", "Generator", "HFGenerator", "Rollout", "Sampling",
           "build_generator", "rollout_sampling", "sample_next", "sampling_seed"]
