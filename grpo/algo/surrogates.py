"""The policy term per token, chosen by `algo.surrogate` (SPEC sections 1.4, 13.2-13.4, 14.2): PPO's clip (with an
optional dual clip), CISPO's truncated importance weight, SAPO's soft gate, DPPO's trust-region masks.

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


def _dppo(ratio: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, spec: LossSpec, up: torch.Tensor,
          down: torch.Tensor) -> Term:
    """DPPO's term (SPEC 14.2): sg(min(r, C))·sg(M)·Â·ℓ, REINFORCE with the importance weight to the anchor (the
    old policy) on the tokens the mask M keeps. `up`/`down`: the tokens that moved too far up/down, masked where
    Â pushes them further (Â > 0 / Â < 0)."""
    weight = ratio.detach()
    if spec.dppo_cap:
        weight = weight.clamp(max=spec.dppo_cap)
    high, low = (a > 0) & up, (a < 0) & down
    keep = ~(high | low)
    return Term(weight * keep * a * lp, low, high, {})


def _probabilities(ratio: torch.Tensor, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p = e^ℓ, q = e^ℓa of the anchor (ℓa = ℓ − log r) and ℓa, detached, in the log-probs' dtype."""
    lp = lp.detach()
    anchor = lp - torch.log(ratio.detach())
    return lp.exp(), anchor.exp(), anchor


def dppo_tv(ratio: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, spec: LossSpec) -> Term:
    """DPPO with the binary total-variation mask: a token is masked when p − q > δ_high with Â > 0, or q − p > δ_low
    with Â < 0 (strict), p = e^ℓ and q the anchor's probability of the sampled token."""
    p, q, _ = _probabilities(ratio, lp)
    return _dppo(ratio, a, lp, spec, p - q > spec.dppo_tv_high, q - p > spec.dppo_tv_low)


def dppo_kl(ratio: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, spec: LossSpec) -> Term:
    """DPPO with the binary KL mask: D = q(ℓa − ℓ) + (1 − q)·log((1 − q + 1e-8)/(1 − p + 1e-8)) (verl's placement of
    1e-8: finite at p = 1); masked when p > q and D > δ_high with Â > 0, or p < q and D > δ_low with Â < 0."""
    p, q, anchor = _probabilities(ratio, lp)
    d = q * (anchor - lp.detach()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return _dppo(ratio, a, lp, spec, (p > q) & (d > spec.dppo_kl_high), (p < q) & (d > spec.dppo_kl_low))


SURROGATES = {"clip": clip, "cispo": cispo, "sapo": sapo, "dppo_tv": dppo_tv, "dppo_kl": dppo_kl}
