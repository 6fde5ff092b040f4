"""The Python entry points: `grpo.train(config, model=..., train_dataset=..., rewards=[...])` and `GRPOTrainer`,
TRL's `GRPOTrainer(...).train()` in grpo's terms (docs/from-trl.md). Both only sort what they are given (a config
in any of its forms, reward functions or names, objects or paths) and call `grpo.trainer.train`."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from grpo.config import Config, config_path, from_dict, load_config, read_yaml
from grpo.errors import ConfigError
from grpo.validate import carry_validation

DEFAULT_JOB = "tiny"  # what `grpo train` runs without a CONFIG: grpo/configs/tiny.yaml


def as_config(config: Config | Mapping | str | Path | None) -> Config:
    """A `Config` from what `grpo.train` takes: a `Config` (as is); a YAML path or a shipped config's name
    ("tiny", "presets/dapo"); a dict of settings over the default job, as `grpo train key=value` sets them, with
    dotted keys (`{"train.steps": 20}`), nested sections (`{"train": {"steps": 20}}`) or both, values as Python
    values; None: the default job (grpo/configs/tiny.yaml)."""
    if config is None:
        return load_config(DEFAULT_JOB)
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        return load_config(config, validate=False)  # validated by `train`, as a dict is
    if isinstance(config, Mapping):
        raw = read_yaml(config_path(DEFAULT_JOB))
        for key, value in config.items():
            if not isinstance(key, str) or not key:
                raise ConfigError(f"config keys must be dotted names such as 'train.steps', got {key!r}")
            _merge(raw, key.split("."), value)
        return from_dict(raw)  # validated by `train`, which knows the Python reward functions' names
    if type(config).__name__ == "GRPOConfig":
        raise ConfigError("config is a TRL GRPOConfig; give grpo's config: a Config, a dict of dotted keys "
                          "({'train.lr': 1e-6, 'rollout.group_size': 8}), a YAML path or a shipped config's name "
                          "(docs/from-trl.md maps every GRPOConfig option)")
    raise ConfigError(f"config must be a Config, a dict of settings, a YAML path or a shipped config's name, got a "
                      f"{type(config).__name__}")


def _merge(node: dict, parts: list[str], value: Any) -> None:
    """Set `value` at the dotted path `parts` of the raw config `node`, merging a dict into a section."""
    for i, p in enumerate(parts[:-1]):
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"config key {'.'.join(parts)!r}: {'.'.join(parts[:i + 1])!r} is not a section")
        node = nxt
    last = parts[-1]
    if isinstance(value, Mapping) and isinstance(node.get(last), dict):
        for k, v in value.items():
            _merge(node[last], [k], v)
    else:
        node[last] = dict(value) if isinstance(value, Mapping) else value


def sort_rewards(cfg: Config, rewards) -> tuple[Config, list[Callable] | None]:
    """`rewards` as `grpo.trainer.train` takes them: names go into the config's `rewards`, Python callables are
    passed on (one callable alone is a list of one, as TRL's reward_funcs); names beside callables are resolved to
    their functions (built-ins and 'module:function'; a reward model or the judge is named alone)."""
    from dataclasses import replace

    from grpo.rewards import resolve_reward

    if rewards is None:
        return cfg, None
    if callable(rewards) or isinstance(rewards, str):
        rewards = [rewards]
    rewards = list(rewards)
    if not rewards:
        raise ConfigError("rewards is empty; give at least one reward function")
    bad = [r for r in rewards if not callable(r) and not isinstance(r, str)]
    if bad:
        raise ConfigError(f"rewards must be functions or reward names, got a {type(bad[0]).__name__}")
    if all(isinstance(r, str) for r in rewards):
        return replace(cfg, rewards=rewards), None
    out = []
    for r in rewards:
        if isinstance(r, str) and (r == "judge" or r.startswith("rm:")):
            raise ConfigError(f"rewards: {r!r} beside Python functions; a reward model or the judge is given by name "
                              "with names only (rewards=['rm:...', 'last_number']), or as a Python function")
        out.append(resolve_reward(r, field="rewards") if isinstance(r, str) else r)
    return cfg, out


def train(config=None, *, model=None, processing_class=None, train_dataset=None, eval_dataset=None, rewards=None,
          tools=None, environment=None, **kwargs):
    """Run GRPO (`grpo.train`); see `grpo.__init__`."""
    from grpo.trainer import train as _train

    if "cfg" in kwargs:  # the keyword's name before grpo.train took objects: train(cfg=...)
        if config is not None:
            raise ConfigError("grpo.train: give config (or its old name cfg), not both")
        config = kwargs.pop("cfg")
    config = as_config(config)
    cfg, fns = sort_rewards(config, rewards)
    carry_validation(config, cfg)  # a trap `load_config` warned of is not warned of again
    return _train(cfg, rewards=fns, model=model, processing_class=processing_class, train_dataset=train_dataset,
                  eval_dataset=eval_dataset, tools=tools, environment=environment, **kwargs)


def with_peft(cfg: Config, peft_config) -> Config:
    """`cfg` with a peft `LoraConfig`'s settings as its lora.* section (r, lora_alpha, lora_dropout,
    target_modules), as TRL's `GRPOTrainer(peft_config=...)` takes them."""
    from dataclasses import replace

    if peft_config is None:
        return cfg
    if not hasattr(peft_config, "r") or not hasattr(peft_config, "lora_alpha"):
        raise ConfigError(f"peft_config must be a peft LoraConfig (grpo trains LoRA adapters), got a "
                          f"{type(peft_config).__name__}")
    targets = peft_config.target_modules
    targets = ["all-linear"] if targets in (None, "all-linear") else [targets] if isinstance(targets, str) \
        else sorted(targets)
    return carry_validation(cfg, replace(cfg, lora=replace(cfg.lora, rank=int(peft_config.r),
                                                           alpha=float(peft_config.lora_alpha),
                                                           dropout=float(peft_config.lora_dropout),
                                                           target_modules=targets)))


class GRPOTrainer:
    """TRL's `GRPOTrainer` in grpo's terms: `GRPOTrainer(model, reward_funcs, args=config, train_dataset=...,
    eval_dataset=..., processing_class=..., peft_config=...).train()` runs `grpo.train` and returns its
    `TrainResult`. `args` is grpo's config (a `Config`, a dict of dotted keys, a YAML path or a shipped config's
    name; None: the default job), not TRL's GRPOConfig (docs/from-trl.md maps its options); `peft_config`, a peft
    `LoraConfig`, sets lora.* (`with_peft`)."""

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, *, peft_config=None, tools=None, environment=None):
        self.config = with_peft(as_config(args), peft_config)
        self.model, self.reward_funcs, self.processing_class = model, reward_funcs, processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.tools, self.environment = tools, environment

    def train(self):
        return train(self.config, model=self.model, processing_class=self.processing_class,
                     train_dataset=self.train_dataset, eval_dataset=self.eval_dataset, rewards=self.reward_funcs,
                     tools=self.tools, environment=self.environment)
