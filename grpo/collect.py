"""Loop steps 3–4, episodes → `Experience`: score this process's episodes (`grpo.sampling` draws and samples
them) with the reward functions, choose the groups of the step (dynamic sampling), and turn the rewards into
per-token advantages. The collectives of steps 1–4 are all here.

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
outcome totals, and its pooled step rewards) are equal, compared exactly over its scored completions whatever the
baseline (SPEC 14.10), or when none of its tokens is in the loss (an unscorable completion has none, 14.11); more prompts
are drawn, `train.prompts_per_step` a round, until the step has that many informative groups (the surplus of the
last round is dropped) or `algo.max_sampling_rounds` rounds are spent. At that cap the step trains on the
informative groups it has and nothing else (a dropped group would still count in the token-mean normaliser and
get a KL gradient), as many as divide equally among the processes (the last drawn make up the remainder and are
dropped); `sampling/groups_trained` says how many. With none the step has no rows and makes no update. Each
process samples and judges its own share of every round (a group never spans processes); only the verdicts and
the rewards are gathered, so every process makes the same choice, in the order drawn, for any number of
processes, and each prompt's seed is its position in the stream. Then only the chosen groups move: each from
the process that sampled it to the one that trains it (the k-th process trains the k-th equal share).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo.algo import (AdvantageSpec, RewardRangeError, compute_advantages, gdpo_advantages, informative_groups,
                       process_advantages)
from grpo.data import PromptStream
from grpo.distributed import Dist
from grpo.envs.base import episode_fields
from grpo.errors import DataError
from grpo.rewards import example_fields
from grpo.experience import Experience, trained_tokens
from grpo.rewards import score, take_figures
from grpo.rollout import Rollout
from grpo.rows import Rows, column
from grpo.sampling import Sampled, Sampler, sample
from grpo.tasks.base import Example


@dataclass(frozen=True)
class Collector:
    """Everything `collect` needs that is fixed for a run, bound once when the trainer builds it."""

    sampler: Sampler                         # prompts -> episodes (`grpo.sampling`)
    rewards: Sequence[tuple[str, object]]    # (name, reward function)
    weights: Sequence[float] | None
    tokenizer: object                        # maps process-reward steps to tokens
    prompts_per_step: int
    spec: AdvantageSpec                      # advantages and dynamic sampling (algo.*)

    @property
    def pad_id(self) -> int:  # what joined rounds are padded with
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return pad if pad is not None else 0


@dataclass
class Scored(Rows):
    """Scored episodes of whole groups, before advantages: a rollout's rows with their rewards."""

    rollout: Rollout = column("nested")
    group: torch.Tensor = column("group")           # (N,) long: the row's group, an index into `examples`
    examples: list[Example] = column("groups")      # one per group
    total: torch.Tensor = column("rows")            # (N,) `grpo.rewards.Scores`' fields, row by row
    per_fn: dict[str, torch.Tensor] = column("by_name")
    outcome: torch.Tensor = column("rows")
    steps: list = column("items")
    step_ends: torch.Tensor = column("padded", fill=-1)     # (N, K) token index of each process step's end, -1 for
                                                            # padding (K >= 1)
    step_rewards: torch.Tensor = column("padded", fill=0.0)  # (N, K) its weighted reward


def collect(c: Collector, stream: PromptStream, dist: Dist) -> Experience:
    """This process's share of the next step's episodes, scored, with advantages."""
    if not c.spec.dynamic_sampling:
        scored = _score(c, sample(c.sampler, stream, dist.rank, dist.world_size))
        return _experience(c, scored, dist, stats=_reward_figures(c, dist))
    g, share = c.sampler.sampling.n, c.prompts_per_step // dist.world_size  # share: groups a process samples a round
    rounds: list[Scored] = []                # this process's share of each round
    kept: list[tuple[int, int]] = []         # (round, group of the round) of the informative groups, in the order drawn
    totals = []                              # every drawn completion's reward, dropped groups included
    while len(kept) < c.prompts_per_step and len(rounds) < c.spec.max_sampling_rounds:
        mine = _score(c, sample(c.sampler, stream, dist.rank, dist.world_size))
        rounds.append(mine)
        # every process's rewards and verdicts of the round, in one collective (rank order is the order drawn)
        both = dist.gather(torch.cat([mine.total.double().cpu(), _informative(c, mine).double()]))
        both = both.view(dist.world_size, share * g + share)
        totals.append(both[:, :share * g].reshape(-1))
        kept += [(len(rounds) - 1, j) for j, ok in enumerate(both[:, share * g:].reshape(-1).bool().tolist()) if ok]
    drawn = len(rounds) * c.prompts_per_step
    # at the round cap the step trains on the informative groups it has (SPEC 13.8), as many as the processes
    # can share equally: the surplus (at most world_size - 1 groups, the last drawn) is dropped as the last
    # round's is, so one process trains on all of them
    trained = min(len(kept), c.prompts_per_step)
    trained -= trained % dist.world_size
    stats = {"sampling/rounds": len(rounds), "sampling/prompts_drawn": drawn,
             "sampling/groups_dropped": drawn - len(kept), "sampling/groups_trained": trained,
             "sampling/reward_mean": torch.cat(totals).nanmean().item(),  # NaN (logged null) if none applied
             **_reward_figures(c, dist)}
    return _experience(c, _route(c, rounds, kept[:trained], share, dist), dist, stats=stats)


