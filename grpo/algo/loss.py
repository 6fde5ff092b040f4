"""The GRPO-family policy loss: a surrogate of the ratio to the behaviour policy (`grpo.algo.surrogates`), plus
β·KL to a frozen reference, aggregated with an explicit normaliser (SPEC sections 1.4, 2.2, 3, 4, 6, 12).

"Loss" is the quantity minimised, the negative of the papers' objective. Old log-probs, reference
log-probs and advantages are treated as constants (detached here), whatever the caller passes.

Every choice comes from one `LossSpec` (`grpo.algo.specs`), and each kind of choice is a registry keyed by the
spec's value: `KL_KINDS` (`spec.kl_kind`), `RATIO_LEVELS` (`spec.ratio_level`), `AGGREGATIONS`
(`spec.aggregation`) and `grpo.algo.surrogates.SURROGATES` (`spec.surrogate`). A new kind is one entry in its
registry and one value of its config option; `policy_loss` and the learner do not change.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from grpo.algo._checks import check_choice, check_same_shape, check_tensor
from grpo.algo.surrogates import SURROGATES


# ---------------------------------------------------------------------------------------------------------
# KL estimators (Schulman 2020, SPEC 6): (ℓ, ℓ_ref) → per-token estimate of KL(π_θ‖π_ref)

def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    x = ref_logp - logp
    return torch.expm1(x) - x  # expm1: exact near 0, and never below x, so k3 >= 0 in floating point too


KL_KINDS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) from the log-probs of sampled tokens (Schulman 2020, SPEC 6).

    k1 = ℓ − ℓ_ref; k2 = ½(ℓ − ℓ_ref)²; k3 = e^(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1 (DeepSeekMath eq. 4, always ≥ 0).
    Gradients flow through both arguments; `policy_loss` detaches the reference.

    Example: ℓ_ref − ℓ = ln 0.5 → k3 = 0.5 − ln 0.5 − 1 = 0.193147.
    """
    check_choice("kind", kind, KL_KINDS)
    check_tensor("logp", logp, (1, 2, 3))
    check_same_shape("ref_logp", ref_logp, "logp", logp)
    return KL_KINDS[kind](logp, ref_logp)


# ---------------------------------------------------------------------------------------------------------
# ratio levels: (ℓ − ℓ_old on the loss tokens, ℓ, mask) → the log-ratio per token

