"""The figures of a training step: metrics.jsonl's row (`step_metrics`, with `episode_metrics` for multi-turn
episodes) and samples.jsonl's rows (`sample_rows`). grpo/runlog.py writes them."""
from __future__ import annotations

import torch

from grpo.algo.entropy import QUARTERS
from grpo.distributed import Dist
from grpo.experience import Experience
from grpo.runlog import finite_or_none as _finite_or_none  # NaN is null in samples.jsonl and the trackers


# ---------------------------------------------------------------------------------------------------------
# a step's figures

def step_metrics(exp: Experience, updates: list[dict], dist: Dist, *, group_size: int, seconds: float,
                 rollout_seconds: float, lr: float, sync_seconds: float = 0.0) -> dict[str, float]:
    """Figures of the whole step (every process), the update's averaged over the μ updates. A step that trained
    on nothing (dynamic sampling at its round cap without an informative group; every process alike, as each
    trains an equal share) has no reward, advantage, completion or update figures: its sampling/* ones say why."""
    rewards = exp.all_rewards
    lengths = dist.gather(exp.lengths.float().cpu())
    m: dict[str, float] = {}
    if len(exp):
        m.update({"reward/mean": _nanmean(rewards), "reward/std": _nanstd(rewards),
                  "reward/unscored_frac": rewards.isnan().float().mean().item()})  # no function scored them
        for name, values in exp.per_fn.items():
            m[f"reward/{name}"] = _nanmean(dist.gather(values))
        # groups without a policy gradient: every advantage on their loss tokens is 0 (equal rewards, for outcome
        # ones)
        signal = (exp.advantages * exp.loss_mask).ne(0).any(dim=1).view(-1, group_size).any(dim=1)
        m["adv/std_zero_frac"] = dist.gather((~signal).float().cpu()).mean().item()
    if updates:  # none: a step with nothing to train on (dynamic sampling at its cap), which has no update figures
        u = update_figures(updates, dist)
        tokens = u.pop("tokens")  # none when every token of the step is masked out: the per-token figures are NaN
        if "mismatch/abs_diff_max" in u:  # a sampler with log-probs of its own (SPEC 13.1)
            m["mismatch/abs_diff_max"] = u.pop("mismatch/abs_diff_max")
        # the sums over the loss tokens (the policy loss's means × tokens, the mismatch figures) become means
        m.update({k: v / tokens if tokens else float("nan") for k, v in u.items() if k not in _NOT_PER_TOKEN
                  and not k.startswith("entropy")})
        # the policy's entropy at the sampling temperature, over the loss tokens, and over those in each quarter of
        # their episode
        m["entropy/mean"] = u["entropy"] / tokens if tokens else float("nan")
        for q in range(1, QUARTERS + 1):
            n = u[f"entropy/q{q}_tokens"]
            m[f"entropy/q{q}"] = u[f"entropy/q{q}"] / n if n else float("nan")
        m.update({"loss": u["loss"], "loss/policy": u["loss/policy"], "loss/kl": u["loss/kl"]})
        if "loss/entropy" in u:  # the entropy bonus −c·H̄ (algo.entropy_coef), and the c applied
            m["loss/entropy"] = u["loss/entropy"]
            m["entropy/coef"] = sum(d["entropy_coef"] for d in updates) / len(updates)
        m["grad_norm"] = sum(d["grad_norm"] for d in updates) / len(updates)
    if len(exp):
        m["completion/mean_length"] = lengths.mean().item()  # episode tokens: in multi-turn ones, tool results too
        if exp.episodes is not None:  # the model's own tokens, those the loss trains on
            m["completion/mean_loss_tokens"] = dist.gather(exp.loss_mask.sum(1).float().cpu()).mean().item()
        m["completion/truncated_frac"] = dist.gather(exp.truncated.float().cpu()).mean().item()
    m["lr"] = lr
    m.update(exp.stats)
    if exp.episodes:
        m.update(episode_metrics(exp.episodes, dist))
    m["perf/step_seconds"] = seconds
    m["perf/rollout_seconds"] = rollout_seconds  # collecting: sampling, rewards, advantages
    m["perf/sync_seconds"] = sync_seconds  # the generator taking the new weights (0 for hf, which samples the policy)
    m["perf/completion_tokens"] = lengths.sum().item()  # episode tokens, as completion/mean_length
    m["perf/tokens_per_s"] = lengths.sum().item() / max(seconds, 1e-9)
    return m


