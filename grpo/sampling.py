"""Loop steps 1–2, prompts → episodes: draw the next round of prompts from the stream, take this process's share,
seed each prompt by its position in the stream, and run the share through the environment (and so the generator).

Nothing here talks to other processes: the rank and the number of processes only say which share is this
process's, and every process draws the same prompts from its own copy of the stream. So sampling could run on a
thread of its own, or ahead of the trainer, handing `Sampled` rounds (whose rows carry the weight version that
sampled them, `Rollout.version`) through a queue to scoring (`grpo.collect`). The one exception is not this
module's: a generator whose decoding steps are collective (the in-process generator over FSDP2 shards asks
`all_finished` at every step) must be called on every process in step.
"""
from __future__ import annotations

from dataclasses import dataclass

from grpo.data import PromptStream
from grpo.envs import Environment
from grpo.rollout import TRAIN, Generator, Rollout, Sampling, sampling_seed
from grpo.tasks.base import Example


@dataclass(frozen=True)
class Sampler:
    """What sampling needs that is fixed for a run, bound once when the trainer builds it."""

    environment: Environment
    generator: Generator
    sampling: Sampling                       # n = G episodes per prompt
    seed: int                                # the run's: with a prompt's position in the stream, its sampling seed


@dataclass(frozen=True)
class Sampled:
    """One round of this process's share: its examples (one per group) and their G episodes each, example by
    example."""

    examples: list[Example]
    rollout: Rollout


def sample(s: Sampler, stream: PromptStream, rank: int, world_size: int) -> Sampled:
    """The next round of prompts (the stream's batch), this process's share of it, sampled: process `rank` of
    `world_size` takes the rank-th of equal consecutive shares."""
    first = stream.drawn
    batch = stream.next_batch()
    examples = _share(batch, rank, world_size)
    seeds = _share([sampling_seed(s.seed, TRAIN, first + i) for i in range(len(batch))], rank, world_size)
    return Sampled(list(examples), s.environment.rollout(s.generator, examples, s.sampling, seeds))


def _share(items: list, rank: int, world_size: int) -> list:
    k = len(items) // world_size
    return items[rank * k:(rank + 1) * k]
