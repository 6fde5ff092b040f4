"""grpo: Group Relative Policy Optimization for Hugging Face causal language models.

    import grpo
    result = grpo.train({"train.steps": 20}, model="tiny", train_dataset=rows, rewards=[my_reward])

`train(config=None, *, model=None, processing_class=None, train_dataset=None, eval_dataset=None, rewards=None,
tools=None, environment=None)`:
- `config` (also `cfg=`, its old name): a `Config`, a dict of settings over the default job (dotted keys
  `{"train.steps": 20}` or nested sections, as `grpo train key=value` sets them), a YAML path or a shipped
  config's name ("tiny", "presets/dapo"); None: the default job (grpo/configs/tiny.yaml).
- `model`: a path or Hub id (model.path), or a loaded `transformers.PreTrainedModel`, trained in place (its
  tokenizer or processor: `processing_class`, else loaded from its `name_or_path`).
- `train_dataset` / `eval_dataset`: a `datasets.Dataset`, an `IterableDataset` (read to its end once, at the
  start), a list of dicts, or a path (data.path / data.eval_path); rows are read by the data.* column rules.
- `rewards`: reward functions (plain or `async def`) or reward names.
- `tools`, `environment`: Python tools (one alone: a list of one) and an environment object, class or name
  (docs/tools.md); the run's config.yaml records them, and the data sets given as objects (`data.given`).
`GRPOTrainer(model, reward_funcs, args=config, train_dataset=..., eval_dataset=..., processing_class=...).train()`
is the same call in TRL's shape.
"""
from grpo.api import GRPOTrainer, train
from grpo.config import Config, load_config
from grpo.errors import ConfigError, DataError, GRPOError
from grpo.rewards import REWARDS, exact_match, last_number
from grpo.validate import validate_once as _validate_once  # noqa: F401 - importing it adds it to
                                                           # grpo.config.LOAD_CHECKS: load_config validates

__all__ = ["REWARDS", "Config", "ConfigError", "DataError", "GRPOError", "GRPOTrainer", "exact_match", "last_number",
           "load_config", "train"]
__version__ = "0.1.0"