def _reward_figures(c: Collector, dist: Dist) -> dict[str, float]:
    """The figures reward functions keep of the step's scoring (`take_figures`: a judge's failures, requests and
    seconds), summed over processes (seconds: the longest), in one collective; none without such a function."""
    mine = take_figures(fn for _, fn in c.rewards)
    if not mine:
        return {}
    keys = sorted(mine)
    rows = dist.gather(torch.tensor([mine[k] for k in keys], dtype=torch.float64)).view(dist.world_size, len(keys))
    return {k: (rows[:, i].max() if k.endswith("seconds") else rows[:, i].sum()).item() for i, k in enumerate(keys)}


# ---------------------------------------------------------------------------------------------------------
# scoring: this process's episodes, no collectives

def _score(c: Collector, s: Sampled) -> Scored:
    g, r = c.sampler.sampling.n, s.rollout
    prompts = [e.prompt for e in s.examples for _ in range(g)]
    scores = score(c.rewards, c.weights, prompts, r.texts,
                   {**example_fields(s.examples, g), **episode_fields(r), "completion_ids": _ids(r)})
    group = torch.arange(len(s.examples), device=r.completion_ids.device).repeat_interleave(g)
    return Scored(r, group, list(s.examples), scores.total, scores.per_fn, scores.outcome, scores.steps,
                  *_step_tensors(c.tokenizer, r, scores.steps))


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


def _step_tensors(tokenizer, rollout: Rollout, steps: list[list[tuple[int, float]]]):
    """Process steps as (N, K) token indices of their ends (-1 padding) and (N, K) rewards."""
    n, k = len(steps), max(1, max(len(s) for s in steps))
    ends = torch.full((n, k), -1, dtype=torch.long)
    rewards = torch.zeros(n, k, dtype=torch.float32)
    lengths = rollout.lengths.tolist()
    for i, row in enumerate(steps):
        # every token, the last included: a row a stop string ended has text up to its last token (the one that
        # completed the string); a final EOS is never reached, as the text before it already holds every step
        ids = rollout.completion_ids[i, :lengths[i]].tolist()
        for j, (end, reward) in enumerate(row):
            ends[i, j] = _token_of(tokenizer, ids, end, rollout.texts[i], lengths[i])
            rewards[i, j] = reward
    return ends.to(rollout.completion_ids.device), rewards.to(rollout.completion_ids.device)


def _token_of(tokenizer, ids: list[int], end: int, text: str, length: int) -> int:
    """The index of the token that completes character end - 1 of `text` (the decoding of `ids`, before their
    EOS or up to a stop string): the first k whose decoded prefix holds `text[:end]` whole, minus one. A binary
    search over decoded prefixes, which only grow; "holds whole" rather than "is that long", since a byte-level
    tokenizer decodes a character split over tokens as a replacement character until its last byte. The end of
    the text is the episode's last token (its EOS too); 0 is its first."""
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
# dynamic sampling: the informative groups, the chosen ones moved to the processes that train them

def _informative(c: Collector, s: Scored) -> torch.Tensor:
    """(groups,) bool: the group's outcome totals, or its pooled step rewards, are not all equal, and some of its
    tokens are in the loss (with `algo.mask_truncated`, a group of truncated episodes teaches nothing)."""
    g = c.sampler.sampling.n
    pooled = torch.where(s.step_ends >= 0, s.step_rewards.double(), float("nan"))
    learns = trained_tokens(s.rollout, c.spec.mask_truncated, s.total).sum(1).cpu() > 0
    return ((informative_groups(s.outcome, g).cpu()
             | informative_groups(pooled.reshape(-1).cpu(), g * s.step_ends.shape[1]))
            & learns.view(-1, g).any(dim=1))


