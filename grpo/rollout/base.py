"""The rollout-backend seam: the `Generator` protocol, the `Rollout` it returns and the `Sampling` it takes
(SPEC 9, steps 1–2). Backends are named in `grpo.rollout.BACKENDS` and built by `build_generator`."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.errors import DataError


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
    completion_mask: torch.Tensor  # (N, T) 1 on every token of the completion (one turn: up to and including its
                                   # first EOS, from positions, SPEC 12; an episode: all its turns and insertions)
    truncated: torch.Tensor        # (N,) bool: cut off by a length limit (no EOS within max_new_tokens, ...)
    texts: list[str]               # decoded completions, EOS and padding left out
    # (N, T) 1 on the tokens that are the model's to learn: the generator's own tokens are (completion_mask, the
    # default); an environment zeroes the tokens it inserted itself (tool output, say)
    loss_mask: torch.Tensor | None = None
    # (N, T) float32 log-probs the sampling engine reported for the tokens it sampled, 0 on padding; None when
    # the sampler is the trainer's own forward (the in-process generator), whose log-probs the trainer computes
    sampler_logp: torch.Tensor | None = None
    # one `grpo.envs.base.Episode` per row from a multi-turn environment (what it recorded: messages, turn ends,
    # calls, why it ended); None for single completions
    episodes: list | None = None

    def __post_init__(self):
        n, t = self.completion_ids.shape
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask.clone()
        check_shapes("Rollout", {k: getattr(self, k) for k in ("completion_mask", "loss_mask", "sampler_logp")},
                     (n, t), f"completion_ids has {(n, t)}")
        if self.prompt_ids.shape[0] != n or self.prompt_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"Rollout prompts have shapes {tuple(self.prompt_ids.shape)} and "
                             f"{tuple(self.prompt_mask.shape)} for {n} completions")
        if self.truncated.shape != (n,) or len(self.texts) != n:
            raise ValueError(f"Rollout has {n} completions but {tuple(self.truncated.shape)} truncation flags "
                             f"and {len(self.texts)} texts")
        if self.episodes is not None and len(self.episodes) != n:
            raise ValueError(f"Rollout has {n} completions but {len(self.episodes)} episodes")

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:  # (N,) tokens per completion, EOS included
        return self.completion_mask.sum(1)

    def map(self, fn) -> Rollout:
        """The same rollout with `fn` applied to each of its tensors (None stays None)."""
        f = lambda x: None if x is None else fn(x)  # noqa: E731
        return Rollout(f(self.prompt_ids), f(self.prompt_mask), f(self.completion_ids), f(self.completion_mask),
                       f(self.truncated), self.texts, f(self.loss_mask), f(self.sampler_logp), self.episodes)

    def to(self, device) -> Rollout:
        """The same rollout with its tensors on `device`."""
        return self.map(lambda x: x.to(device))

    def select(self, rows: Sequence[int]) -> Rollout:
        """These rows, in this order."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.completion_ids.device)
        pick = lambda x: None if x is None else x.index_select(0, index)  # noqa: E731
        return Rollout(pick(self.prompt_ids), pick(self.prompt_mask), pick(self.completion_ids),
                       pick(self.completion_mask), pick(self.truncated), [self.texts[i] for i in index.tolist()],
                       pick(self.loss_mask), pick(self.sampler_logp),
                       None if self.episodes is None else [self.episodes[i] for i in index.tolist()])


def check_shapes(owner: str, tensors: dict[str, torch.Tensor | None], shape: tuple, expected: str) -> None:
    """A ValueError naming the first of `tensors` (None skipped) whose shape is not `shape`."""
    for name, x in tensors.items():
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{owner}.{name} has shape {tuple(x.shape)}; {expected}")


