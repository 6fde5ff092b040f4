"""`Experience`: the one batch type that passes from sampling and scoring (`grpo.sampling`, `grpo.collect`) to
learning (`grpo.learn`).

Rows are this process's episodes, group by group (the G episodes of one prompt are consecutive); tensors are
(N, ·) with N = groups × G. Everything learning needs is here, and nothing about how it was produced: which
generator or environment sampled it, which reward functions scored it, or how many rounds of sampling it took
(only the weight version that sampled each row, for a learner that corrects for stale rows). Its rows `select`,
`concat` and `map` as every batch type's do (`grpo.rows.Rows`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.rollout import Rollout
from grpo.rollout.base import check_shapes
from grpo.rows import PAD, Rows, column
from grpo.tasks.base import Example


@dataclass
class Experience(Rows):
    prompt_ids: torch.Tensor = column("padded", fill=PAD, left=True)  # (N, Lp) left-padded
    prompt_mask: torch.Tensor = column("padded", left=True)           # (N, Lp) 1 on prompt tokens
    completion_ids: torch.Tensor = column("padded", fill=PAD)         # (N, T) right-padded
    # (N, T) 1 on every episode token (up to and including the first EOS)
    completion_mask: torch.Tensor = column("padded")
    loss_mask: torch.Tensor = column("padded")        # (N, T) 1 on the tokens that are the model's to learn
    advantages: torch.Tensor = column("padded", fill=0.0)  # (N, T) float32 per-token advantages (an outcome
                                                           # advantage is broadcast)
    # (N, T) float32 log-probs the sampling engine reported; None: our own forward
    sampler_logp: torch.Tensor | None = column("padded", fill=0.0)
    rewards: torch.Tensor = column("rows")            # (N,) weighted total reward (NaN where no function applied)
    # reward function name -> (N,) its rewards (a process reward: its step mean)
    per_fn: dict[str, torch.Tensor] = column("by_name")
    group: torch.Tensor = column("group")             # (N,) long: the row's group, an index into `examples`
    examples: list[Example] = column("groups")        # one per group
    texts: list[str] = column("items")                # what the rewards scored, one per row
    truncated: torch.Tensor = column("rows")          # (N,) bool: cut off by the length limit
    # (N · processes,) every process's `rewards`, in rank order (for logging): the step's, not its rows'
    all_rewards: torch.Tensor = column("whole")
    # figures of the sampling itself (rounds, drops): the step's
    stats: dict[str, float] = column("whole", default_factory=dict)
    # `grpo.envs.base.Episode`s, one per row from a multi-turn environment (turns, calls, stop reason)
    episodes: list | None = column("items", default=None)
    # (N,) long: the weight version that sampled each row (`grpo.rollout.Rollout.version`); None where not reported
    version: torch.Tensor | None = column("rows", default=None)
    # one `grpo.vision.Images` per row (None: none), sliced with the rows for every forward; None: no images
    images: list | None = column("items", default=None)

    def __post_init__(self):
        n, t = self.completion_ids.shape
        full = ("completion_mask", "loss_mask", "advantages", "sampler_logp")
        check_shapes("Experience", {k: getattr(self, k) for k in full}, (n, t), f"completion_ids has {(n, t)}")
        if self.prompt_ids.shape[0] != n or self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"Experience prompts have shapes {tuple(self.prompt_ids.shape)} and "
                             f"{tuple(self.prompt_mask.shape)} for {n} rows")
        rows = {"rewards": self.rewards, "group": self.group, "truncated": self.truncated, "version": self.version,
                **{f"per_fn[{k!r}]": v for k, v in self.per_fn.items()}}
        check_shapes("Experience", rows, (n,), f"it must be ({n},)")
        if len(self.texts) != n:
            raise ValueError(f"Experience has {len(self.texts)} texts for {n} rows")
        if n and not 0 <= int(self.group.min()) <= int(self.group.max()) < len(self.examples):
            raise ValueError(f"Experience.group indexes {len(self.examples)} examples out of range")
        if self.advantages.dtype != torch.float32:
            raise ValueError(f"Experience.advantages must be float32, got {self.advantages.dtype}")

    @property
    def lengths(self) -> torch.Tensor:  # (N,) episode tokens per row, EOS included
        return self.completion_mask.sum(1)

    @classmethod
    def from_rollout(cls, rollout: Rollout, examples: list[Example], advantages: torch.Tensor, rewards: torch.Tensor,
                     per_fn: dict[str, torch.Tensor], all_rewards: torch.Tensor, *, mask_truncated: bool = False,
                     stats: dict[str, float] | None = None) -> Experience:
        """An Experience of `rollout`'s rows, len(examples) groups of equal size (none: no rows, a step with
        nothing to train on). `mask_truncated` zeroes the loss mask of truncated rows (they still count in the
        group statistics)."""
        n = len(rollout)
        if bool(n) != bool(examples) or n % max(len(examples), 1):
            raise ValueError(f"{n} rows do not make {len(examples)} groups of equal size")
        g = n // len(examples) if examples else 0
        loss_mask = trained_tokens(rollout, mask_truncated, rewards)
        device = rollout.completion_ids.device
        group = torch.arange(len(examples), device=device).repeat_interleave(g)
        return cls(rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask,
                   loss_mask, advantages.to(device=device, dtype=torch.float32), rollout.sampler_logp, rewards,
                   per_fn, group, list(examples), rollout.texts, rollout.truncated, all_rewards, dict(stats or {}),
                   rollout.episodes, rollout.version, rollout.images)


def trained_tokens(rollout: Rollout, mask_truncated: bool, rewards: torch.Tensor | None = None) -> torch.Tensor:
    """(N, T) the rollout's loss mask (a new tensor), with truncated rows zeroed when `mask_truncated`, and the
    unscorable rows zeroed: those whose total reward in `rewards` is NaN, which no reward function scored (SPEC
    14.11; they also leave the normaliser, `grpo.learn`)."""
    mask = rollout.loss_mask.clone()
    if mask_truncated:
        mask[rollout.truncated] = 0
    if rewards is not None:
        mask[rewards.to(mask.device).isnan()] = 0
    return mask
