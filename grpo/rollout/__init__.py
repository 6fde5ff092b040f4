"""Rollout backends: sample G completions per prompt. `BACKENDS` names the built-in ones; `rollout.backend` takes
one of those names or a user's 'module:Name' (a `Generator` class or factory, docs/training.md "Your own rollout
backend"); training, `grpo eval` and `grpo sample` all build theirs with `build_generator`."""
from __future__ import annotations

import inspect
from collections.abc import Callable

from grpo.rollout.base import EVAL, SAMPLE, TRAIN, Generator, Rollout, Sampling, rollout_sampling, sampling_seed
from grpo.rollout.hf import HFGenerator, sample_next


def _hf(model, tokenizer, cfg, all_finished, world_size, run_dir, group) -> Generator:
    from grpo.images import image_prompts_for
    from grpo.precision import resolved

    # a vision-language model's image processor: from where the model was loaded (a loaded model records it), else
    # from model.path as given
    images = image_prompts_for(model, tokenizer, cfg.model.path)
    return HFGenerator(model, tokenizer, all_finished=all_finished, add_special_tokens=not cfg.model.chat_template,
                       autocast_bf16=resolved(cfg.model, model)[0].autocast_bf16, lean=cfg.rollout.lean_decoding,
                       image_prompts=images)


def _text_only(model, backend: str) -> None:
    from grpo.errors import ConfigError
    from grpo.vision import is_multimodal

    if is_multimodal(model):
        raise ConfigError(f"rollout.backend={backend}: images are not passed to vLLM (its vision-language models "
                          "need torchvision, which does not install beside grpo's CPU torch); a vision-language "
                          "model samples with rollout.backend=hf (docs/vision.md)")


def _vllm(model, tokenizer, cfg, all_finished, world_size, run_dir, group) -> Generator:
    _text_only(model, "vllm")
    from grpo.rollout.vllm_colocate import VLLMGenerator
    return VLLMGenerator(model, tokenizer, vllm_cfg=cfg.vllm, dtype=cfg.model.dtype, seed=cfg.train.seed,
                         add_special_tokens=not cfg.model.chat_template, distributed=world_size > 1)


def _vllm_server(model, tokenizer, cfg, all_finished, world_size, run_dir, group) -> Generator:
    _text_only(model, "vllm_server")
    from grpo.rollout.vllm_server import VLLMServerGenerator
    return VLLMServerGenerator(model, tokenizer, cfg=cfg, add_special_tokens=not cfg.model.chat_template,
                               run_dir=run_dir, group=group)


# name -> builder(model, tokenizer, cfg, all_finished, world_size, run_dir, group); a new backend adds one entry here
BACKENDS: dict[str, Callable[..., Generator]] = {"hf": _hf, "vllm": _vllm, "vllm_server": _vllm_server}


def snapshot_weights(model) -> dict:
    """A copy of the policy's weights as an engine of its own takes them (`grpo.rollout.vllm_common`)."""
    from grpo.rollout.vllm_common import snapshot_weights as snapshot
    return snapshot(model)


# the methods a generator must have (`Generator`)
GENERATOR_METHODS = ("generate", "sync_weights", "close")


def resolve_backend(spec: str, *, field: str = "rollout.backend"):
    """What `spec` names, checked: a built-in name (returned as is), or an imported 'module:Name': a Generator
    class (one with the `GENERATOR_METHODS`) or a factory. A ConfigError naming `field` when it does not import,
    names nothing, or names something else."""
    from grpo.errors import ConfigError
    from grpo.imports import import_object

    if spec in BACKENDS:
        return spec
    if ":" not in spec:
        raise ConfigError(f"{field}={spec!r} is not a rollout backend; choose one of {', '.join(map(repr, BACKENDS))}, "
                          "or give an importable 'module:Name' (a Generator class or a factory)")
    obj = import_object(spec, field=field, what="rollout backend")
    if inspect.isclass(obj):
        missing = [m for m in GENERATOR_METHODS if not callable(getattr(obj, m, None))]
        if missing:
            raise ConfigError(f"{field}: {spec!r} is a class without {', '.join(missing)}; a rollout backend has "
                              f"{', '.join(GENERATOR_METHODS)} (grpo.rollout.Generator, docs/training.md)")
        return obj
    if not callable(obj):
        raise ConfigError(f"{field}: {spec!r} is a {type(obj).__name__}, not a Generator class or a factory that "
                          "makes one")
    return obj


def build_generator(model, tokenizer, cfg, *, all_finished: Callable[[bool], bool] | None = None,
                    world_size: int = 1, run_dir=None, group=None) -> Generator:
    """The generator `cfg.rollout.backend` names (`cfg`: a whole `grpo.config.Config`), sampling from `model`.
    `all_finished(done)`: True only when every process's batch is done, for backends whose decoding steps are
    collective (the in-process generator under FSDP). `world_size`: processes torchrun started. `run_dir`: the
    run's output directory, for what a backend writes there (launched servers' logs); None outside a run.
    `group`: the process group of the backend's own collectives (None: the default; asynchronous sampling gives
    the one its thread uses)."""
    spec = resolve_backend(cfg.rollout.backend)
    if isinstance(spec, str):
        return BACKENDS[spec](model, tokenizer, cfg, all_finished, world_size, run_dir, group)
    from grpo.errors import ConfigError
    from grpo.imports import call_builder

    # a user's backend: called with the arguments its signature names among these (grpo.imports.call_builder)
    available = {"model": model, "tokenizer": tokenizer, "cfg": cfg, "all_finished": all_finished or (lambda d: d),
                 "world_size": world_size, "run_dir": run_dir, "group": group}
    generator = call_builder(spec, available, field="rollout.backend", what="the rollout backend")
    missing = [m for m in GENERATOR_METHODS if not callable(getattr(generator, m, None))]
    if missing:
        raise ConfigError(f"rollout.backend: {cfg.rollout.backend!r} made a {type(generator).__name__} without "
                          f"{', '.join(missing)}; a rollout backend has {', '.join(GENERATOR_METHODS)}")
    if not isinstance(getattr(generator, "version", None), int):
        try:  # the weights it samples from, as built (asynchronous rollouts read it): 0 unless the backend says
            generator.version = 0
        except AttributeError:
            pass
    return generator


__all__ = ["BACKENDS", "EVAL", "GENERATOR_METHODS", "SAMPLE", "TRAIN", "Generator", "HFGenerator",
           "Rollout", "Sampling", "build_generator", "resolve_backend", "rollout_sampling", "sample_next",
           "sampling_seed", "snapshot_weights"]