def _token_ratio(log_ratio: torch.Tensor, lp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _sequence_ratio(log_ratio: torch.Tensor, lp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GSPO: the length-normalised sequence ratio s_i in the GSPO-token form sg[s_i]·π_θ/sg[π_θ], whose value is
    s_i and whose gradient is s_i·∇ℓ_t."""
    seq_log_ratio = (log_ratio * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return seq_log_ratio.detach() + lp - lp.detach()


RATIO_LEVELS = {"token": _token_ratio, "sequence": _sequence_ratio}

# the KL term: plain k, or DeepSeek-V3.2's unbiased r·k (r live, to π_prox), or also weighted by the detached
# behaviour weight (SPEC 14.5, 14.13)
UNBIASED_KL = ("off", "prox", "behaviour")


def off_policy_sequence_mask(logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                             threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (OPSM, SPEC 14.5): (B, T) → (B, T) bool, False on the tokens of a
    sequence whose policy term is dropped. A sequence is dropped when its advantage is negative and
    Σ_t m·(ℓ_beh − sg ℓ) / max(1, Σ_t m) > `threshold` (strict): the k1 estimate of KL(π_beh‖π_θ) along the
    sequence, over its loss tokens. Per-token advantages (process supervision) decide token by token.

    Example (SPEC 14.5, δ = 0.5, Â < 0): ℓ_beh = (−0.2, −0.4, −0.1), ℓ = (−1.5, −0.9, −0.3): mean 0.666667 > δ,
    dropped; (−0.6, −1.0) against (−0.8, −1.3): 0.25, kept; with Â ≥ 0 the first is kept too.
    """
    valid = mask.bool()
    m = valid.to(logp.dtype)
    drift = torch.where(valid, behaviour_logp.detach().to(logp.dtype) - logp.detach(), torch.zeros_like(m))
    statistic = drift.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    a = adv.unsqueeze(1) if adv.dim() == 1 else adv
    return (~((a < 0) & (statistic > threshold))).expand(logp.shape)


# ---------------------------------------------------------------------------------------------------------
# aggregations: the step-wide denominator, and the numerator of a batch

class Aggregation(NamedTuple):
    normalizer: Callable[[int, int, LossSpec], float]        # (sequences, tokens, spec) of the whole step
    total: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (per-token values × mask, mask) → the sum


def _sequence_means(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x.sum(1) / m.sum(1).clamp(min=1)).sum()


def _token_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x.sum()


def _constant(num_sequences: int, num_tokens: int, spec: LossSpec) -> float:
    return float(max(1, num_sequences) * spec.max_completion_length)


AGGREGATIONS = {
    # DeepSeekMath eq. 3: each sequence's token mean, summed, over the number of sequences
    "seq_mean": Aggregation(lambda sequences, tokens, spec: float(max(1, sequences)), _sequence_means),
    # DAPO eq. 8: every token summed, over the number of loss tokens
    "token_mean": Aggregation(lambda sequences, tokens, spec: float(max(1, tokens)), _token_sum),
    # Dr. GRPO: every token summed, over sequences × max_completion_length
    "constant": Aggregation(_constant, _token_sum),
    # LUSPO (arXiv 2602.05261; TRL's loss_type="luspo"): each sequence's mean times its length, Σ_i |o_i|·L_i, i.e.
    # every token summed, over the number of sequences (with ratio_level="sequence" L_i is GSPO's term)
    "luspo": Aggregation(lambda sequences, tokens, spec: float(max(1, sequences)), _token_sum),
}


def loss_normalizer(spec: LossSpec, *, num_sequences: int, num_tokens: int) -> float:
    """The denominator of `spec.aggregation` over a whole optimiser step (SPEC 12).

    seq_mean: the number of sequences (each sequence's token mean is summed, then divided by this).
    token_mean: the number of loss-bearing tokens (at least 1). constant: sequences × max_completion_length.
    luspo: the number of sequences (every token summed: each sequence's mean weighted by its length).
    The trainer counts these over all micro-batches and ranks of a step and passes the result to
    `policy_loss(normalizer=...)`, so the summed micro-batch losses equal the loss of the whole step.
    """
    return AGGREGATIONS[spec.aggregation].normalizer(num_sequences, num_tokens, spec)


# ---------------------------------------------------------------------------------------------------------
# the loss

def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, spec: LossSpec, *,
                ref_logp: torch.Tensor | None = None, normalizer: float | None = None,
                is_weight: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                behaviour_logp: torch.Tensor | None = None,
                kl_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Surrogate loss with a KL penalty: (B, T) log-probs → (scalar loss, stats).

    Args:
        logp: (B, T) log-probs of the completion tokens under the policy being trained (differentiable).
        old_logp: (B, T) log-probs under the behaviour policy; pass ``logp.detach()`` when μ = 1.
        adv: (B,) outcome advantages, or (B, T) per-token advantages (process supervision).
        mask: (B, T) 1 for loss-bearing completion tokens, 0 for padding (bool or 0/1 floats).
        spec: the algorithm's choices (`LossSpec`): β and the KL estimator, the ratio level, the surrogate and its
            knobs (ε_low, ε_high, the dual clip, SAPO's τ), the aggregation.
        ref_logp: (B, T) reference log-probs; required when spec.beta > 0 (and used for the `kl` stat if given).
        normalizer: the aggregation's denominator for the whole optimiser step (`loss_normalizer`); None
            takes it from this batch alone.
        is_weight: (B, T) sampler–trainer correction weights (`grpo.algo.sampler_weights`, SPEC 13.1), detached
            and multiplied into the policy term after clipping; into the KL term only with
            spec.unbiased_kl="behaviour" (SPEC 14.13); None means 1.
        keep: (B, T) 0/1 weights of the policy term alone (top-entropy masking, SPEC 13.5); None means 1.
        behaviour_logp: (B, T) ℓ_beh of OPSM (spec.off_policy_mask_threshold): the sampler's log-probs where it
            reports them; None takes `old_logp` (ℓ_prox), so with μ = 1 OPSM never fires.
        kl_logp: (B, T) the policy's log-probs for the KL term when they differ from `logp` (differentiable): under
            truncated sampling `logp` and `old_logp` are renormalised over the sampler's kept set while the KL
            stays full-vocabulary (SPEC 14.12); None takes `logp`.

    Per token: L = −M·P(r, Â)·w·keep + β·KL, with P the surrogate (`grpo.algo.surrogates`), r the ratio to the
    old policy, per token or per sequence (`RATIO_LEVELS`), M OPSM's sequence mask (1 when off), and KL k3 (or
    the estimator of spec.kl_kind), r·k3 with spec.unbiased_kl="prox" (r not detached: the reverse-KL gradient,
    SPEC 14.5) or sg(w)·r·k3 with "behaviour"; the sum over tokens is divided as `AGGREGATIONS` says. Masked
    tokens (OPSM, keep, w = 0) stay in the normaliser.

    Returns the loss and detached stats: "loss/policy" and "loss/kl" (the two parts of the loss, same
    normaliser), then the means over the loss tokens "kl" (KL per token), "ratio/mean", "clip/frac",
    "clip/low_frac", "clip/high_frac" (shares of tokens whose clip binds; for CISPO those whose weight is
    truncated, of either sign of Â; 0 for SAPO, which has no clip) and any share the surrogate adds
    ("clip/dual_frac" with a dual clip), "opsm/masked_frac" with OPSM (the loss tokens of dropped sequences), and
    last "tokens" (number of loss-bearing tokens). Nothing here waits
    for the device unless `normalizer` is None.

    Example (SPEC 7.2, β = 0.04, ε = 0.2): two sequences of lengths 2 and 3, Â = ±0.866025 → loss
    −0.062644 with seq_mean, 0.124365 with token_mean, 0.077728 with constant (L_max = 4).
    """
    check_tensor("logp", logp, 2)
    check_same_shape("old_logp", old_logp, "logp", logp)
    check_same_shape("mask", mask, "logp", logp)
    check_tensor("adv", adv, (1, 2))
    if adv.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"adv has shape {tuple(adv.shape)}; with logp of shape {tuple(logp.shape)} it must be "
                         f"({logp.shape[0]},) or {tuple(logp.shape)}")
    if ref_logp is not None:
        check_same_shape("ref_logp", ref_logp, "logp", logp)
    for name, x in (("is_weight", is_weight), ("keep", keep), ("behaviour_logp", behaviour_logp),
                    ("kl_logp", kl_logp)):
        if x is not None:
            check_same_shape(name, x, "logp", logp)
    if spec.beta > 0 and ref_logp is None:
        raise ValueError(f"beta={spec.beta} > 0 needs ref_logp (the reference model's log-probs)")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer!r}")

    valid = mask.bool()
    m = valid.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Sanitise padding first so that garbage there (even inf) reaches neither the value nor the gradient.
    lp = torch.where(valid, logp, zero)
    old = torch.where(valid, old_logp.detach(), zero)
    a = torch.where(valid, (adv.unsqueeze(1) if adv.dim() == 1 else adv).detach().to(logp.dtype), zero)

    ratio = torch.exp(RATIO_LEVELS[spec.ratio_level](lp - old, lp, m))
    term = SURROGATES[spec.surrogate](ratio, a, lp, spec)
    policy = term.value
    weight = torch.where(valid, is_weight.detach().to(logp.dtype), zero) if is_weight is not None else None
    if weight is not None:
        policy = policy * weight
    if keep is not None:
        policy = policy * torch.where(valid, keep.detach().to(logp.dtype), zero)
    shares = dict(term.shares)
    if spec.off_policy_mask_threshold is not None:
        beh = old if behaviour_logp is None else torch.where(valid, behaviour_logp.detach(), zero)
        kept = off_policy_sequence_mask(lp, beh, adv.detach().to(logp.dtype) if adv.dim() == 1 else a, valid,
                                        spec.off_policy_mask_threshold)
        policy = policy * kept.to(logp.dtype)
        shares["opsm/masked_frac"] = ~kept
    per_token = -policy

    kl = None
    if ref_logp is not None:
        kl = kl_penalty(lp if kl_logp is None else torch.where(valid, kl_logp, zero),
                        torch.where(valid, ref_logp.detach(), zero), spec.kl_kind)
        if spec.unbiased_kl != "off":  # r·k: r to π_prox, not detached (SPEC 14.5)
            kl = ratio * kl
            if spec.unbiased_kl == "behaviour" and weight is not None:
                kl = weight * kl
    if spec.beta > 0:
        per_token = per_token + spec.beta * kl

    aggregation = AGGREGATIONS[spec.aggregation]
    if normalizer is None:  # the library's one-batch use; the trainer always passes the step's
        normalizer = aggregation.normalizer(logp.shape[0], int(valid.sum()), spec)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return aggregation.total(x * m, m) / normalizer

    loss = reduce(per_token)
    with torch.no_grad():
        count = valid.sum()
        denom = count.clamp(min=1)  # a tensor: the figures never wait for the device
        low, high = term.low & valid, term.high & valid
        stats = {
            "loss/policy": reduce(-policy),
            "loss/kl": spec.beta * reduce(kl) if kl is not None else zero.clone(),
            "kl": (kl * m).sum() / denom if kl is not None else zero.clone(),
            "ratio/mean": (ratio * m).sum() / denom,
        }
        low_frac, high_frac = low.sum().to(logp.dtype) / denom, high.sum().to(logp.dtype) / denom
        stats.update({"clip/frac": low_frac + high_frac, "clip/low_frac": low_frac, "clip/high_frac": high_frac})
        stats.update({name: (share & valid).sum().to(logp.dtype) / denom for name, share in shares.items()})
        stats["tokens"] = count.to(torch.float32)
    return loss, {k: v.detach() for k, v in stats.items()}
