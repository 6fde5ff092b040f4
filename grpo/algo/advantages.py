"""Advantages from rewards: group-standardised (GRPO), centred only (Dr. GRPO), batch-std (Lite PPO),
leave-one-out (RLOO), divided by the group mean (MaxRL), each reward normalised before the sum (GDPO) and process
supervision (SPEC sections 1.2, 1.3, 2, 8, 14.3, 14.4).

Rewards are laid out group by group: the G completions of one prompt are consecutive. A reward of NaN
means "no reward function applied to this completion": it is left out of its group's statistics and
gets advantage 0. Statistics are computed in float64 and the result is returned in the input's dtype.
"""
from __future__ import annotations

import torch

from grpo.algo._checks import RewardRangeError, check_choice, check_positive_int, check_tensor


SCALES = ("group", "batch", "none")  # the scales of `group_advantages`
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # of several reward functions (TRL's names)
STDS = ("sample", "population")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    check_tensor("rewards", rewards, 1)
    check_positive_int("group_size", group_size)
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} elements, which is not a multiple of "
                         f"group_size={group_size}; rewards must hold whole groups laid out one after another")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float64)
    return rewards.detach().to(torch.float64).view(-1, group_size)


def _nan_std(x: torch.Tensor, valid: torch.Tensor, mean: torch.Tensor, std: str, dim: int | None):
    """NaN-aware standard deviation (`mean` from the same entries). With fewer than two valid entries the
    sample std is taken as 0 (the advantage of such a group is 0 anyway, since r equals its mean)."""
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    n = valid.sum(dim=dim, keepdim=dim is not None).to(x.dtype)
    denom = (n - 1).clamp(min=1) if std == "sample" else n.clamp(min=1)
    return (sq.sum(dim=dim, keepdim=dim is not None) / denom).sqrt()


def _group_centre(g: torch.Tensor):
    valid = ~torch.isnan(g)
    n = valid.sum(dim=1, keepdim=True)
    mean = torch.where(valid, g, torch.zeros_like(g)).sum(dim=1, keepdim=True) / n.clamp(min=1)
    # A group whose valid rewards are all equal gets exactly 0: (r - mean) can be a rounding error away
    # from 0 (0.1 * 3 / 3 != 0.1), and dividing that by a tiny std would blow it up.
    big = torch.finfo(g.dtype).max
    lo = torch.where(valid, g, torch.full_like(g, big)).amin(dim=1, keepdim=True)
    hi = torch.where(valid, g, torch.full_like(g, -big)).amax(dim=1, keepdim=True)
    centred = torch.where(valid & (hi > lo), g - mean, torch.zeros_like(g))
    return centred, valid, mean


def group_advantages(rewards: torch.Tensor, group_size: int, spec: AdvantageSpec) -> torch.Tensor:
    """Group-relative advantages, shape (N,) → (N,), as `spec.scale`, `spec.std` and `spec.eps` say.

    scale="group": (r − mean_g) / (std_g + eps), DeepSeekMath §4.1.2 (SPEC 12).
    scale="batch": (r − mean_g) / (std over the whole batch of raw rewards + eps) ("Lite PPO").
    scale="none":  r − mean_g (Dr. GRPO).
    std="sample" divides the squared deviations by n − 1 (TRL, verl, oat), "population" by n.

    Example: rewards [1, 0, 0, 1] with G = 4 → [0.865875, −0.865875, −0.865875, 0.865875]
    (mean 0.5, sample std √(1/3) = 0.577350, plus eps 1e-4). [1, 1, 1, 1] → exactly [0, 0, 0, 0].
    """
    check_choice("scale", spec.scale, SCALES)
    scale, std, eps = spec.scale, spec.std, spec.eps
    g = _grouped(rewards, group_size)
    centred, valid, mean = _group_centre(g)
    if scale == "none":
        adv = centred
    elif scale == "group":
        adv = centred / (_nan_std(g, valid, mean, std, dim=1) + eps)
    else:
        batch_mean = torch.where(valid, g, torch.zeros_like(g)).sum() / valid.sum().clamp(min=1)
        adv = centred / (_nan_std(g, valid, batch_mean, std, dim=None) + eps)
    adv = torch.where(torch.isfinite(adv), adv, torch.zeros_like(adv))  # 0/0 when eps = 0 and std = 0
    return adv.reshape(-1).to(_out_dtype(rewards))


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages (RLOO, SPEC 8): r_i − mean of the other G − 1 rewards = G/(G−1)·(r_i − mean).

    Example: [1, 0, 0, 1] → [0.666667, −0.666667, −0.666667, 0.666667]; [1, 0, 0, 0] → [1, −⅓, −⅓, −⅓].
    NaN rewards are left out: n valid rewards give n/(n−1)·(r_i − mean of the valid ones).
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 for leave-one-out advantages, got {group_size!r}")
    g = _grouped(rewards, group_size)
    centred, valid, _ = _group_centre(g)
    n = valid.sum(dim=1, keepdim=True).to(g.dtype)
    adv = torch.where(n > 1, centred * n / (n - 1).clamp(min=1), torch.zeros_like(centred))
    return adv.reshape(-1).to(_out_dtype(rewards))


