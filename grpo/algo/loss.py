"""The GRPO-family policy loss: a surrogate of the ratio to the behaviour policy (PPO's clip, with an optional dual
clip; CISPO's truncated importance weight; SAPO's soft gate), plus β·KL to a frozen reference, aggregated with an
explicit normaliser (SPEC sections 1.4, 2.2, 3, 4, 6, 12, 13.2-13.4).

"Loss" is the quantity minimised, the negative of the papers' objective. Old log-probs, reference
log-probs and advantages are treated as constants (detached here), whatever the caller passes.
"""
from __future__ import annotations

import torch

from grpo.algo._checks import check_choice, check_same_shape, check_tensor

KL_KINDS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("seq_mean", "token_mean", "constant")
SURROGATES = ("clip", "cispo", "sapo")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) from the log-probs of sampled tokens (Schulman 2020, SPEC 6).

    k1 = ℓ − ℓ_ref; k2 = ½(ℓ − ℓ_ref)²; k3 = e^(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1 (DeepSeekMath eq. 4, always ≥ 0).
    Gradients flow through both arguments; `policy_loss` detaches the reference.

    Example: ℓ_ref − ℓ = ln 0.5 → k3 = 0.5 − ln 0.5 − 1 = 0.193147.
    """
    check_choice("kind", kind, KL_KINDS)
    check_tensor("logp", logp, (1, 2, 3))
    check_same_shape("ref_logp", ref_logp, "logp", logp)
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    x = ref_logp - logp
    return torch.expm1(x) - x  # expm1: exact near 0, and never below x, so k3 >= 0 in floating point too


def loss_normalizer(aggregation: str, *, num_sequences: int, num_tokens: int,
                    max_completion_length: int | None = None) -> float:
    """The denominator of an aggregation over a whole optimiser step (SPEC 12).

    seq_mean: the number of sequences (each sequence's token mean is summed, then divided by this).
    token_mean: the number of loss-bearing tokens (at least 1). constant: sequences × max_completion_length.
    The trainer counts these over all micro-batches and ranks of a step and passes the result to
    `policy_loss(normalizer=...)`, so the summed micro-batch losses equal the loss of the whole step.
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    if aggregation == "seq_mean":
        return float(max(1, num_sequences))
    if aggregation == "token_mean":
        return float(max(1, num_tokens))
    if max_completion_length is None or max_completion_length < 1:
        raise ValueError("aggregation='constant' needs max_completion_length (a positive integer), got "
                         f"{max_completion_length!r}")
    return float(max(1, num_sequences) * max_completion_length)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                ref_logp: torch.Tensor | None = None, beta: float = 0.0, clip_low: float = 0.2,
                clip_high: float = 0.2, ratio_level: str = "token", aggregation: str = "seq_mean",
                normalizer: float | None = None, max_completion_length: int | None = None,
                kl_kind: str = "k3", dual_clip: float | None = None, surrogate: str = "clip",
                sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05,
                is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Surrogate loss with a KL penalty: (B, T) log-probs → (scalar loss, stats).

    Args:
        logp: (B, T) log-probs of the completion tokens under the policy being trained (differentiable).
        old_logp: (B, T) log-probs under the behaviour policy; pass ``logp.detach()`` when μ = 1.
        adv: (B,) outcome advantages, or (B, T) per-token advantages (process supervision).
        mask: (B, T) 1 for loss-bearing completion tokens, 0 for padding (bool or 0/1 floats).
        ref_logp: (B, T) reference log-probs; required when beta > 0 (and used for the `kl` stat if given).
        beta: KL coefficient. clip_low, clip_high: ε_low, ε_high of clip(r, 1 − ε_low, 1 + ε_high).
        ratio_level: "token" (r = π_θ/π_old per token) or "sequence" (GSPO: the length-normalised sequence
            ratio s_i, in the GSPO-token form whose value is s_i and whose gradient is s_i·∇ℓ_t).
        aggregation: "seq_mean" (DeepSeekMath eq. 3: each sequence's token mean, then the mean over
            sequences), "token_mean" (DAPO: all tokens summed, divided by the token count) or "constant"
            (Dr. GRPO: all tokens summed, divided by B·max_completion_length).
        normalizer: the aggregation's denominator for the whole optimiser step (`loss_normalizer`); None
            takes it from this batch alone.
        kl_kind: "k3" (default), "k2" or "k1" (`kl_penalty`).
        dual_clip: c > 1 for dual-clip PPO (Ye et al. 2020: for Â < 0 the surrogate is at least c·Â, so a token
            with r > c has loss c·|Â| and no gradient); None disables it. Only with surrogate="clip".
        surrogate: the policy term per token, with r the ratio and Â the advantage:
            "clip" (PPO, DeepSeekMath eq. 3): −min(r·Â, clip(r, 1 − ε_low, 1 + ε_high)·Â);
            "cispo" (MiniMax-M1 2025): −sg(clip(r, 1 − ε_low, 1 + ε_high))·Â·ℓ, REINFORCE with a truncated,
            detached importance weight, so no token loses its gradient (its value scales with ℓ and is no
            progress signal; clip_low = 1 leaves it without a lower bound, as the paper does);
            "sapo" (Qwen 2025, arXiv:2511.20347): −(4/τ)·σ(τ(r − 1))·Â, a soft gate instead of the clip, with
            τ = sapo_tau_pos where Â > 0 and sapo_tau_neg elsewhere (its gradient at r = 1 is on-policy GRPO's).
        is_weight: (B, T) sampler–trainer correction weights (`grpo.algo.sampler_weights`, SPEC 13.1), detached
            and multiplied into the policy term after clipping, never into the KL term; None means 1.

    Returns the loss and detached stats: "loss/policy" and "loss/kl" (the two parts of the loss, same
    normaliser), "kl" (mean KL per token), "ratio/mean", "clip/low_frac", "clip/high_frac", "clip/frac"
    (shares of tokens whose clip binds; for CISPO those whose weight is truncated, of either sign of Â; 0 for
    SAPO, which has no clip), "clip/dual_frac" (with dual_clip: share of tokens with Â < 0 and r > c), "tokens"
    (number of loss-bearing tokens).

    Example (SPEC 7.2, β = 0.04, ε = 0.2): two sequences of lengths 2 and 3, Â = ±0.866025 → loss
    −0.062644 with seq_mean, 0.124365 with token_mean, 0.077728 with constant (L_max = 4).
    """
    check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_choice("kl_kind", kl_kind, KL_KINDS)
    check_choice("surrogate", surrogate, SURROGATES)
    check_tensor("logp", logp, 2)
    check_same_shape("old_logp", old_logp, "logp", logp)
    check_same_shape("mask", mask, "logp", logp)
    check_tensor("adv", adv, (1, 2))
    if adv.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"adv has shape {tuple(adv.shape)}; with logp of shape {tuple(logp.shape)} it must be "
                         f"({logp.shape[0]},) or {tuple(logp.shape)}")
    if ref_logp is not None:
        check_same_shape("ref_logp", ref_logp, "logp", logp)
    if is_weight is not None:
        check_same_shape("is_weight", is_weight, "logp", logp)
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if beta > 0 and ref_logp is None:
        raise ValueError(f"beta={beta} > 0 needs ref_logp (the reference model's log-probs)")
    if not 0 <= clip_low <= 1:
        raise ValueError(f"clip_low must be in [0, 1], got {clip_low!r}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip!r}")
    if dual_clip is not None and surrogate != "clip":
        raise ValueError(f"dual_clip bounds PPO's clipped surrogate; surrogate={surrogate!r} has none")
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0, got {sapo_tau_pos!r}, {sapo_tau_neg!r}")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer!r}")

    valid = mask.bool()
    m = valid.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Sanitise padding first so that garbage there (even inf) reaches neither the value nor the gradient.
    lp = torch.where(valid, logp, zero)
    old = torch.where(valid, old_logp.detach(), zero)
    a = torch.where(valid, (adv.unsqueeze(1) if adv.dim() == 1 else adv).detach().to(logp.dtype), zero)

    log_ratio = lp - old
    if ratio_level == "sequence":
        seq_log_ratio = (log_ratio * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        log_ratio = seq_log_ratio.detach() + lp - lp.detach()
    ratio = torch.exp(log_ratio)
    term, low, high = _SURROGATES[surrogate](ratio, a, lp, clip_low=clip_low, clip_high=clip_high,
                                             tau_pos=sapo_tau_pos, tau_neg=sapo_tau_neg)
    dual = None
    if dual_clip is not None:
        dual = (a < 0) & (ratio > dual_clip)
        term = torch.where(a < 0, torch.maximum(term, dual_clip * a), term)
    if is_weight is not None:
        term = term * torch.where(valid, is_weight.detach().to(logp.dtype), zero)
    per_token = -term

    kl = None
    if ref_logp is not None:
        kl = kl_penalty(lp, torch.where(valid, ref_logp.detach(), zero), kl_kind)
    if beta > 0:
        per_token = per_token + beta * kl

    b = logp.shape[0]
    n_tokens = int(valid.sum())
    if normalizer is None:
        normalizer = loss_normalizer(aggregation, num_sequences=b, num_tokens=n_tokens,
                                     max_completion_length=max_completion_length)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        x = x * m
        if aggregation == "seq_mean":
            return (x.sum(1) / m.sum(1).clamp(min=1)).sum() / normalizer
        return x.sum() / normalizer

    loss = reduce(per_token)
    with torch.no_grad():
        denom = max(1, n_tokens)
        low, high = low & valid, high & valid
        stats = {
            "loss/policy": reduce(-term),
            "loss/kl": beta * reduce(kl) if kl is not None else zero.clone(),
            "kl": (kl * m).sum() / denom if kl is not None else zero.clone(),
            "ratio/mean": (ratio * m).sum() / denom,
            "clip/low_frac": low.sum().to(logp.dtype) / denom,
            "clip/high_frac": high.sum().to(logp.dtype) / denom,
            "tokens": torch.tensor(float(n_tokens)),
        }
        stats["clip/frac"] = stats["clip/low_frac"] + stats["clip/high_frac"]
        if dual is not None:
            stats["clip/dual_frac"] = (dual & valid).sum().to(logp.dtype) / denom
    return loss, {k: v.detach() for k, v in stats.items()}


# ---------------------------------------------------------------------------------------------------------
# the surrogates: (ratio, advantage, log-prob) → the per-token objective (the loss is its negative) and the masks
# of the tokens whose clip binds below and above

def _clip(ratio, a, lp, *, clip_low, clip_high, **_):
    """PPO: min(r·Â, clip(r)·Â). Its clip binds (no gradient) for Â < 0, r < 1 − ε_low and Â > 0, r > 1 + ε_high."""
    term = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    return term, (a < 0) & (ratio < 1 - clip_low), (a > 0) & (ratio > 1 + clip_high)


def _cispo(ratio, a, lp, *, clip_low, clip_high, **_):
    """CISPO: sg(clip(r))·Â·ℓ, with gradient clip(r)·Â on every token; the weight is truncated whatever Â's sign."""
    weight = ratio.detach().clamp(1 - clip_low, 1 + clip_high)
    return weight * a * lp, ratio < 1 - clip_low, ratio > 1 + clip_high


def _sapo(ratio, a, lp, *, tau_pos, tau_neg, **_):
    """SAPO: (4/τ)·σ(τ(r − 1))·Â, τ by the sign of Â (τ_neg for Â ≤ 0, as TRL). No clip: nothing binds."""
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return 4 / tau * torch.sigmoid(tau * (ratio - 1)) * a, none, none


_SURROGATES = {"clip": _clip, "cispo": _cispo, "sapo": _sapo}
