"""Loop steps 1–4, prompts → `Experience`: draw this process's prompts, run them through the environment (and so
the generator), score the episodes with the reward functions, and turn the rewards into per-token advantages.

Advantages (SPEC 1.2, 1.3, 2):
- outcome rewards (floats): the weighted total of the outcome functions is normalised within its group
  (`algo.scale`, `algo.std`, `algo.eps`) and broadcast to every token of the episode;
- process rewards (lists of `(end, reward)` steps): each step's `end`, a character offset just after the step, is
  mapped to the token that holds the step's last character (a step that ends at the end of the text ends at the
  episode's last token, its EOS included); the weighted step rewards of the group's G episodes are normalised
  with their pooled mean and std (`algo.std`, `algo.eps`) and each token gets the sum of the normalised rewards of
  the steps that end at or after it (`grpo.algo.process_advantages`);
- both: a token's advantage is the sum of the two, each normalised in its own statistics, so an outcome reward
  (a format check, say) next to a process reward keeps its own scale.

Dynamic sampling (`algo.dynamic_sampling`, DAPO §3.2, SPEC 13.8): a group is dropped when all its rewards (its
outcome totals, and its pooled step rewards) are equal, or when none of its tokens is in the loss; more prompts
are drawn, `train.prompts_per_step` a round, until the step has that many informative groups (the surplus of the
last round is dropped) or `algo.max_sampling_rounds` rounds are spent; then the step is filled up with dropped
groups in the order drawn (advantage 0) and `sampling/filled_groups` says how many. Every process sees every round's groups, so the choice
and the order are the same for any number of processes, and each prompt's seed is its position in the stream.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo.algo import AdvantageSpec, compute_advantages, informative_groups, process_advantages
from grpo.data import PromptStream
from grpo.distributed import Dist
from grpo.envs import Environment
from grpo.envs.base import episode_fields
from grpo.rewards import example_fields
from grpo.experience import Experience, trained_tokens
from grpo.rewards import Scores, score
from grpo.rollout import TRAIN, Generator, Rollout, Sampling, sampling_seed
from grpo.rollout.base import concat_rollouts
from grpo.tasks.base import Example


@dataclass(frozen=True)
class Collector:
    """Everything `collect` needs that is fixed for a run, bound once when the trainer builds it."""

    environment: Environment
    generator: Generator
    rewards: Sequence[tuple[str, object]]   # (name, reward function)
    weights: Sequence[float] | None
    sampling: Sampling                       # n = G
    tokenizer: object                        # maps process-reward steps to tokens
    prompts_per_step: int
    seed: int
    scale: str = "group"
    std: str = "sample"
    eps: float = 1e-4
    mask_truncated: bool = False
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 1

    @property
    def pad_id(self) -> int:  # what joined rounds are padded with
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return pad if pad is not None else 0


@dataclass
class _Scored:
    """Scored episodes of whole groups, before advantages."""

    rollout: Rollout
    examples: list[Example]
    scores: Scores
    step_ends: torch.Tensor             # (N, K) token index of each process step's end, -1 for padding (K >= 1)
    step_rewards: torch.Tensor          # (N, K) its weighted reward


def collect(c: Collector, stream: PromptStream, dist: Dist) -> Experience:
    """This process's share of the next step's episodes, scored, with advantages."""
    if not c.dynamic_sampling:
        scored = _sample_round(c, stream, dist)
        return _experience(c, scored, dist, everyone=False)
    kept: list[tuple[_Scored, int]] = []     # (round, group) of the informative groups, in the order drawn
    dropped: list[tuple[_Scored, int]] = []
    rounds = drawn = 0
    totals = []                              # every drawn completion's reward, dropped groups included
    while len(kept) < c.prompts_per_step and rounds < c.max_sampling_rounds:
        whole = _everyone(_sample_round(c, stream, dist), dist, c.pad_id)  # the round's groups, every process's
        rounds, drawn = rounds + 1, drawn + len(whole.examples)
        totals.append(whole.scores.total.double().cpu())
        for g, ok in enumerate(_informative(c, whole).tolist()):
            (kept if ok else dropped).append((whole, g))
    filled = max(0, c.prompts_per_step - len(kept))
    chosen = kept[:c.prompts_per_step] + dropped[:filled]
    stats = {"sampling/rounds": rounds, "sampling/prompts_drawn": drawn,
             "sampling/groups_dropped": drawn - len(kept), "sampling/filled_groups": filled,
             "sampling/reward_mean": torch.cat(totals).nanmean().item()}  # NaN (logged null) if none applied
    g = c.sampling.n
    picked = _concat([_select(s, range(i * g, (i + 1) * g)) for s, i in chosen], c.pad_id)
    return _experience(c, picked, dist, everyone=True, stats=stats)


# ---------------------------------------------------------------------------------------------------------
# one round: sample and score this process's share

def _sample_round(c: Collector, stream: PromptStream, dist: Dist) -> _Scored:
    first = stream.drawn
    examples = _shard(stream.next_batch(), dist)
    seeds = _shard([sampling_seed(c.seed, TRAIN, first + i) for i in range(c.prompts_per_step)], dist)
    rollout = c.environment.rollout(c.generator, examples, c.sampling, seeds)
    g = c.sampling.n
    prompts = [e.prompt for e in examples for _ in range(g)]
    scores = score(c.rewards, c.weights, prompts, rollout.texts,
                   {**example_fields(examples, g), **episode_fields(rollout), "completion_ids": _ids(rollout)})
    return _Scored(rollout, list(examples), scores, *_step_tensors(c.tokenizer, rollout, scores.steps))


def probe_rewards(rewards, weights, tokenizer, example: Example, *, multi_turn: bool) -> None:
    """Call every reward function once, on `example` with its own answer as the completion, so that a broken
    function fails in seconds, before the model's engine starts and before the first evaluation, with the
    error `score` gives (naming the function)."""
    text = str(example.answer)
    fields = {**example_fields([example]), "completion_ids": [tokenizer(text, add_special_tokens=False)["input_ids"]]}
    if multi_turn:
        fields.update(messages=[[{"role": "user", "content": example.prompt}, {"role": "assistant", "content": text}]],
                      turn_ends=[[len(text)]])
    score(rewards, weights, [example.prompt], [text], fields)


def _ids(rollout: Rollout) -> list[list[int]]:
    """Each completion's generated token ids, EOS included, padding not (TRL's `completion_ids`)."""
    return [row[:n].tolist() for row, n in zip(rollout.completion_ids, rollout.lengths.tolist())]


def _shard(batch: list, dist: Dist) -> list:
    k = len(batch) // dist.world_size
    return batch[dist.rank * k:(dist.rank + 1) * k]


def _step_tensors(tokenizer, rollout: Rollout, steps: list[list[tuple[int, float]]]):
    """Process steps as (N, K) token indices of their ends (-1 padding) and (N, K) rewards."""
    n, k = len(steps), max(1, max(len(s) for s in steps))
    ends = torch.full((n, k), -1, dtype=torch.long)
    rewards = torch.zeros(n, k, dtype=torch.float32)
    lengths = rollout.lengths.tolist()
    text_len = (rollout.lengths - (~rollout.truncated).long()).tolist()  # tokens before EOS
    for i, row in enumerate(steps):
        ids = rollout.completion_ids[i, :text_len[i]].tolist()
        for j, (end, reward) in enumerate(row):
            ends[i, j] = _token_of(tokenizer, ids, end, rollout.texts[i], lengths[i])
            rewards[i, j] = reward
    return ends.to(rollout.completion_ids.device), rewards.to(rollout.completion_ids.device)


def _token_of(tokenizer, ids: list[int], end: int, text: str, length: int) -> int:
    """The index of the token that completes character end - 1 of `text` (the decoding of `ids`): the first k
    whose decoded prefix holds `text[:end]` whole, minus one. A binary search over decoded prefixes, which only
    grow; "holds whole" rather than "is that long", since a byte-level tokenizer decodes a character split over
    tokens as a replacement character until its last byte. The end of the text is the episode's last token (its
    EOS too); 0 is its first."""
    if end >= len(text):
        return max(length - 1, 0)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if tokenizer.decode(ids[:mid], skip_special_tokens=True)[:end] == text[:end]:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1 if end > 0 else 0


# ---------------------------------------------------------------------------------------------------------
# dynamic sampling: every process's groups, the informative ones, a chosen set

def _everyone(mine: _Scored, dist: Dist, pad_id: int) -> _Scored:
    """The round's groups of every process, in rank order (which is the order drawn)."""
    if dist.world_size == 1:
        return mine
    device = mine.rollout.completion_ids.device
    parts = dist.gather_objects(_map(mine, lambda x: x.cpu()))
    return _map(_concat(parts, pad_id), lambda x: x.to(device))