def concat_rollouts(parts: Sequence[Rollout], pad_id: int) -> Rollout:
    """The rows of `parts` one after another; prompts re-padded on the left, completions on the right, to the
    widest part. Sampler log-probs are kept only when every part has them."""
    def cat(tensors: list[torch.Tensor], value, left: bool) -> torch.Tensor:
        width = max(t.shape[1] for t in tensors)
        padded = []
        for t in tensors:
            fill = t.new_full((t.shape[0], width - t.shape[1]), value)
            padded.append(torch.cat([fill, t] if left else [t, fill], dim=1))
        return torch.cat(padded)

    logp = episodes = None
    if all(p.sampler_logp is not None for p in parts):
        logp = cat([p.sampler_logp for p in parts], 0.0, False)
    if all(p.episodes is not None for p in parts):
        episodes = [e for p in parts for e in p.episodes]
    return Rollout(cat([p.prompt_ids for p in parts], pad_id, True), cat([p.prompt_mask for p in parts], 0, True),
                   cat([p.completion_ids for p in parts], pad_id, False),
                   cat([p.completion_mask for p in parts], 0, False), torch.cat([p.truncated for p in parts]),
                   [t for p in parts for t in p.texts], cat([p.loss_mask for p in parts], 0, False), logp,
                   episodes)


def encode_prompts(tokenizer, prompts: list[str] | list[list[int]], add_special_tokens: bool) -> list[list[int]]:
    """Prompts as token ids: texts tokenized, token lists as they are; an empty prompt is an error."""
    ids = [list(p) if not isinstance(p, str) else tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"]
           for p in prompts]
    empty = [p for p, x in zip(prompts, ids) if not x]
    if empty:
        raise DataError(f"the prompt {empty[0]!r} tokenizes to no tokens: empty, or only characters the tokenizer "
                        "has no token for; a causal LM needs at least one")
    return ids


def stop_tokens(model, tokenizer) -> tuple[list[int], int]:
    """(EOS ids, pad id) of a model: its generation config's EOS ids and its tokenizer's, sorted; the pad id is
    the tokenizer's, or the first EOS id."""
    from grpo.errors import DataError

    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    if not eos:
        raise DataError("the model has no EOS token: set eos_token_id in its tokenizer or generation config")
    eos = sorted(set(eos))
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]


def prompt_seeds(seeds: Sequence[int] | None, prompts: int) -> list[int]:
    """One sampling seed per prompt: `seeds` checked against the number of prompts, or (None) drawn from torch's
    global generator."""
    if seeds is None:
        return torch.randint(0, 2**62, (prompts,)).tolist()
    if len(seeds) != prompts:
        raise ValueError(f"seeds has {len(seeds)} entries for {prompts} prompts")
    return list(seeds)


def prompt_limits(limits: Sequence[int] | None, sampling: Sampling, prompts: int) -> list[int]:
    """The most new tokens of each prompt: `limits` checked (1..max_new_tokens each), or max_new_tokens."""
    if limits is None:
        return [sampling.max_new_tokens] * prompts
    if len(limits) != prompts or not all(1 <= k <= sampling.max_new_tokens for k in limits):
        raise ValueError(f"limits must hold {prompts} values in 1..{sampling.max_new_tokens}, got {list(limits)[:8]}")
    return [int(k) for k in limits]


TRAIN, EVAL, SAMPLE = 0, 1, 2  # seed streams, so training, evaluation and `grpo sample` never share draws


def sampling_seed(run_seed: int, stream: int, index: int) -> int:
    """The sampling seed of the `index`-th prompt of a stream: a function of the run's seed and the prompt's
    position alone, so completions do not depend on batching, world size or resumption."""
    return hash((run_seed, stream, index)) & (2**63 - 1)


class Generator(Protocol):
    """A rollout backend. `grpo.rollout.build_generator` makes one from the config; the trainer, `grpo eval` and
    `grpo sample` all sample through it."""

    def generate(self, prompts: list[str] | list[list[int]], sampling: Sampling,
                 seeds: Sequence[int] | None = None, limits: Sequence[int] | None = None) -> Rollout:
        """n completions per prompt, prompt by prompt; prompt i samples from a generator seeded by seeds[i].
        A prompt is a text (tokenized here) or a list of token ids (used as they are: a multi-turn environment
        continues an episode from its exact tokens). `limits[i]` (at most `sampling.max_new_tokens`) is prompt
        i's most new tokens: its completions stop there, truncated, as if max_new_tokens were that; the tokens
        before it are the same as without the limit. None: max_new_tokens for every prompt.
        A backend whose engine reports log-probs of the sampled tokens returns them as `Rollout.sampler_logp`."""

    def sync_weights(self, model) -> None:
        """Make the engine sample from `model`'s current weights. Called after every training step (and after
        a resume); a no-op for a generator that samples from the training model itself."""

    def close(self) -> None:
        """Release the engine (the trainer calls it when the run ends, however it ends)."""
