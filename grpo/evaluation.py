"""Held-out evaluation: greedy accuracy and pass@k with sampling, scored by a reward function (`eval.reward`, a
name or a Python function given to grpo.train): a completion is correct when it scores at least `threshold`
(`eval.threshold`, 1 by default; None counts as 0)."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from grpo.distributed import Dist
from grpo.envs.base import episode_fields
from grpo.errors import DataError
from grpo.rewards import (RewardFn, example_fields, missing_fields, needs_fields_error, reward_inputs, reward_name,
                          score, take_figures)
from grpo.rewards.calls import call
from grpo.rollout import EVAL, Generator, Sampling, sampling_seed
from grpo.tasks.base import Example

if TYPE_CHECKING:
    from grpo.envs.base import Environment


def _correct(fn: RewardFn, examples: Sequence[Example], texts: list[str], repeat: int,
             episodes: dict[str, list] | None = None, threshold: float = 1.0) -> torch.Tensor:
    prompts = [e.prompt for e in examples for _ in range(repeat)]
    kwargs = reward_inputs(fn, prompts, texts, {**example_fields(examples, repeat), **(episodes or {})})
    try:
        values = call(fn, **kwargs)
    except TypeError as e:
        if missing := missing_fields(fn, kwargs):
            raise needs_fields_error(reward_name(fn), missing, kwargs, field="eval.reward") from e
        raise
    if not isinstance(values, (list, tuple)) or len(values) != len(texts):
        raise DataError(f"eval.reward {reward_name(fn)!r} returned {type(values).__name__} for {len(texts)} "
                        "completions; it must return one value per completion")
    if any(isinstance(v, (list, tuple)) for v in values):
        raise DataError(f"eval.reward {reward_name(fn)!r} returned lists of steps; evaluation needs a reward that "
                        f"gives a correct completion at least {threshold} (an outcome reward such as last_number or "
                        "math)")
    return torch.tensor([float(v or 0.0) >= threshold for v in values]).view(len(examples), repeat)


def evaluate(environment: Environment, generator: Generator, examples: Sequence[Example], correct_fn: RewardFn, *,
             max_new_tokens: int, pass_k: int = 0, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
             dist: Dist | None = None, rewards: Sequence[tuple[str, RewardFn]] = (),
             threshold: float = 1.0, sampling: Sampling | None = None) -> dict[str, float]:
    """`eval/accuracy` (greedy; correct: `correct_fn` gives at least `threshold`), `eval/pass@k` (k samples at
    `temperature`, at least one correct), per family when the examples carry a `task` field (`eval/accuracy/<task>`), and
    `eval/mean_length`; with `rewards` ((name, function) pairs: `eval.rewards`), each one's mean over the greedy
    completions as `eval/reward/<name>` (None values left out). Episodes run through the environment, as in training.

    With several processes each evaluates an equal share and the results are gathered: every process returns
    the same figures, equal to a single process's (a prompt's samples depend on its seed only).

    `sampling`: the run's sampler settings (`rollout_sampling(cfg.rollout, 1)`; None: `max_new_tokens` and
    `top_p` alone). The greedy pass keeps their repetition penalty and stop strings (top-k, top-p and min-p never
    drop the most likely token); pass@k keeps all of them but the temperature. min_new_tokens is training's
    alone."""
    dist = dist or Dist()
    base = replace(sampling or Sampling(1, max_new_tokens, top_p=top_p), min_new_tokens=0)
    n = len(examples)
    per = math.ceil(n / dist.world_size)
    index = [min(i, n - 1) for i in range(dist.rank * per, (dist.rank + 1) * per)]  # padded to equal shares
    mine = [examples[i] for i in index]
    # one seed per example, for the greedy pass too: every environment is called as the contract says,
    # rollout(generator, examples, sampling, seeds) (grpo.envs.base)
    seeds = [sampling_seed(seed, EVAL, i) for i in index]
    greedy = environment.rollout(generator, mine, replace(base, n=1, temperature=0.0), seeds)
    ok = _correct(correct_fn, mine, greedy.texts, 1, episode_fields(greedy), threshold)[:, 0]
    ok = dist.gather(ok.float())[:n].bool()
    lengths = dist.gather(greedy.lengths.float().cpu())[:n]
    metrics = {"eval/accuracy": ok.float().mean().item(), "eval/mean_length": lengths.mean().item()}
    if rewards:
        scores = score(rewards, None, [e.prompt for e in mine], greedy.texts,
                       {**example_fields(mine, 1), **episode_fields(greedy)})
        for name, values in scores.per_fn.items():
            metrics[f"eval/reward/{name}"] = dist.gather(values.double().cpu())[:n].nanmean().item()
        take_figures(fn for _, fn in rewards)  # a judge's requests here are not a training step's
    families = defaultdict(list)
    for e, c in zip(examples, ok.tolist()):
        if "task" in e.fields:
            families[e.fields["task"]].append(c)
    if len(families) > 1:
        metrics.update({f"eval/accuracy/{k}": sum(v) / len(v) for k, v in sorted(families.items())})
    if pass_k > 0:
        sampled = environment.rollout(generator, mine, replace(base, n=pass_k, temperature=temperature), seeds)
        hits = _correct(correct_fn, mine, sampled.texts, pass_k, episode_fields(sampled), threshold).float()
        hits = dist.gather(hits.reshape(-1)).view(-1, pass_k)[:n].bool()
        metrics[f"eval/pass@{pass_k}"] = hits.any(dim=1).float().mean().item()
        metrics["eval/sample_accuracy"] = hits.float().mean().item()
    return metrics


class Progress:
    """An environment whose rollouts advance a progress bar (`grpo eval`'s): the examples go to `environment` in
    chunks of `chunk`, the bar moving by each chunk's episodes (`bar.update`), and the chunks' rollouts are joined.
    A prompt's episodes depend on its seed only, not on the prompts beside it (grpo/rollout/hf.py), so the figures
    are those of one call."""

    def __init__(self, environment: Environment, bar, chunk: int, pad_id: int = 0):
        self.environment, self.bar, self.chunk, self.pad_id = environment, bar, max(1, chunk), pad_id

    def rollout(self, generator: Generator, examples: Sequence[Example], sampling: Sampling,
                seeds: Sequence[int] | None = None):
        from grpo.rollout.base import concat_rollouts

        parts = []
        for start in range(0, len(examples), self.chunk):
            part = examples[start:start + self.chunk]
            more = () if seeds is None else (seeds[start:start + self.chunk],)
            parts.append(self.environment.rollout(generator, part, sampling, *more))
            self.bar.update(len(part) * sampling.n)
        return concat_rollouts(parts, self.pad_id)

    def __getattr__(self, name: str):
        return getattr(self.environment, name)