def _map(s: _Scored, fn) -> _Scored:
    """`s` with `fn` applied to every tensor in it."""
    sc = s.scores
    scores = Scores(fn(sc.total), {k: fn(v) for k, v in sc.per_fn.items()}, fn(sc.outcome), sc.steps)
    return _Scored(s.rollout.map(fn), s.examples, scores, fn(s.step_ends), fn(s.step_rewards))


def _informative(c: Collector, s: _Scored) -> torch.Tensor:
    """(groups,) bool: the group's outcome totals, or its pooled step rewards, are not all equal, and some of its
    tokens are in the loss (with `algo.mask_truncated`, a group of truncated episodes teaches nothing)."""
    g = c.sampling.n
    pooled = torch.where(s.step_ends >= 0, s.step_rewards.double(), float("nan"))
    learns = trained_tokens(s.rollout, c.mask_truncated).sum(1).cpu() > 0
    return ((informative_groups(s.scores.outcome, g).cpu()
             | informative_groups(pooled.reshape(-1).cpu(), g * s.step_ends.shape[1]))
            & learns.view(-1, g).any(dim=1))


def _select(s: _Scored, rows: range) -> _Scored:
    """These rows of `s` (whole groups)."""
    g = len(s.rollout) // len(s.examples)
    index = torch.tensor(list(rows))
    sc = s.scores
    scores = Scores(sc.total[index], {k: v[index] for k, v in sc.per_fn.items()}, sc.outcome[index],
                    [sc.steps[r] for r in rows])
    take = index.to(s.step_ends.device)
    return _Scored(s.rollout.select(rows), s.examples[rows.start // g:rows.stop // g], scores, s.step_ends[take],
                   s.step_rewards[take])


def _concat(parts: list[_Scored], pad_id: int) -> _Scored:
    if len(parts) == 1:
        return parts[0]
    rollout = concat_rollouts([p.rollout for p in parts], pad_id)
    first = parts[0].scores
    scores = Scores(torch.cat([p.scores.total for p in parts]),
                    {k: torch.cat([p.scores.per_fn[k] for p in parts]) for k in first.per_fn},
                    torch.cat([p.scores.outcome for p in parts]), [s for p in parts for s in p.scores.steps])
    k = max(p.step_ends.shape[1] for p in parts)
    pad = lambda x, v: torch.nn.functional.pad(x, (0, k - x.shape[1]), value=v)  # noqa: E731
    ends = torch.cat([pad(p.step_ends, -1) for p in parts])
    return _Scored(rollout, [e for p in parts for e in p.examples], scores, ends,
                   torch.cat([pad(p.step_rewards, 0.0) for p in parts]))


# ---------------------------------------------------------------------------------------------------------
# advantages

def _experience(c: Collector, s: _Scored, dist: Dist, *, everyone: bool, stats: dict | None = None) -> Experience:
    """Advantages of `s`, then this process's Experience. `everyone`: `s` holds every process's groups and this
    process keeps its share; else it holds this process's alone, and the rewards are gathered."""
    g = c.sampling.n
    if everyone:
        all_rewards, outcome = s.scores.total, s.scores.outcome
        n = len(s.rollout) // dist.world_size
    else:  # every process's rewards, in one collective (batch std needs them all; logging too)
        n = len(s.rollout)
        both = dist.gather(torch.cat([s.scores.total, s.scores.outcome])).view(dist.world_size, 2, n)
        all_rewards, outcome = both[:, 0].reshape(-1), both[:, 1].reshape(-1)
    # outcome advantages from every process's rewards (0 where no outcome reward applies), then this process's
    out = compute_advantages(outcome, g, AdvantageSpec.from_algo(c))[dist.rank * n:(dist.rank + 1) * n]
    if everyone:
        s = _select(s, range(dist.rank * n, (dist.rank + 1) * n))
    r = s.rollout
    width = r.completion_ids.shape[1]
    adv = torch.zeros(n, width, dtype=torch.float32, device=r.completion_ids.device)
    adv += out.to(adv.device).unsqueeze(1)
    if (s.step_ends >= 0).any():  # groups never span processes: the pooled statistics are each group's own
        adv += process_advantages(s.step_rewards, s.step_ends, g, width, AdvantageSpec.from_algo(c)).to(adv.device)
    return Experience.from_rollout(r, s.examples, adv, s.scores.total, s.scores.per_fn, all_rewards,
                                   mask_truncated=c.mask_truncated, stats=stats)