def maxrl_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """MaxRL's advantages (SPEC 14.3): (r_i − r̄)/r̄ with r̄ the group's mean reward, for rewards in [0, 1] (a
    success rate); a group with r̄ = 0, or whose rewards are all equal, gets 0. No ε, and no batch
    normalisation after it (which would undo the 1/r̄ weighting of hard prompts).

    Example: G = 4, [1, 0, 0, 0] → [3, −1, −1, −1]; [1, 1, 1, 0] → [⅓, ⅓, ⅓, −1]; [1, 1, 0, 0] → [1, 1, −1, −1];
    [0, 0, 0, 0] → 0. NaN rewards are left out of r̄ and get 0.
    """
    g = _grouped(rewards, group_size)
    centred, valid, mean = _group_centre(g)
    outside = valid & ((g < 0) | (g > 1))
    if outside.any():
        raise RewardRangeError(f"algo.scale=maxrl needs every reward in [0, 1] (MaxRL divides by the group's mean "
                        f"reward, a success rate), and a completion's reward is {g[outside][0].item():g}; use "
                        "rewards in [0, 1] or another algo.scale")
    adv = torch.where(mean > 0, centred / mean.clamp(min=torch.finfo(g.dtype).tiny), torch.zeros_like(centred))
    return adv.reshape(-1).to(_out_dtype(rewards))


def gdpo_advantages(per_fn: torch.Tensor, weights, group_size: int, spec: AdvantageSpec) -> torch.Tensor:
    """GDPO (SPEC 14.4): normalise each reward within its group, take the weighted sum, normalise the batch.
    (N, K) rewards of K functions, unweighted (NaN where a function does not apply), and K weights → (N,).

    1. per function and group: (r − mean_g)/(std_g + eps) over the group's scored values (`spec.std`, `spec.eps`);
       an unscored value, and every value of a function that scores at most one completion of the group, adds 0;
    2. s = Σ_k w_k·Ã_k; a row that no function scores has no s (NaN);
    3. over the batch (every row given, i.e. the gathered step): (s − mean s)/(std s + eps), over the rows with an
       s; the others get 0.

    Example: one group c = (1, 1, 0, 0), f = (0, 0.1, 0, 0.1), w = (1, 1), eps 1e-4 →
    (0.000954, 1.224658, −1.224658, −0.000954), where summing first gives (0.775421, 0.947737, −0.947737, −0.775421).
    """
    check_tensor("per_fn", per_fn, 2)
    weights = torch.as_tensor(list(weights), dtype=torch.float64)
    if weights.shape != (per_fn.shape[1],):
        raise ValueError(f"weights has {weights.numel()} entries for {per_fn.shape[1]} reward functions")
    x = per_fn.detach().to(torch.float64)
    total = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    for k in range(x.shape[1]):
        g = _grouped(x[:, k], group_size)
        centred, valid, mean = _group_centre(g)
        a = centred / (_nan_std(g, valid, mean, spec.std, dim=1) + spec.eps)
        scored = valid & (valid.sum(dim=1, keepdim=True) > 1) & torch.isfinite(a)
        total += weights[k] * torch.where(scored, a, torch.zeros_like(a)).reshape(-1)
    has = ~torch.isnan(x).all(dim=1)
    n = has.sum()
    mean = torch.where(has, total, torch.zeros_like(total)).sum() / n.clamp(min=1)
    std = _nan_std(total, has, mean, spec.std, dim=None)
    adv = torch.where(has, (total - mean) / (std + spec.eps), torch.zeros_like(total))
    adv = torch.where(torch.isfinite(adv), adv, torch.zeros_like(adv))
    return adv.to(_out_dtype(per_fn))