# the figures of `grpo.learn` updates that are not sums over the loss tokens to be divided by their count
_NOT_PER_TOKEN = ("loss", "loss/policy", "loss/kl", "loss/entropy", "tokens")
_MAXIMA = ("mismatch/abs_diff_max",)  # the largest over updates and processes, not a sum
_PER_UPDATE = ("grad_norm", "nonfinite", "entropy_coef")  # each update's own (on every process alike)


def update_figures(updates: list[dict], dist: Dist) -> dict[str, float]:
    """The figures of the step's updates (`grpo.learn.learn`, this process's), summed over processes and averaged
    over the updates; maxima (`_MAXIMA`) are the largest of any update and process. One collective for all."""
    keys = [k for k in updates[0] if k not in _PER_UPDATE]
    mine = [max(d[k] for d in updates) if k in _MAXIMA else sum(d[k] for d in updates) for k in keys]
    rows = dist.gather(torch.tensor(mine, dtype=torch.float64)).view(dist.world_size, len(keys))
    total = rows[0]
    for row in rows[1:]:  # in rank order
        total = total + row
    total, top = total.tolist(), rows.amax(dim=0).tolist()
    return {k: top[i] if k in _MAXIMA else total[i] / len(updates) for i, k in enumerate(keys)}


def episode_metrics(episodes: list, dist: Dist) -> dict[str, float]:
    """Means over the step's multi-turn episodes (every process's): model turns, tool calls, failed calls,
    and the share of episodes that ended for each reason of `STOP_REASONS`."""
    from grpo.envs.base import STOP_REASONS

    rows = torch.tensor([[e.turns, e.tool_calls, e.tool_errors] + [float(e.stop == r) for r in STOP_REASONS]
                         for e in episodes], dtype=torch.float32)
    mean = dist.gather(rows.reshape(-1)).view(-1, rows.shape[1]).mean(dim=0).tolist()
    names = ["episode/turns", "episode/tool_calls", "episode/tool_errors"] + [f"episode/stop_{r}" for r in STOP_REASONS]
    return dict(zip(names, mean))


def sample_rows(exp: Experience, groups: int) -> list[dict]:
    """The first `groups` groups of the step for samples.jsonl: prompt, answer, completion, rewards, advantage
    (of the first token: an outcome advantage is the same on every token)."""
    rows = []
    for j in range(len(exp)):
        if int(exp.group[j]) >= groups:
            break
        e = exp.examples[int(exp.group[j])]
        row = {"prompt": e.prompt, "answer": e.answer, "completion": exp.texts[j],
               "reward": _finite_or_none(exp.rewards[j].item()), "advantage": exp.advantages[j, 0].item(),
               "truncated": bool(exp.truncated[j])}
        row.update({f"reward/{k}": _finite_or_none(v[j].item()) for k, v in exp.per_fn.items()})
        if exp.episodes is not None:
            ep = exp.episodes[j]
            row.update({"turns": ep.turns, "tool_calls": ep.tool_calls, "stop": ep.stop, "messages": ep.messages})
        rows.append(row)
    return rows


def _nanmean(x: torch.Tensor) -> float:
    return x.nanmean().item() if (~x.isnan()).any() else float("nan")


def _nanstd(x: torch.Tensor) -> float:
    x = x[~x.isnan()]
    return x.std().item() if x.numel() > 1 else 0.0
