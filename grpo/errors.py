"""Errors a user can fix: the CLI prints them as one line and exits non-zero, without a traceback."""


class GRPOError(Exception):
    """Base class of the errors caused by a config, a data file or a user-supplied function."""


class ConfigError(GRPOError):
    """A config key, type, value or combination of values is not allowed."""


class DataError(GRPOError):
    """A model, data set or reward function cannot be used as given."""


def import_callable(name: str, *, field: str, what: str):
    """The callable a config names as 'module:function' (a reward, a tool); a ConfigError that names the config
    `field` when it cannot be imported or is not callable."""
    import importlib

    module, _, attr = name.partition(":")
    try:
        fn = getattr(_import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{field}: cannot import {what} {name!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"{field}: {name!r} is not callable")
    return fn


def _import_module(module: str):
    """Import `module`, looking in the current directory last, as `python -m` users expect of `grpo train`."""
    import importlib
    import os
    import sys

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module.split(".")[0] or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)
        return importlib.import_module(module)
