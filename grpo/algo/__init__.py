"""The mathematics of GRPO and its variants as pure tensor functions (SPEC.md).

Nothing here knows about models, configs or process groups: tensors, plain values and the two frozen specs
(`AdvantageSpec`, `LossSpec`, built once from the `algo.*` config section) in, tensors out.
"""
from grpo.algo.advantages import (ADVANTAGES, compute_advantages, gdpo_advantages, group_advantages,
                                  informative_groups, maxrl_advantages, process_advantages, rloo_advantages)
from grpo.algo._checks import RewardRangeError
from grpo.algo.correction import CORRECTIONS, PROXIMAL, proximal_terms, sampler_weights
from grpo.algo.entropy import (applied_entropy_coef, entropy_bonus, entropy_figures, entropy_threshold,
                               next_entropy_coef, top_entropy_mask)
from grpo.algo.logprobs import sampling_keep_mask, token_logprobs, token_logprobs_from_hidden
from grpo.algo.loss import (AGGREGATIONS, KL_KINDS, RATIO_LEVELS, UNBIASED_KL, kl_penalty, loss_normalizer,
                            off_policy_sequence_mask, policy_loss)
from grpo.algo.presets import PRESETS, Preset, get_preset, preset_values
from grpo.algo.specs import AdvantageSpec, LossSpec
from grpo.algo.surrogates import SURROGATES

__all__ = ["ADVANTAGES", "AGGREGATIONS", "AdvantageSpec", "CORRECTIONS", "PROXIMAL", "KL_KINDS", "LossSpec", "PRESETS", "Preset",
           "RATIO_LEVELS", "RewardRangeError", "SURROGATES", "UNBIASED_KL", "applied_entropy_coef",
           "compute_advantages", "entropy_bonus", "entropy_figures", "entropy_threshold", "gdpo_advantages",
           "get_preset", "group_advantages", "informative_groups", "kl_penalty", "loss_normalizer", "maxrl_advantages",
           "next_entropy_coef", "off_policy_sequence_mask", "policy_loss", "preset_values", "process_advantages",
           "proximal_terms", "rloo_advantages", "sampler_weights", "sampling_keep_mask", "token_logprobs", "token_logprobs_from_hidden",
           "top_entropy_mask"]