def process_advantages(step_rewards: torch.Tensor, step_ends: torch.Tensor, group_size: int, num_tokens: int,
                       spec: AdvantageSpec) -> torch.Tensor:
    """Process-supervision advantages (DeepSeekMath §4.1.3, SPEC 1.3), per token: (N, K), (N, K) → (N, T).

    Args:
        step_rewards: (N, K) reward of each reasoning step of each completion; completions with fewer than
            K steps are padded (any value) and marked by a step end of -1.
        step_ends: (N, K) integer index of the *last* token of each step, 0-based in completion positions,
            or -1 for a padding step. Steps need not be sorted.
        group_size: G; the N completions are laid out group by group.
        num_tokens: T, the completion length of the returned tensor.
        spec: its `std` and `eps` as in `group_advantages`; the statistics pool all step rewards of the group's G
            outputs.

    Token t of completion i gets the sum of the normalised rewards of every step of i that ends at or after t;
    tokens after the last step end get 0.

    Example (SPEC 1.3): G = 2, o1 steps end at tokens 2 and 5 (0-based) with rewards 0.9, 0.2; o2 one step
    ending at 3 with reward 0.5 → o1 tokens 0–2: 0.094916, tokens 3–5: −0.949158; o2 tokens 0–3: −0.094916
    (eps = 0 here; the pooled mean is 0.533333, the sample std 0.351188).
    """
    std, eps = spec.std, spec.eps
    check_tensor("step_rewards", step_rewards, 2)
    check_tensor("step_ends", step_ends, 2)
    if step_ends.shape != step_rewards.shape:
        raise ValueError(f"step_ends has shape {tuple(step_ends.shape)} but step_rewards has shape "
                         f"{tuple(step_rewards.shape)}; they must match")
    if step_ends.is_floating_point():
        raise TypeError("step_ends must be an integer tensor of token indices")
    check_positive_int("num_tokens", num_tokens)
    if step_ends.numel() and int(step_ends.max()) >= num_tokens:
        raise ValueError(f"step_ends holds an index >= num_tokens={num_tokens}")
    n, k = step_rewards.shape
    g = _grouped(step_rewards.reshape(-1), check_positive_int("group_size", group_size) * k)
    if n % group_size:
        raise ValueError(f"step_rewards has {n} rows, not a multiple of group_size={group_size}")
    valid = (step_ends >= 0).reshape(g.shape)
    g = torch.where(valid, g, torch.full_like(g, float("nan")))
    centred, valid, mean = _group_centre(g)
    norm = centred / (_nan_std(g, valid, mean, std, dim=1) + eps)
    norm = torch.where(torch.isfinite(norm) & valid, norm, torch.zeros_like(norm)).view(n, k)
    t = torch.arange(num_tokens, device=step_ends.device)
    covers = step_ends.unsqueeze(-1) >= t  # (N, K, T): step j ends at or after token t
    adv = (norm.unsqueeze(-1) * covers).sum(dim=1)  # (N, T)
    return adv.to(_out_dtype(step_rewards))


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups carry a learning signal: (N,) rewards → (N / G,) bool, True where the group's valid (non-NaN)
    rewards are not all equal. The filter of DAPO's dynamic sampling (SPEC 13.8, 14.10): a property of the whole
    group, whatever the baseline (under a leave-one-out baseline [1, 0, 0, 0] is kept whole, though the first
    row's siblings are all equal), decided by exact comparison, never by a floating std; a group with fewer than
    two valid rewards is not informative, and a NaN never enters the comparison ((1, 1, NaN, 1) is dropped).

    Example: G = 4, rewards [1, 0, 0, 1, 1, 1, 1, 1, 0.5, 0.5, nan, 0.5] → [True, False, False].
    """
    g = _grouped(rewards, group_size)
    valid = ~torch.isnan(g)
    big = torch.finfo(g.dtype).max
    lo = torch.where(valid, g, torch.full_like(g, big)).amin(dim=1)
    hi = torch.where(valid, g, torch.full_like(g, -big)).amax(dim=1)
    return hi > lo


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


# `AdvantageSpec.scale` → the function that computes the outcome advantages: (rewards, G, spec) → (N,)
ADVANTAGES = {
    "group": group_advantages,
    "batch": group_advantages,
    "none": group_advantages,
    "rloo": lambda rewards, group_size, spec: rloo_advantages(rewards, group_size),  # std and eps do not apply
    "maxrl": lambda rewards, group_size, spec: maxrl_advantages(rewards, group_size),  # nor here
}


def compute_advantages(rewards: torch.Tensor, group_size: int, spec: AdvantageSpec) -> torch.Tensor:
    """One entry point for the trainer: the outcome advantages of `spec.scale` (`ADVANTAGES`), (N,) → (N,)."""
    return ADVANTAGES[spec.scale](rewards, group_size, spec)
