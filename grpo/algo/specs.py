"""The algorithm's choices as two frozen values, built once per run from the `algo.*` config section and handed
to the pieces that act on them: `AdvantageSpec` to scoring (rewards → advantages, dynamic sampling) and
`LossSpec` to the update (`grpo.algo.policy_loss` and the learner).

They declare no defaults: every default lives once, on its config option (`grpo.config.AlgoConfig`). `from_algo`
reads any object with the `algo.*` attribute names (an `AlgoConfig`), so this module imports nothing of the
rest of grpo; a value that is not an `algo.*` option (the constant normaliser's L_max) is given when the spec is
built. Each spec checks its values once, when it is built, and names the field at fault.

A new variant of an existing kind (a surrogate, an aggregation, a KL estimator, an advantage scale) is one
entry in its registry (`SURROGATES`, `AGGREGATIONS`, `KL_KINDS`, `ADVANTAGES`) and one value of its config
option: nothing here changes. A variant with a knob of its own adds the knob here, as a field with the name of
its `algo.*` option, and `from_algo` picks it up.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from grpo.algo._checks import check_choice, check_positive_int
from grpo.algo.advantages import ADVANTAGES, REWARD_AGGREGATIONS, STDS
from grpo.algo.correction import CORRECTIONS, PROXIMAL
from grpo.algo.loss import AGGREGATIONS, KL_KINDS, RATIO_LEVELS, UNBIASED_KL
from grpo.algo.surrogates import SURROGATES


def _from_algo(cls, algo, given: dict):
    """`cls` with each field read from `algo` by its name, except those `given`."""
    return cls(**{f.name: getattr(algo, f.name) for f in fields(cls) if f.name not in given}, **given)


def _at_least(name: str, value, low: float, *, strict: bool = False) -> None:
    if not (value > low if strict else value >= low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low:g}, got {value!r}")


@dataclass(frozen=True)
class AdvantageSpec:
    """How rewards become advantages, and which groups a step keeps (SPEC 1.2, 1.3, 2, 13.8)."""

    scale: str               # a key of `ADVANTAGES` (`grpo.algo.compute_advantages`)
    std: str                 # "sample" or "population"
    eps: float               # added to the std before dividing
    multi_objective_aggregation: str  # several reward functions: sum then normalise, or GDPO's normalise then sum
    mask_truncated: bool     # truncated completions leave the loss (they still count in the group statistics)
    dynamic_sampling: bool   # DAPO: groups whose rewards are all equal are replaced by newly drawn ones
    max_sampling_rounds: int  # with dynamic_sampling: rounds of prompts at most per step

    def __post_init__(self):
        check_choice("scale", self.scale, ADVANTAGES)
        check_choice("std", self.std, STDS)
        check_choice("multi_objective_aggregation", self.multi_objective_aggregation, REWARD_AGGREGATIONS)
        _at_least("eps", self.eps, 0)
        check_positive_int("max_sampling_rounds", self.max_sampling_rounds)

    @classmethod
    def from_algo(cls, algo) -> AdvantageSpec:
        """The spec of an `algo.*` config section (any object with these attribute names)."""
        return _from_algo(cls, algo, {})


@dataclass(frozen=True)
class LossSpec:
    """How the update turns log-probs and advantages into a loss (SPEC 1.4, 3, 4, 6, 12, 13.1-13.5)."""

    beta: float                      # KL coefficient; 0: no reference
    kl_kind: str                     # `KL_KINDS`
    clip_low: float                  # ε_low: clip(r, 1 − ε_low, ·) (CISPO: its weight's lower bound)
    clip_high: float                 # ε_high: clip(r, ·, 1 + ε_high)
    surrogate: str                   # `SURROGATES`: the policy term per token
    dual_clip: float                 # c > 1 of dual-clip PPO (surrogate "clip" only); 0: off
    sapo_tau_pos: float              # SAPO's τ for Â > 0
    sapo_tau_neg: float              # SAPO's τ for Â ≤ 0
    dppo_tv_low: float               # δ_low of DPPO's binary-TV mask
    dppo_tv_high: float              # δ_high
    dppo_kl_low: float               # δ_low of DPPO's binary-KL mask
    dppo_kl_high: float              # δ_high
    dppo_cap: float                  # C of DPPO's importance weight min(r, C); 0: none
    ratio_level: str                 # `RATIO_LEVELS`: per token, or GSPO's per sequence
    aggregation: str                 # `AGGREGATIONS`: how the token terms are summed and normalised
    num_iterations: int              # μ: updates per batch of rollouts
    top_entropy_quantile: float      # ρ: the highest-entropy share of the loss tokens that carries the policy term
    proximal: str                    # `PROXIMAL`: the ratio's denominator when the sampler reports log-probs
    sampler_correction: str          # `CORRECTIONS`, when the sampler reports log-probs of its own
    sampler_correction_cap: float    # C
    sampler_correction_floor: float  # C_min; 0: none
    off_policy_mask_threshold: float | None  # δ of OPSM (DeepSeek-V3.2); None: off
    unbiased_kl: str                 # `UNBIASED_KL`: k, r·k, or sg(w)·r·k
    entropy_coef: float              # c of the entropy bonus (the first coefficient when adaptive)
    use_adaptive_entropy: bool       # TRL's adaptive c, towards entropy_target
    entropy_coef_delta: float        # Δ
    entropy_coef_min: float
    entropy_coef_max: float
    entropy_target: float            # H_tgt
    max_completion_length: int | None  # L_max of the constant normaliser (not an algo.* option: given at build)

    def __post_init__(self):
        check_choice("kl_kind", self.kl_kind, KL_KINDS)
        check_choice("surrogate", self.surrogate, SURROGATES)
        check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        check_choice("sampler_correction", self.sampler_correction, CORRECTIONS)
        check_choice("proximal", self.proximal, PROXIMAL)
        check_choice("unbiased_kl", self.unbiased_kl, UNBIASED_KL)
        if self.off_policy_mask_threshold is not None:
            _at_least("off_policy_mask_threshold", self.off_policy_mask_threshold, 0)
        for name in ("entropy_coef", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max"):
            _at_least(name, getattr(self, name), 0)
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"entropy_coef_min must be <= entropy_coef_max, got {self.entropy_coef_min!r} > "
                             f"{self.entropy_coef_max!r}")
        if self.unbiased_kl != "off" and self.beta == 0:
            raise ValueError(f"unbiased_kl={self.unbiased_kl!r} corrects the KL term, and beta=0 has none; set "
                             "beta > 0 or unbiased_kl='off'")
        _at_least("beta", self.beta, 0)
        if not 0 <= self.clip_low <= 1:
            raise ValueError(f"clip_low must be in [0, 1], got {self.clip_low!r}")
        _at_least("clip_high", self.clip_high, 0)
        if self.dual_clip and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (or 0: off), got {self.dual_clip!r}")
        if self.dual_clip and self.surrogate != "clip":
            raise ValueError(f"dual_clip bounds PPO's clipped surrogate; surrogate={self.surrogate!r} has none")
        if not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0, got {self.sapo_tau_pos!r}, "
                             f"{self.sapo_tau_neg!r}")
        for name in ("dppo_tv_low", "dppo_tv_high", "dppo_kl_low", "dppo_kl_high", "dppo_cap"):
            _at_least(name, getattr(self, name), 0)
        if self.surrogate.startswith("dppo") and self.ratio_level != "token":
            raise ValueError(f"surrogate={self.surrogate!r} masks tokens by their own probabilities; it needs "
                             f"ratio_level='token', got {self.ratio_level!r}")
        check_positive_int("num_iterations", self.num_iterations)
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile!r}")
        _at_least("sampler_correction_cap", self.sampler_correction_cap, 0, strict=True)
        if not 0 <= self.sampler_correction_floor < self.sampler_correction_cap:
            raise ValueError(f"sampler_correction_floor must be in [0, sampler_correction_cap), got "
                             f"{self.sampler_correction_floor!r} with cap {self.sampler_correction_cap!r}")
        if self.aggregation == "constant" and not (isinstance(self.max_completion_length, int)
                                                   and self.max_completion_length >= 1):
            raise ValueError("aggregation='constant' needs max_completion_length (a positive integer), got "
                             f"{self.max_completion_length!r}")

    @classmethod
    def from_algo(cls, algo, *, max_completion_length: int | None) -> LossSpec:
        """The spec of an `algo.*` config section (any object with these attribute names); `max_completion_length`
        is the longest completion (episode) the run samples, L_max of the constant normaliser."""
        return _from_algo(cls, algo, {"max_completion_length": max_completion_length})
