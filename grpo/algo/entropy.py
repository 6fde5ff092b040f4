"""The policy's per-token entropy as figures and as a mask (SPEC 13.5): the entropies themselves come from the
chunked log-prob pass (`token_logprobs_from_hidden(..., entropy=True)`), never from a (B, T, V) tensor.

Top-entropy masking (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv:2506.01939; TRL's `top_entropy_quantile`):
only the highest-entropy fraction ρ of the tokens carries the policy gradient. The threshold is the (1 − ρ)
quantile of the entropies of every loss token of the optimiser step (all micro-batches and processes: the
trainer gathers them), so the result depends on neither the micro-batch size nor the number of processes.
"""
from __future__ import annotations

import torch

from grpo.algo._checks import check_same_shape, check_tensor

QUARTERS = 4  # entropy by position: each episode's tokens in four equal parts of its length


def entropy_threshold(values: torch.Tensor, keep: float) -> float:
    """The entropy at or above which the top `keep` fraction of `values` lies: their (1 − keep) quantile, linearly
    interpolated (torch.quantile, as TRL). `keep` = 1 gives the smallest value, so every token is kept.

    Example (SPEC 13.5): entropies 0.10, 2.30, 0.05, 1.20, 0.40, 0.02, 3.10 and keep 0.2 → 2.08 (position 4.8
    of the sorted seven, between 1.20 and 2.30), keeping 2.30 and 3.10.
    """
    check_tensor("values", values, 1)
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep!r}")
    if values.numel() == 0:
        return float("inf")
    return torch.quantile(values.double(), 1 - keep).item()


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """1.0 on the loss tokens whose entropy is at least `threshold`, else 0.0 (same shape as `entropy`)."""
    check_tensor("entropy", entropy, 2)
    check_same_shape("mask", mask, "entropy", entropy)
    return ((entropy >= threshold) & mask.bool()).to(entropy.dtype)


def position_quarters(mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) loss and episode masks → (B, T) long: the quarter 0 … 3 of each loss token by its position t in its
    episode of L tokens (`completion_mask`'s, tokens a tool inserted included), ⌊4t / L⌋; `QUARTERS` on every
    other token. A quarter of a multi-turn episode may hold no loss token at all.

    Example: an episode of 8 tokens whose tokens 2-5 a tool inserted: the model's tokens 0, 1 are in quarter 0
    and 6, 7 in quarter 3 (by their share of the loss tokens they would be in quarters 0, 1, 3, 3).
    """
    check_tensor("mask", mask, 2)
    check_same_shape("completion_mask", completion_mask, "mask", mask)
    length = completion_mask.bool().sum(1, keepdim=True).clamp(min=1)
    position = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    quarter = (position * QUARTERS // length).clamp(max=QUARTERS - 1)
    return torch.where(mask.bool(), quarter, QUARTERS)


def quarter_counts(quarters: torch.Tensor) -> torch.Tensor:
    """(B, T) quarters (`position_quarters`) → (QUARTERS,) long: the number of tokens in each; on the device."""
    return (quarters.unsqueeze(-1) == torch.arange(QUARTERS, device=quarters.device)).sum((0, 1))


def quarter_index(quarters: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """The flat positions of each quarter's tokens in row-major order, given their `counts` (known on the host,
    so that nothing waits for the device: selecting by a boolean mask would)."""
    order = torch.argsort(quarters.flatten(), stable=True)  # quarter 0's tokens first, each quarter in order
    return list(order[:sum(counts)].split(counts))


def entropy_figures(entropy: torch.Tensor, mask: torch.Tensor, index: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over the loss tokens that add up over micro-batches and processes, as float64 tensors on the entropy's
    device (nothing waits for the device): "entropy" (Σ H), and for each quarter k "entropy/q{k}" (Σ H over the
    tokens at `index[k − 1]`, from `quarter_index`). Divided by the token counts, they give the mean entropy and
    the mean by position in the episode.

    Example: entropies [1, 2, 3, 4, 9] and [5, 6, 0, 0, 0] on episodes of 4 and 2 tokens, all in the loss → 21;
    by quarter 6, 2, 9, 4 (row 2's two tokens fall in quarters 1 and 3).
    """
    check_tensor("entropy", entropy, 2)
    check_same_shape("mask", mask, "entropy", entropy)
    h = torch.where(mask.bool(), entropy.double(), 0.0)
    flat = h.flatten()
    # a sum over the gathered tokens, not a masked sum over the whole batch: the same numbers in the same order
    # as indexing by a boolean mask, so the same rounding
    return {"entropy": h.sum(), **{f"entropy/q{k + 1}": flat[i].sum() for k, i in enumerate(index)}}


# ---------------------------------------------------------------------------------------------------------
# the entropy bonus (SPEC 14.7, our choices 14.13)

def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float, num_tokens: float) -> torch.Tensor:
    """−c·H̄ with H̄ = Σ m·H / N: the term added to the loss, so that minimising it raises the entropy.

    `entropy` (B, T) is the current policy's, differentiable (the training pass's, logits ÷ T); `mask` the loss
    mask (the top-entropy mask does not apply); `num_tokens` N the loss-bearing tokens of the whole optimiser
    step (every micro-batch and process), whatever the loss's aggregation, so that micro-batch terms add up.
    Nothing is detached: ∂(−c·H̄)/∂z = c·ν·p ⊙ (log p + H)/T per token, ν = m/N.

    Example (SPEC 14.7): entropies (0.10, 2.30) and (0.05, 1.20, 0.40), c = 0.01, N = 5 → −0.0081.
    """
    check_tensor("entropy", entropy, 2)
    check_same_shape("mask", mask, "entropy", entropy)
    if not coef:
        return torch.zeros((), dtype=entropy.dtype, device=entropy.device)
    h = torch.where(mask.bool(), entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
    return -coef * h.sum() / max(1.0, float(num_tokens))


def applied_entropy_coef(coef: float, last_entropy: float, spec) -> float:
    """The coefficient an optimiser step applies: `spec.entropy_coef` when fixed; adaptive (`use_adaptive_entropy`,
    TRL's rule, SPEC 14.7), the current c_k if the last step's mean entropy H_{k−1} was at or below
    `spec.entropy_target`, else 0 (and 0 at the first step, whose H_0 is +∞)."""
    if not spec.use_adaptive_entropy:
        return spec.entropy_coef
    return coef if last_entropy <= spec.entropy_target else 0.0


def next_entropy_coef(coef: float, entropy: float, spec) -> float:
    """c_{k+1} from c_k and the step's mean entropy H_k (adaptive only): c_k + Δ at or below the target, else
    c_k − Δ, kept in [entropy_coef_min, entropy_coef_max].

    Example (SPEC 14.7): c₁ = 0, Δ = 0.005, target 0.2, H = (0.5, 0.1, 0.15, 0.3) → the steps 1-5 apply (0, 0,
    0.005, 0.01, 0).
    """
    if entropy <= spec.entropy_target:
        return min(coef + spec.entropy_coef_delta, spec.entropy_coef_max)
    return max(coef - spec.entropy_coef_delta, spec.entropy_coef_min)
