"""Rollout backends: sample G completions per prompt. `BACKENDS` names them (`rollout.backend`); training,
`grpo eval` and `grpo sample` all build theirs with `build_generator`."""
from __future__ import annotations

from collections.abc import Callable

from grpo.rollout.base import EVAL, SAMPLE, TRAIN, Generator, Rollout, Sampling, rollout_sampling, sampling_seed
from grpo.rollout.hf import HFGenerator, sample_next


def _hf(model, tokenizer, cfg, all_finished, world_size, run_dir, group) -> Generator:
    return HFGenerator(model, tokenizer, all_finished=all_finished, add_special_tokens=not cfg.model.chat_template,
                       autocast_bf16=cfg.model.autocast_bf16, lean=cfg.rollout.lean_decoding)


def _vllm(model, tokenizer, cfg, all_finished, world_size, run_dir, group) -> Generator:
    from grpo.rollout.vllm_colocate import VLLMGenerator
    return VLLMGenerator(model, tokenizer, vllm_cfg=cfg.vllm, dtype=cfg.model.dtype, seed=cfg.train.seed,
                         add_special_tokens=not cfg.model.chat_template, distributed=world_size > 1)


def _vllm_server(model, tokenizer, cfg, all_finished, world_size, run_dir, group) -> Generator:
    from grpo.rollout.vllm_server import VLLMServerGenerator
    return VLLMServerGenerator(model, tokenizer, cfg=cfg, add_special_tokens=not cfg.model.chat_template,
                               run_dir=run_dir, group=group)


# name -> builder(model, tokenizer, cfg, all_finished, world_size, run_dir, group); a new backend adds one entry here
BACKENDS: dict[str, Callable[..., Generator]] = {"hf": _hf, "vllm": _vllm, "vllm_server": _vllm_server}


def snapshot_weights(model) -> dict:
    """A copy of the policy's weights as an engine of its own takes them (`grpo.rollout.vllm_common`)."""
    from grpo.rollout.vllm_common import snapshot_weights as snapshot
    return snapshot(model)


def build_generator(model, tokenizer, cfg, *, all_finished: Callable[[bool], bool] | None = None,
                    world_size: int = 1, run_dir=None, group=None) -> Generator:
    """The generator `cfg.rollout.backend` names (`cfg`: a whole `grpo.config.Config`), sampling from `model`.
    `all_finished(done)`: True only when every process's batch is done, for backends whose decoding steps are
    collective (the in-process generator under FSDP). `world_size`: processes torchrun started. `run_dir`: the
    run's output directory, for what a backend writes there (launched servers' logs); None outside a run.
    `group`: the process group of the backend's own collectives (None: the default; asynchronous sampling gives
    the one its thread uses)."""
    return BACKENDS[cfg.rollout.backend](model, tokenizer, cfg, all_finished, world_size, run_dir, group)


__all__ = ["BACKENDS", "EVAL", "SAMPLE", "TRAIN", "Generator", "HFGenerator", "Rollout", "Sampling",
           "build_generator", "rollout_sampling", "sample_next", "sampling_seed", "snapshot_weights"]
