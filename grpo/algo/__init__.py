"""The mathematics of GRPO and its variants as pure tensor functions (SPEC.md).

Nothing here knows about models, configs or process groups: tensors and plain values in, tensors out.
"""
from grpo.algo.advantages import (compute_advantages, group_advantages, informative_groups, process_advantages,
                                  rloo_advantages)
from grpo.algo.correction import CORRECTIONS, sampler_weights
from grpo.algo.entropy import entropy_figures, entropy_threshold, top_entropy_mask
from grpo.algo.logprobs import token_logprobs, token_logprobs_from_hidden
from grpo.algo.loss import kl_penalty, loss_normalizer, policy_loss
from grpo.algo.presets import PRESETS, Preset, get_preset, preset_values

__all__ = ["CORRECTIONS", "PRESETS", "Preset", "compute_advantages", "entropy_figures", "entropy_threshold",
           "get_preset", "preset_values", "group_advantages", "informative_groups", "top_entropy_mask",
           "kl_penalty", "loss_normalizer", "policy_loss",
           "process_advantages", "rloo_advantages", "sampler_weights", "token_logprobs", "token_logprobs_from_hidden"]
