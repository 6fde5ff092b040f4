"""What a rollout backend returns, and the sampling parameters it takes (SPEC 9, steps 1–2)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Sampling:
    n: int                      # completions per prompt (G)
    max_new_tokens: int
    temperature: float = 1.0    # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0              # 0 keeps the whole vocabulary
    min_new_tokens: int = 0     # EOS is not sampled before this many tokens


def rollout_sampling(rollout, n: int) -> Sampling:
    """The sampling settings of a `rollout.*` config section (`grpo.config.RolloutConfig`), n completions a prompt."""
    return Sampling(n, rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k,
                    rollout.min_new_tokens)


@dataclass
class Rollout:
    """N = prompts × n completions, prompt by prompt (the n completions of a prompt are consecutive)."""

    prompt_ids: torch.Tensor       # (N, Lp) left-padded
    prompt_mask: torch.Tensor      # (N, Lp) 1 on prompt tokens
    completion_ids: torch.Tensor   # (N, T) right-padded with the pad id
    completion_mask: torch.Tensor  # (N, T) 1 up to and including the first EOS, from positions (SPEC 12)
    truncated: torch.Tensor        # (N,) bool: no EOS within max_new_tokens
    texts: list[str]               # decoded completions, EOS and padding left out

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:  # (N,) loss-bearing tokens per completion, EOS included
        return self.completion_mask.sum(1)


TRAIN, EVAL, SAMPLE = 0, 1, 2  # seed streams, so training, evaluation and `grpo sample` never share draws


def sampling_seed(run_seed: int, stream: int, index: int) -> int:
    """The sampling seed of the `index`-th prompt of a stream: a function of the run's seed and the prompt's
    position alone, so completions do not depend on batching, world size or resumption."""
    return hash((run_seed, stream, index)) & (2**63 - 1)


class Generator(Protocol):
    def generate(self, prompts: list[str], sampling: Sampling, seeds: Sequence[int] | None = None) -> Rollout:
        """n completions per prompt, prompt by prompt; prompt i samples from a generator seeded by seeds[i]."""
