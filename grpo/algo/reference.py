"""Reference resets as a pure rule on parameters (SPEC 13.6): θ_ref ← α·θ + (1 − α)·θ_ref. α = 1 is
DeepSeekMath's iterative GRPO (Algorithm 1: the reference becomes the current policy); α < 1 is the soft update
of TR-DPO and TRL's `sync_ref_model`. It mixes parameters, not distributions.

With LoRA the reference is the base model (the adapter disabled), so a reset moves the base instead: it takes
α of the adapter's merged update ΔW = s·B·A (mixing ΔW, never the factors, whose product would not mix
linearly), and B is scaled by 1 − α so that the policy, base + ΔW, is unchanged.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def mix_into(reference: torch.Tensor, policy: torch.Tensor, alpha: float) -> None:
    """reference ← α·policy + (1 − α)·reference, in place (α = 1 copies exactly).

    Example (SPEC 13.6): θ = 2, θ_ref = 0, α = 0.6 → 1.2; again → 1.68; α = 1 → 2.
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    if reference.shape != policy.shape:
        raise ValueError(f"reference has shape {tuple(reference.shape)} but policy has {tuple(policy.shape)}")
    if alpha == 1:
        reference.copy_(policy)
    else:
        reference.lerp_(policy.to(reference.dtype), alpha)


@torch.no_grad()
def move_base_into_adapter_share(base: torch.Tensor, lora_b: torch.Tensor, delta: torch.Tensor, alpha: float) -> None:
    """LoRA: base ← base + α·ΔW and B ← (1 − α)·B, in place, so that base + ΔW (the policy) is unchanged and the
    reference (the base) becomes α·policy + (1 − α)·reference. `delta` is ΔW = s·B·A before the call.

    Example (SPEC 13.6's factors): B = 2, A = 3, s = 1, base 0.5 (the reference), α = 0.6 → base 0.5 + 0.6·6 =
    4.1 = 0.6·6.5 + 0.4·0.5, and B = 0.8, so base + s·B·A = 4.1 + 2.4 = 6.5, the policy as before.
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    base.add_(delta.to(base.dtype), alpha=alpha)
    lora_b.mul_(1 - alpha)
