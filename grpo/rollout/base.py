"""The rollout-backend seam: the `Generator` protocol, the `Rollout` it returns and the `Sampling` it takes
(SPEC 9, steps 1–2). Backends are named in `grpo.rollout.BACKENDS` and built by `build_generator`."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.errors import DataError
from grpo.rows import PAD, Rows, column


@dataclass(frozen=True)
class Sampling:
    n: int                      # completions per prompt (G)
    max_new_tokens: int
    temperature: float = 1.0    # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0              # 0 keeps the whole vocabulary
    min_new_tokens: int = 0     # EOS is not sampled before this many tokens
    min_p: float = 0.0          # keep the tokens with at least min_p × the top token's probability; 0 keeps all
    repetition_penalty: float = 1.0  # transformers' and vLLM's: a seen token's logit ÷ it (× it if negative)
    stop: tuple[str, ...] = ()  # a completion ends with the token that completes the first of these strings

    @property
    def truncation(self) -> tuple[int, float, float] | None:
        """(top_k, top_p, min_p) when sampling keeps only part of the vocabulary (the loss then replays the kept
        set, SPEC 14.12), else None."""
        if self.top_k > 0 or self.top_p < 1 or self.min_p > 0:
            return self.top_k, self.top_p, self.min_p
        return None


def rollout_sampling(rollout, n: int) -> Sampling:
    """The sampling settings of a `rollout.*` config section (`grpo.config.RolloutConfig`), n completions a prompt."""
    return Sampling(n, rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k,
                    rollout.min_new_tokens, rollout.min_p, rollout.repetition_penalty, tuple(rollout.stop))


def stop_cut(text: str, stop: Sequence[str], since: int = 0) -> str | None:
    """`text` up to and including the stop string of `stop` that ends first at or after character `since` + 1
    (the text of the completion's last token starts at `since`: the one that completed it), or None when none
    does. Ties: the first in `stop`. What vLLM does with include_stop_str_in_output=True."""
    best = None
    for s in stop:
        at = text.find(s, max(0, since - len(s) + 1))
        if at >= 0 and (best is None or at + len(s) < best):
            best = at + len(s)
    return None if best is None else text[:best]


def stop_text(tokenizer, tokens: Sequence[int], text: str, stop: Sequence[str]) -> str | None:
    """`text` (the decoding of `tokens`, `skip_special_tokens=True`) cut after the stop string its last token
    completed (`stop_cut`, the last token's text starting where the decoding of the tokens before it ends), or
    None when the last token completed none."""
    return stop_cut(text, stop, len(tokenizer.decode(list(tokens)[:-1], skip_special_tokens=True)))


@dataclass
class Rollout(Rows):
    """N = prompts × n completions, prompt by prompt (the n completions of a prompt are consecutive)."""

    prompt_ids: torch.Tensor = column("padded", fill=PAD, left=True)  # (N, Lp) left-padded
    prompt_mask: torch.Tensor = column("padded", left=True)           # (N, Lp) 1 on prompt tokens
    completion_ids: torch.Tensor = column("padded", fill=PAD)         # (N, T) right-padded with the pad id
    # (N, T) 1 on every token of the completion (one turn: up to and including its first EOS, from positions,
    # SPEC 12; an episode: all its turns and insertions)
    completion_mask: torch.Tensor = column("padded")
    truncated: torch.Tensor = column("rows")  # (N,) bool: cut off by a length limit (no EOS within max_new_tokens, ...)
    # decoded completions, EOS and padding left out; a completion ended by a stop string (`Sampling.stop`: its
    # last token completed it, and is not EOS) is decoded up to and including that string
    texts: list[str] = column("items")
    # (N, T) 1 on the tokens that are the model's to learn: the generator's own tokens are (completion_mask, the
    # default); an environment zeroes the tokens it inserted itself (tool output, say)
    loss_mask: torch.Tensor | None = column("padded", default=None)
    # (N, T) float32 log-probs the sampling engine reported for the tokens it sampled, 0 on padding; None when
    # the sampler is the trainer's own forward (the in-process generator), whose log-probs the trainer computes
    sampler_logp: torch.Tensor | None = column("padded", fill=0.0, default=None)
    # one `grpo.envs.base.Episode` per row from a multi-turn environment (what it recorded: messages, turn ends,
    # calls, why it ended); None for single completions
    episodes: list | None = column("items", default=None)
    # (N,) long: the weight version of the generator that sampled the row (`Generator.version`: 0 as built, one
    # more after every `sync_weights`; an episode of several turns: its first turn's); None where not reported
    version: torch.Tensor | None = column("rows", default=None)
    # one `grpo.vision.Images` per row (None for a row without images): its prompt's image tensors, which every
    # forward over the row takes with it; None when no prompt has images
    images: list | None = column("items", default=None)

    def __post_init__(self):
        n, t = self.completion_ids.shape
        if self.images is not None and len(self.images) != n:
            raise ValueError(f"Rollout has {n} completions but {len(self.images)} image entries")
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
        check_shapes("Rollout", {"version": self.version}, (n,), f"it must be ({n},)")

    @property
    def lengths(self) -> torch.Tensor:  # (N,) tokens per completion, EOS included
        return self.completion_mask.sum(1)

    @classmethod
    def from_tokens(cls, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, pad_id: int,
                    truncated: Sequence[bool] | None = None, texts: Sequence[str] | None = None, tokenizer=None,
                    loss_masks: Sequence[Sequence[int]] | None = None,
                    logprobs: Sequence[Sequence[float]] | None = None, episodes: Sequence | None = None,
                    version: int | Sequence[int] | None = None, device=None) -> Rollout:
        """A Rollout from each row's token lists, padded as the built-in generators and environments pad theirs:
        prompts on the left, completions on the right, with `pad_id`; masks and ids int64, `truncated` bool,
        log-probs float32. One entry per row (N = examples × n, example by example) in every list:
        - `prompts[i]`: what the model was first given; `completions[i]`: everything after it, the model's turns
          and what the environment inserted between them, ending with the EOS the model wrote unless
          `truncated[i]` (None: no row is truncated);
        - `texts[i]`: what the rewards score; None decodes it with `tokenizer`: the row's tokens before its EOS,
          `skip_special_tokens=True`, as the contract asks (grpo.envs.base);
        - `loss_masks[i]`: 1 on the model's tokens, 0 on the environment's (None: every token is the model's);
        - `logprobs[i]`: the sampler's log-probs of the model's tokens (0 elsewhere), if the engine gave them;
        - `episodes`: one `grpo.envs.base.Episode` per row (multi-turn), or None; `version`: the weight version
          that sampled each row (one int for all, or one per row; `Generator.version`), or None."""
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"Rollout.from_tokens: {len(prompts)} prompts for {n} completions (one per row)")
        truncated = [False] * n if truncated is None else [bool(t) for t in truncated]
        for name, rows in (("loss_masks", loss_masks), ("logprobs", logprobs)):
            if rows is not None and [len(r) for r in rows] != [len(c) for c in completions]:
                raise ValueError(f"Rollout.from_tokens: {name} must have one entry per completion token, row by row")
        if any(not p for p in prompts):
            raise ValueError("Rollout.from_tokens: a prompt has no tokens")
        if texts is None:
            if tokenizer is None:
                raise ValueError("Rollout.from_tokens: give texts, or a tokenizer to decode them")
            texts = [tokenizer.decode(list(c)[:len(c) - (not t)], skip_special_tokens=True)
                     for c, t in zip(completions, truncated)]
        lp, width = max(len(p) for p in prompts), max(1, max(len(c) for c in completions))
        prompt_ids = torch.full((n, lp), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, lp), dtype=torch.long)
        ids = torch.full((n, width), pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        loss = torch.zeros((n, width), dtype=torch.long) if loss_masks is not None else None
        logp = torch.zeros((n, width), dtype=torch.float32) if logprobs is not None else None
        for i, (p, c) in enumerate(zip(prompts, completions)):
            k = len(c)
            prompt_ids[i, lp - len(p):] = torch.tensor(list(p), dtype=torch.long)
            prompt_mask[i, lp - len(p):] = 1
            ids[i, :k] = torch.tensor(list(c), dtype=torch.long)
            mask[i, :k] = 1
            if loss is not None:
                loss[i, :k] = torch.tensor(list(loss_masks[i]), dtype=torch.long)
            if logp is not None:
                logp[i, :k] = torch.tensor(list(logprobs[i]), dtype=torch.float32)
        if loss is not None and not bool(((loss == 0) | (loss == 1)).all()):
            raise ValueError("Rollout.from_tokens: loss_masks hold 0 (the environment's token) or 1 (the model's)")
        if isinstance(version, int):
            version = [version] * n
        rollout = cls(prompt_ids, prompt_mask, ids, mask, torch.tensor(truncated, dtype=torch.bool), list(texts),
                      loss, logp, None if episodes is None else list(episodes),
                      None if version is None else torch.tensor(list(version), dtype=torch.long))
        return rollout if device is None else rollout.to(device)


def check_shapes(owner: str, tensors: dict[str, torch.Tensor | None], shape: tuple, expected: str) -> None:
    """A ValueError naming the first of `tensors` (None skipped) whose shape is not `shape`."""
    for name, x in tensors.items():
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{owner}.{name} has shape {tuple(x.shape)}; {expected}")


def concat_rollouts(parts: Sequence[Rollout], pad_id: int) -> Rollout:
    """The rows of `parts` one after another (`Rows.concat`): prompts re-padded on the left, completions on the
    right, to the widest part. Sampler log-probs (episodes, versions) are kept only when every part has them."""
    return Rollout.concat(parts, pad_id)


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

    # the version of the weights it samples from: 0 as built, one more after every `sync_weights` (or the one
    # `sync_weights` was given); every row it returns carries it (`Rollout.version`), so that rows sampled ahead
    # of the trainer can be told by the weights that sampled them (SPEC 14.1, staleness)
    version: int

    def generate(self, prompts: list[str] | list[list[int]], sampling: Sampling,
                 seeds: Sequence[int] | None = None, limits: Sequence[int] | None = None) -> Rollout:
        """n completions per prompt, prompt by prompt; prompt i samples from a generator seeded by seeds[i].
        A prompt is a text (tokenized here) or a list of token ids (used as they are: a multi-turn environment
        continues an episode from its exact tokens). `limits[i]` (at most `sampling.max_new_tokens`) is prompt
        i's most new tokens: its completions stop there, truncated, as if max_new_tokens were that; the tokens
        before it are the same as without the limit. None: max_new_tokens for every prompt.
        A backend whose engine reports log-probs of the sampled tokens returns them as `Rollout.sampler_logp`;
        every backend sets `Rollout.version` to its `version`."""

    def sync_weights(self, model, version: int | None = None) -> None:
        """Make the engine sample from `model`'s current weights, whose version is `version` (None: one more
        than now). Called after every training step (and after a resume, with the steps done); for a generator
        that samples from the training model itself only the version moves. An engine of its own (the vLLM
        backends) also takes a `grpo.rollout.vllm_common.snapshot_weights` dict for `model`: weights of an
        earlier version, for asynchronous sampling (`grpo.ahead`)."""

    def close(self) -> None:
        """Release the engine (the trainer calls it when the run ends, however it ends)."""
