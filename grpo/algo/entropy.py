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

QUARTERS = 4  # entropy by position: each completion's tokens in four equal parts of its length


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


def entropy_figures(entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sums over the loss tokens that add up over micro-batches and processes: "entropy" (Σ H), and for each
    quarter k of the completions' lengths "entropy/q{k}" (Σ H of the tokens at positions t with
    ⌊4t / length⌋ = k − 1) and "entropy/q{k}_tokens" (their count). Divided, they give the mean entropy and the
    mean by position in the completion."""
    check_tensor("entropy", entropy, 2)
    check_same_shape("mask", mask, "entropy", entropy)
    m = mask.bool()
    h = torch.where(m, entropy.double(), 0.0)
    length = m.sum(1, keepdim=True).clamp(min=1)
    position = torch.arange(entropy.shape[1], device=entropy.device).unsqueeze(0)
    quarter = (position * QUARTERS // length).clamp(max=QUARTERS - 1)
    out = {"entropy": h.sum().item()}
    for k in range(QUARTERS):
        inside = m & (quarter == k)
        out[f"entropy/q{k + 1}"] = h[inside].sum().item()
        out[f"entropy/q{k + 1}_tokens"] = float(inside.sum())
    return out
