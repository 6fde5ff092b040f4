"""grpo: Group Relative Policy Optimization for Hugging Face causal language models.

    from grpo import load_config, train
    result = train(load_config("grpo/configs/tiny.yaml", ["train.steps=20"]))
"""
from grpo.config import Config, load_config
from grpo.errors import ConfigError, DataError, GRPOError
from grpo.rewards import REWARDS, exact_match, last_number
from grpo.validate import validate_once as _validate_once  # noqa: F401 - importing it adds it to
                                                           # grpo.config.LOAD_CHECKS: load_config validates


def train(cfg: Config, **kwargs):
    """Run GRPO; see `grpo.trainer.train`."""
    from grpo.trainer import train as _train
    return _train(cfg, **kwargs)


__all__ = ["REWARDS", "Config", "ConfigError", "DataError", "GRPOError", "exact_match", "last_number", "load_config",
           "train"]
__version__ = "0.1.0"
