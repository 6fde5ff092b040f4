"""Specs for the tests: `AlgoConfig`'s defaults (where every default is declared) with the overrides a test names,
so that a test says only the values its numbers depend on."""
from dataclasses import replace

from grpo.algo import AdvantageSpec, LossSpec
from grpo.config import AlgoConfig


def loss_spec(max_completion_length: int | None = None, **algo) -> LossSpec:
    """The `LossSpec` of `algo.*` = the defaults with `algo`; L_max of the constant normaliser as given."""
    return LossSpec.from_algo(replace(AlgoConfig(), **algo), max_completion_length=max_completion_length)


def advantage_spec(**algo) -> AdvantageSpec:
    """The `AdvantageSpec` of `algo.*` = the defaults with `algo`."""
    return AdvantageSpec.from_algo(replace(AlgoConfig(), **algo))
