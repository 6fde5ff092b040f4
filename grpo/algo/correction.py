"""The sampler–trainer mismatch correction (SPEC 13.1, our choices 13.8).

An inference engine (vLLM) and the trainer compute slightly different log-probs for the same weights: other
kernels, other precision. The completions come from the engine's distribution π_smp, so the exact ratio
π_θ/π_smp factorises into the PPO ratio π_θ/π_old (clipped as usual) and the mismatch ratio
ρ = π_old/π_smp = exp(ℓ_old − ℓ_smp), which is detached and multiplies the policy term only (never the KL):

    L_t = sg(w_t) · P_t + β · k3_t

`sampler_weights` turns the two log-prob tensors into the weights w:

    none       w = 1
    token_tis  w = clamp(ρ_t, C_min, C)                truncated importance sampling (Yao et al. 2025; verl,
                                                       TRL's lower bound; C_min = 0 is verl's min(ρ_t, C))
    token_mis  w = ρ_t · 1[C_min ≤ ρ_t ≤ C]            masked importance sampling (IcePop)
    seq_tis    w = clamp(ρ_i, C_min, C) on o_i's tokens ρ_i = exp Σ_t (ℓ_old − ℓ_smp), the product of token ratios
    seq_mis    w = ρ_i · 1[C_min ≤ ρ_i ≤ C]

A masked token gets w = 0 but stays in the loss normaliser (as TRL does), so switching a correction on never
changes which tokens count. Ratios are formed in log space, so no ratio overflows however long the sequence.

Example (SPEC 13.1): ℓ_old = −2.00, ℓ_smp = −3.10 → ρ = e^1.1 = 3.004166; token TIS with C = 2 gives 2.0,
token MIS with C = 2 gives 0.
"""
from __future__ import annotations

import math
import torch

from grpo.algo._checks import check_same_shape, check_tensor


# the weights of each mode from the log-ratio log ρ: (log ρ, valid, mask as floats, log C_min, log C) → (weight,
# the tokens whose weight the cap, the floor or the mask changed)

def _one(log_ratio, valid, m, log_floor, log_cap):
    return m.clone(), torch.zeros_like(valid)


def _truncated(log_ratio, valid, m, log_floor, log_cap):
    return (torch.exp(log_ratio.clamp(min=log_floor, max=log_cap)),
            (log_ratio > log_cap) | (log_ratio < log_floor))


def _masked(log_ratio, valid, m, log_floor, log_cap):
    keep = (log_ratio <= log_cap) & (log_ratio >= log_floor)
    return torch.where(keep, torch.exp(log_ratio.clamp(max=log_cap)), torch.zeros_like(log_ratio)), ~keep


# `LossSpec.sampler_correction` → (whether ρ is the sequence's product, the weight rule)
CORRECTIONS = {"none": (False, _one), "token_tis": (False, _truncated), "token_mis": (False, _masked),
               "seq_tis": (True, _truncated), "seq_mis": (True, _masked)}


# `LossSpec.proximal`: what the ratio of a batch whose sampler reported log-probs is taken to (SPEC 14.1)
PROXIMAL = ("recompute", "behaviour")


def proximal_terms(old_logp: torch.Tensor, sampler_logp: torch.Tensor | None, mask: torch.Tensor, spec: LossSpec
                   ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None]:
    """(π_prox's log-probs, the detached sampler weight or None, the mismatch figures or None) of a batch.

    Decoupled PPO (SPEC 14.1, `spec.proximal="recompute"`): the ratio is to the trainer's recompute `old_logp`
    (ℓ_prox, at the weights before the batch's first update) and the policy term is weighted by `sampler_weights`
    of ℓ_prox against the engine's ℓ_beh, whatever the version that sampled: with a fresh batch (η = 0) this is
    §13.1's correction symbol for symbol, and with a stale one the weight also carries the policy's lag. The
    coupled form (`"behaviour"`) clips around ℓ_beh itself and has no weight. Without sampler log-probs (the
    in-process generator) both are the recompute with no weight."""
    if sampler_logp is None:
        return old_logp, None, None
    weight, figures = sampler_weights(old_logp, sampler_logp, mask, spec)
    if spec.proximal == "behaviour":  # the figures still say how far the sampler is from the trainer
        return sampler_logp.detach(), None, figures
    return old_logp, weight, figures


def sampler_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                    spec: LossSpec) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B, T) trainer and sampler log-probs of the sampled tokens → (B, T) detached weights w, and figures.

    Args:
        old_logp: ℓ_old, the trainer's log-probs at the weights the sampler was given.
        sampler_logp: ℓ_smp, the log-probs the sampling engine reported.
        mask: (B, T) 1 on loss tokens; the weight is 0 elsewhere.
        spec: its `sampler_correction` (one of `CORRECTIONS`), `sampler_correction_cap` C > 0 (the upper bound
            (TIS) or the largest ratio kept (MIS)) and `sampler_correction_floor` C_min ≥ 0 (the lower bound (TIS)
            or the smallest ratio kept (MIS); 0: none).

    Figures (over the loss tokens, as sums so that micro-batches and processes add up; divide by "tokens"):
    "abs_diff" Σ|Δ|, "k3" Σ(ρ − 1 − log ρ) (KL(π_smp‖π_old) estimated on the tokens π_smp sampled), "capped" the
    number of tokens whose weight the cap or the mask changed, "weight" Σw; and "abs_diff_max", max |Δ|.
    """
    check_tensor("old_logp", old_logp, 2)
    check_same_shape("sampler_logp", sampler_logp, "old_logp", old_logp)
    check_same_shape("mask", mask, "old_logp", old_logp)
    per_sequence, rule = CORRECTIONS[spec.sampler_correction]
    with torch.no_grad():
        valid = mask.bool()
        m = valid.to(torch.float32)
        zero = torch.zeros((), dtype=torch.float32, device=old_logp.device)
        delta = torch.where(valid, old_logp.detach().float() - sampler_logp.detach().float(), zero)  # log ρ_t
        log_cap = math.log(spec.sampler_correction_cap)
        log_floor = math.log(spec.sampler_correction_floor) if spec.sampler_correction_floor > 0 else -math.inf
        # log ρ_i on every token of o_i, or log ρ_t
        log_ratio = (delta * m).sum(1, keepdim=True).expand_as(delta) if per_sequence else delta
        weight, changed = rule(log_ratio, valid, m, log_floor, log_cap)
        weight = weight * m
        changed = changed & valid
        k3 = torch.expm1(delta) - delta  # ρ − 1 − log ρ ≥ 0, exact near 0
        stats = {
            "abs_diff": (delta.abs() * m).sum(),
            "abs_diff_max": delta.abs().max() if delta.numel() else zero.clone(),
            "k3": (k3 * m).sum(),
            "capped": changed.sum().to(torch.float32),
            "weight": weight.sum(),
            "tokens": m.sum(),
        }
    return weight, stats
