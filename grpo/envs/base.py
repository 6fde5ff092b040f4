"""The environment seam: how the prompts of a step become finished episodes (docs/training.md, "Environments").

An environment is called as `rollout(generator, examples, sampling, seeds)`, always with these four arguments,
positionally: by training (`grpo.sampling`), by evaluation (the greedy pass and pass@k, `grpo.evaluation`) and by
`grpo sample`. It receives the generator, the examples of this process's share of the step (prompt text, answer,
extra fields), the sampling settings (n = G episodes per example; temperature 0 is greedy) and one sampling seed
per example (a list of ints, never None). It returns
one `Rollout` of N = examples × n episodes, example by example, in which:
- `prompt_ids`/`prompt_mask` hold what the model was first given (left-padded), and `completion_ids` everything
  after it (right-padded): for one turn, the model's completion; for several, the model's turns and what the
  environment inserted between them, in order;
- `completion_mask` is 1 on every episode token up to its end; `loss_mask` is 1 only on the tokens that are the
  model's to learn. The environment sets it: it zeroes the tokens it inserted itself (tool output, a user turn).
  The trainer only ever zeroes more (`algo.mask_truncated`), never sets a token back to 1;
- `texts` is what the reward functions score, one string per episode: the decoding of the episode's tokens
  before its EOS (`skip_special_tokens=True`), since process rewards' character offsets are mapped back to
  tokens through it;
- `truncated` marks episodes cut off by a length limit; every other episode ends with an EOS token, its last
  (or, one ended by a stop string, `rollout.stop`, with the token that completed the string, which is text);
- `sampler_logp`, if the generator reported log-probs, covers the model's tokens (0 elsewhere);
- `episodes`, from a multi-turn environment, one `Episode` per row (what it recorded: messages, turn ends,
  calls, why it ended), which reaches the rewards through `episode_fields` and the metrics as `episode/*`.
An episode's randomness must come from its example's seed alone (not from the batch it shares), so that runs
are the same for any number of processes and after a resume; and every process must make the same number of
generator calls (decoding steps can be collective).

`Rollout.from_tokens` builds the Rollout from each episode's token lists (padding, masks, dtypes), so that an
environment need not pad tensors itself. Built-in environments are named in `grpo.envs.ENVIRONMENTS`;
`rollout.environment` chooses one of them or a user's 'module:Name' (`grpo.envs.build_environment`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from grpo.rollout import Generator, Rollout, Sampling
from grpo.tasks.base import Example


@dataclass
class Episode:
    """What a multi-turn environment records of one episode (`Rollout.episodes`), for rewards and logging."""

    messages: list[dict[str, Any]]      # the episode as chat messages: the model's turns, tool results, ...
    turn_ends: list[int]                # character offsets in the episode's text just after each model turn
    turns: int = 0                      # model turns
    tool_calls: int = 0                 # calls the model made
    tool_errors: int = 0                # of them, calls answered with an error (malformed, unknown, raised, ...)
    stop: str = "done"                  # why it ended: a name in STOP_REASONS


# why an episode ended: the model answered without a call; the turn limit; the episode's token limit; the
# model's context; one turn reached rollout.max_new_tokens without EOS
STOP_REASONS = ("done", "max_turns", "max_tokens", "context", "turn_length")


def episode_fields(rollout: Rollout) -> dict[str, list]:
    """Reward keyword arguments of a multi-turn rollout: each episode's `messages` and `turn_ends` (the
    character offsets in its text just after each model turn); none for single completions."""
    if rollout.episodes is None:
        return {}
    return {"messages": [e.messages for e in rollout.episodes], "turn_ends": [e.turn_ends for e in rollout.episodes]}


class Environment(Protocol):
    def rollout(self, generator: Generator, examples: Sequence[Example], sampling: Sampling,
                seeds: Sequence[int]) -> Rollout:
        """`sampling.n` episodes per example, example by example (see the module docstring); `seeds`: one per
        example, always given."""