def _route(c: Collector, rounds: list[Scored], chosen: list[tuple[int, int]], share: int, dist: Dist) -> Scored:
    """This process's share of the `chosen` (round, group) pairs, in their order: the k-th process trains the k-th
    equal share. Each group moves from the process that sampled it (group j of a round is process j // share's)
    to the one that trains it, and no other row moves."""
    if not chosen:  # a step with nothing to train on: no rows, no collective
        return rounds[0].select([])
    g, per = c.sampler.sampling.n, len(chosen) // dist.world_size
    moving = dist.world_size > 1  # between processes through the CPU
    outgoing: list[list[tuple[int, Scored]]] = [[] for _ in range(dist.world_size)]
    for at, (r, j) in enumerate(chosen):
        if j // share == dist.rank:
            i = j % share
            rows = rounds[r].select(range(i * g, (i + 1) * g))
            outgoing[at // per].append((at, rows.map(lambda x: x.cpu()) if moving else rows))
    incoming = sorted((item for part in dist.exchange(outgoing) for item in part), key=lambda item: item[0])
    mine = Scored.concat([rows for _, rows in incoming], c.pad_id)
    return mine.map(lambda x: x.to(rounds[0].rollout.completion_ids.device)) if moving else mine


# ---------------------------------------------------------------------------------------------------------
# advantages

def _gdpo_rows(s: Scored) -> torch.Tensor:
    """What GDPO needs of this process's rows beyond the totals, flat, for `_experience`'s one collective: the
    per-function rewards (N, F), then 1 if a reward function returned process steps."""
    names = list(s.per_fn)
    mine = torch.stack([s.per_fn[k].to(torch.float64).cpu() for k in names], 1) if names else torch.zeros(len(s), 0)
    return torch.cat([mine.reshape(-1), torch.tensor([float((s.step_ends >= 0).any())], dtype=torch.float64)])


def _gdpo(c: Collector, s: Scored, gathered: torch.Tensor, dist: Dist) -> torch.Tensor:
    """GDPO's outcome advantages of this process's rows (`grpo.algo.gdpo_advantages`), from every process's
    `_gdpo_rows` (`gathered`, one row a process): the batch statistics are the step's, over every process."""
    n, names = len(s), list(s.per_fn)
    if gathered[:, -1].any():
        raise DataError("algo.multi_objective_aggregation=normalize_then_sum (GDPO) normalises outcome rewards, and a "
                        "reward function returned process steps; use sum_then_normalize with process rewards")
    every = gathered[:, :-1].reshape(-1, len(names))
    weights = list(c.weights) if c.weights is not None else [1.0] * len(names)
    return gdpo_advantages(every, weights, c.sampler.sampling.n, c.spec)[dist.rank * n:(dist.rank + 1) * n]


def _experience(c: Collector, s: Scored, dist: Dist, stats: dict | None = None) -> Experience:
    """Advantages of this process's groups `s` from every process's rewards, and its Experience (with no rows
    when dynamic sampling found nothing to train on: every process alike)."""
    g, spec = c.sampler.sampling.n, c.spec
    n = len(s)
    gdpo = spec.multi_objective_aggregation == "normalize_then_sum"
    # every process's rewards, in one collective (batch std needs them all; logging too), with GDPO's per-function
    # rewards
    extra = _gdpo_rows(s).to(s.total.device) if gdpo else s.total.new_zeros(0)
    both = dist.gather(torch.cat([s.total.double(), s.outcome.double(), extra])).view(dist.world_size, -1)
    all_rewards = both[:, :n].reshape(-1).to(s.total.dtype)
    outcome = both[:, n:2 * n].reshape(-1).to(s.outcome.dtype)
    # outcome advantages from every process's rewards (0 where no outcome reward applies), then this process's
    if gdpo:
        out = _gdpo(c, s, both[:, 2 * n:].cpu(), dist)
    else:
        try:
            out = compute_advantages(outcome, g, spec)[dist.rank * n:(dist.rank + 1) * n]
        except RewardRangeError as e:  # what the reward functions returned: one line (every process alike)
            raise DataError(str(e)) from None
    r = s.rollout
    width = r.completion_ids.shape[1]
    adv = torch.zeros(n, width, dtype=torch.float32, device=r.completion_ids.device)
    adv += out.to(adv.device).unsqueeze(1)
    if (s.step_ends >= 0).any():  # groups never span processes: the pooled statistics are each group's own
        adv += process_advantages(s.step_rewards, s.step_ends, g, width, spec).to(adv.device)
    return Experience.from_rollout(r, s.examples, adv, s.total, s.per_fn, all_rewards,
                                   mask_truncated=spec.mask_truncated, stats=stats)
