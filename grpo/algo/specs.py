"""The algorithm's choices as two frozen values, built once per run from the `algo.*` config section and handed
to the pieces that act on them: `AdvantageSpec` to scoring (rewards → advantages, dynamic sampling) and
`LossSpec` to the update (`grpo.algo.policy_loss` and the learner).

They declare no defaults: every default lives once, on its config option (`grpo.config.AlgoConfig`). `from_algo`
reads any object with the `algo.*` attribute names (an `AlgoConfig`), so this module imports nothing of the
rest of grpo. A new variant adds its field here, its option to `AlgoConfig`, and the pure function that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class AdvantageSpec:
    """How rewards become advantages, and which groups a step keeps (SPEC 1.2, 1.3, 2, 13.8)."""

    scale: str               # "group", "batch", "none" or "rloo" (`grpo.algo.compute_advantages`)
    std: str                 # "sample" or "population"
    eps: float               # added to the std before dividing
    mask_truncated: bool     # truncated completions leave the loss (they still count in the group statistics)
    dynamic_sampling: bool   # DAPO: groups whose rewards are all equal are replaced by newly drawn ones
    max_sampling_rounds: int  # with dynamic_sampling: rounds of prompts at most per step

    @classmethod
    def from_algo(cls, algo) -> AdvantageSpec:
        """The spec of an `algo.*` config section (any object with these attribute names)."""
        return cls(**{f.name: getattr(algo, f.name) for f in fields(cls)})
