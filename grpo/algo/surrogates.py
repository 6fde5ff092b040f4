"""The policy term per token, chosen by `algo.surrogate` (SPEC sections 1.4, 13.2-13.4): PPO's clip (with an
optional dual clip), CISPO's truncated importance weight, SAPO's soft gate.

Each surrogate maps (ratio r, advantage Â, log-prob ℓ, spec) to the per-token objective (the loss is its
negative) and the masks of the tokens whose clip binds, below and above; `SURROGATES` is keyed by the value of
`LossSpec.surrogate`. A new surrogate is a function here, its entry in `SURROGATES`, its value in the config's
`algo.surrogate`, and any knob it needs as a field of `LossSpec` and an option of `AlgoConfig`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Term(NamedTuple):
    value: torch.Tensor                 # (B, T) the objective per token, before the sampler correction
    low: torch.Tensor                   # (B, T) bool: the clip binds below ("clip/low_frac")
    high: torch.Tensor                  # (B, T) bool: the clip binds above ("clip/high_frac")
    shares: dict[str, torch.Tensor]     # more bool masks, each logged as its share of the loss tokens


def clip(ratio: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, spec: LossSpec) -> Term:
    """PPO: min(r·Â, clip(r)·Â). Its clip binds (no gradient) for Â < 0, r < 1 − ε_low and Â > 0, r > 1 + ε_high.
    With `spec.dual_clip` = c > 1 (Ye et al. 2020) the term of a token with Â < 0 is at least c·Â, so one with
    r > c has no gradient ("clip/dual_frac")."""
    term = torch.minimum(ratio * a, ratio.clamp(1 - spec.clip_low, 1 + spec.clip_high) * a)
    low, high = (a < 0) & (ratio < 1 - spec.clip_low), (a > 0) & (ratio > 1 + spec.clip_high)
    if not spec.dual_clip:
        return Term(term, low, high, {})
    dual = (a < 0) & (ratio > spec.dual_clip)
    term = torch.where(a < 0, torch.maximum(term, spec.dual_clip * a), term)
    return Term(term, low, high, {"clip/dual_frac": dual})


def cispo(ratio: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, spec: LossSpec) -> Term:
    """CISPO: sg(clip(r))·Â·ℓ, with gradient clip(r)·Â on every token; the weight is truncated whatever Â's sign."""
    weight = ratio.detach().clamp(1 - spec.clip_low, 1 + spec.clip_high)
    return Term(weight * a * lp, ratio < 1 - spec.clip_low, ratio > 1 + spec.clip_high, {})


def sapo(ratio: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, spec: LossSpec) -> Term:
    """SAPO: (4/τ)·σ(τ(r − 1))·Â, τ by the sign of Â (τ_neg for Â ≤ 0, as TRL). No clip: nothing binds."""
    tau = torch.where(a > 0, torch.full_like(a, spec.sapo_tau_pos), torch.full_like(a, spec.sapo_tau_neg))
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return Term(4 / tau * torch.sigmoid(tau * (ratio - 1)) * a, none, none, {})


SURROGATES = {"clip": clip, "cispo": cispo, "sapo": sapo}
