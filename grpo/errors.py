"""Errors a user can fix: the CLI prints them as one line and exits non-zero, without a traceback."""


class GRPOError(Exception):
    """Base class of the errors caused by a config, a data file or a user-supplied function."""


class ConfigError(GRPOError):
    """A config key, type, value or combination of values is not allowed."""


class DataError(GRPOError):
    """A model, data set or reward function cannot be used as given."""
