"""Rollouts with any `transformers` causal LM: batched sampling with a KV cache.

The prompts of a batch are encoded and prefilled once; the cache is then repeated for the n completions of
each prompt. Every prompt draws its randomness from its own generator, seeded by the caller (one uniform
number per completion and token, by inverse transform sampling), so a prompt's completions depend on its seed
and the model only: not on which other prompts share the batch, how the batch is split, or how many processes
there are. Masks come from positions: a completion is loss-bearing up to and including its first EOS, whatever
the pad and EOS ids are (SPEC 11, item 4), or the token that completes a stop string (`Sampling.stop`). The
repetition penalty acts on the logits before the temperature and min-p, top-k and top-p; min-p is part of the kept
set the trainer replays (`grpo.algo.sampling_keep_mask`), the repetition penalty is not.

Finished rows (EOS, a stop string, the row's limit) stop being computed: when the unfinished rows fall to 3/4 of
the rows the decoding state holds, the state keeps only them (`rows_to_keep`, then `keep` of `LeanDecoding` or of
the transformers cache), topped up to a multiple of 8 rows, so that every matmul row keeps its bits; the sampling,
the repetition penalty and the noise then take the rows held, the masks and stop strings all rows. The tokens are
those of decoding every row to the end, bit for bit (tests/data/decoding_reference.json; with transformers' own
forward in float32 SDPA on several CPU threads the attention of a moved row may differ in its last bits, which the
recorded tokens never felt). With several processes each steps until all are done, its state never emptied.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from grpo.algo.logprobs import sampling_keep_mask
from grpo.policy.context import inference
from grpo.policy.inputs import model_inputs
from grpo.rollout.base import (Rollout, Sampling, concat_rollouts, encode_prompts, prompt_limits, prompt_seeds,
                               stop_text, stop_tokens)
from grpo.errors import DataError
from grpo.rollout.lean_decoding import LeanDecoding
from grpo.images import NO_VISION_TOWER, VisionPrompt
from grpo.vision import Images, join, mask_placeholders, placeholder_ids


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' `RepetitionPenaltyLogitsProcessor` (and vLLM's repetition_penalty, CTRL's definition): the
    logit of every token in `seen` (N, L) token ids, the prompt's and the completion's so far, divided by `penalty`
    where positive, multiplied by it where negative; a float32 copy of `logits` (N, V), before the temperature."""
    logits = logits.float()
    picked = logits.gather(1, seen)
    return logits.scatter(1, seen, torch.where(picked < 0, picked * penalty, picked / penalty))


def sample_next(logits: torch.Tensor, sampling: Sampling, uniform: torch.Tensor | None) -> torch.Tensor:
    """Next tokens (N,) from logits (N, V): greedy at temperature 0, else min-p / top-k / top-p / temperature.

    `uniform` (N,) holds one U(0, 1) number per row; the token is the first whose cumulative probability under
    softmax(filtered logits / T) exceeds it (inverse transform sampling: an exact draw, with one random number
    per row where the Gumbel-max trick needs V, and one exponential per logit where it needs two logarithms).
    A token of probability zero is never drawn: its cumulative probability equals its predecessor's.
    """
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if sampling.truncation is not None:  # the set the trainer replays (SPEC 14.12)
        keep = sampling_keep_mask(logits, None, *sampling.truncation)
        logits = logits.masked_fill(~keep, float("-inf"))
    cdf = torch.softmax(logits, dim=-1).cumsum_(dim=-1)
    target = (uniform.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)  # scaled by the total: no rounding past the end
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


# Dropping finished rows. A matrix product computes a row's bits alike whatever the batch's size only for rows in
# a full group of its kernel's rows (MKL's sgemm and dgemm on an AVX2 CPU: groups of 4; a row of the last M mod 4
# may round otherwise, e.g. M = 1 to 3 at one thread, M = 5 to 7 and 9 to 11 at two): the state kept is a
# multiple of _ROW_GROUP rows (8: a margin over 4), topped up with finished rows, and a batch whose size is not a
# multiple keeps all its rows while one of its last N mod _ROW_GROUP is unfinished. Each compaction copies the keys
# and values of the rows kept; with at most _COMPACT_AT of the rows held each time, a batch copies at most
# 3 N rows' in all (3/4 + 9/16 + ...), and every step after one computes a quarter fewer rows or better.
_ROW_GROUP = 8
_COMPACT_AT = 0.75


def rows_to_keep(held: torch.Tensor, finished: torch.Tensor, total: int) -> torch.Tensor | None:
    """The positions in `held` (M,), the batch rows a decoding state holds, of the rows to keep, ascending; None
    to keep them all. `finished` (N,): the batch's rows that are done (N = `total`). The unfinished rows are kept,
    topped up with the first finished ones to a multiple of `_ROW_GROUP` rows, when that is at most `_COMPACT_AT`
    of M and none of the batch's last N mod `_ROW_GROUP` rows is unfinished (see above); never no rows."""
    live = ~finished.index_select(0, held)
    count = int(live.sum())
    target = -(-count // _ROW_GROUP) * _ROW_GROUP
    if count == 0 or target > _COMPACT_AT * len(held) or bool((live & (held >= total - total % _ROW_GROUP)).any()):
        return None
    fill = (~live).nonzero().squeeze(1)[:target - count]
    return live.index_fill(0, fill, True).nonzero().squeeze(1)


class HFGenerator:
    """Sampling from a `transformers` causal LM on the device of its weights: the training model itself, so
    `sync_weights` has nothing to do and the trainer computes the old log-probs (`Rollout.sampler_logp` is None)."""

    def __init__(self, model, tokenizer, *, max_batch_prompts: int = 256,
                 all_finished: Callable[[bool], bool] | None = None, add_special_tokens: bool = True,
                 autocast_bf16: bool = False, lean: bool = True, image_prompts=None):
        """`lean`: decode with `grpo.rollout.lean_decoding` where the architecture allows (same logits, less
        overhead per step); otherwise, and always when False, with the model's own forward.
        `all_finished(done)`: with several processes whose forward passes are collective (FSDP), True only
        when every process's batch is done, so all of them run the same number of decoding steps.
        `add_special_tokens=False` for prompts already rendered by a chat template (which adds BOS itself).
        `image_prompts`: a vision-language model's `grpo.images.ImagePrompts`, which encodes the prompts that hold
        images (`grpo.images.VisionPrompt`); their placeholder tokens are never sampled."""
        self.model = model
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens
        self.autocast_bf16 = autocast_bf16
        self.lean = lean
        self.max_batch_prompts = max_batch_prompts
        self.all_finished = all_finished or (lambda done: done)
        eos, self.pad_id = stop_tokens(model, tokenizer)
        self.eos_ids = torch.tensor(eos)
        self.image_prompts = image_prompts
        banned = placeholder_ids(model)
        self.banned = torch.tensor(banned, dtype=torch.long) if banned else None
        self.version = 0

    def sync_weights(self, model, version: int | None = None) -> None:
        """Only the version moves: this generator samples from the model being trained."""
        self.version = self.version + 1 if version is None else version

    def close(self) -> None:
        """Nothing to release."""

    def generate(self, prompts: list[str] | list[list[int]], sampling: Sampling,
                 seeds: Sequence[int] | None = None, limits: Sequence[int] | None = None) -> Rollout:
        """n completions per prompt (texts, or token ids used as they are); `seeds` gives each prompt's sampling
        seed (None: drawn from torch's global generator); `limits`, each prompt's most new tokens."""
        seeds = prompt_seeds(seeds, len(prompts))
        limits = prompt_limits(limits, sampling, len(prompts))
        b = self.max_batch_prompts
        parts = []
        for start in itertools.count(0, b):
            # batch by batch; with several processes every one runs as many batches as the one with the most
            # prompts (a multi-turn environment's later turns differ in size), since each decoding step asks
            # `all_finished`, a collective
            if self.all_finished(start >= len(prompts)):
                break
            if start >= len(prompts):
                self._generate(prompts[:1], replace(sampling, n=1), seeds[:1], [1])
                continue
            parts.append(self._generate(prompts[start:start + b], sampling, seeds[start:start + b],
                                        limits[start:start + b]))
        return parts[0] if len(parts) == 1 else concat_rollouts(parts, self.pad_id)

    def _generate(self, prompts: list, sampling: Sampling, seeds: Sequence[int], limits: list[int]) -> Rollout:
        # inference mode skips autograd's bookkeeping on every op; the results are cloned out of it, as
        # inference tensors cannot be saved for a backward pass (the training forward embeds these ids)
        with inference(self.model), torch.autocast(self.model.device.type, dtype=torch.bfloat16,
                                                    enabled=self.autocast_bf16):
            r = self._sample(prompts, sampling, seeds, limits)
        images = None if r.images is None else [None if x is None else _cloned(x) for x in r.images]
        return Rollout(r.prompt_ids.clone(), r.prompt_mask.clone(), r.completion_ids.clone(),
                       r.completion_mask.clone(), r.truncated.clone(), r.texts,
                       version=torch.full((len(r),), self.version, dtype=torch.long, device=r.completion_ids.device),
                       images=images)

    def _encode(self, prompts: list) -> tuple[list[list[int]], list | None]:
        """The prompts' token ids, and each one's `grpo.vision.Images` (None where it has none; the list None
        when none has any)."""
        if not any(isinstance(p, VisionPrompt) for p in prompts):
            return encode_prompts(self.tokenizer, prompts, self.add_special_tokens), None
        if self.image_prompts is None:
            raise DataError(NO_VISION_TOWER)
        ids, images = [], []
        for k, p in enumerate(prompts):
            if isinstance(p, VisionPrompt):
                x, im = self.image_prompts.encode(p, f"prompt {k} of the batch")
            else:
                x, im = encode_prompts(self.tokenizer, [p], self.add_special_tokens)[0], None
            ids.append(x)
            images.append(im)
        return ids, images

    def _sample(self, prompts: list, sampling: Sampling, seeds: Sequence[int], limits: list[int]) -> Rollout:
        device = self.model.device
        ids, images = self._encode(prompts)
        width = max(len(x) for x in ids)
        prompt_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):  # left-padded
            prompt_ids[i, width - len(x):] = torch.tensor(x, dtype=torch.long)
            prompt_mask[i, width - len(x):] = 1
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        n = sampling.n
        eos_ids = self.eos_ids.to(device)
        steps = sampling.max_new_tokens
        noise = None  # (steps, N): each prompt's n rows from that prompt's generator, one row of draws a step
        if sampling.temperature > 0:
            gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
            noise = torch.cat([torch.rand(steps, n, generator=g) for g in gens], dim=1).to(device)
        lean = LeanDecoding.prefill(self.model, prompt_ids, prompt_mask, n, steps) \
            if self.lean and images is None else None
        state, logits = lean or _TransformersDecoding.prefill(self.model, prompt_ids, prompt_mask, n,
                                                              join(images, device))
        banned = None if self.banned is None else self.banned.to(device)

        total = logits.shape[0]
        held = torch.arange(total, device=device)  # the rows the decoding state holds, in its order
        finished = torch.zeros(total, dtype=torch.bool, device=device)  # by EOS or at the row's limit
        ended = torch.zeros(total, dtype=torch.bool, device=device)  # by EOS or a stop string
        cap = torch.tensor(limits, device=device).repeat_interleave(n)
        lengths = torch.full((total,), steps, dtype=torch.long, device=device)
        seen = None  # (held rows, Lp + t): the tokens the repetition penalty acts on, the prompt's padding left out
        if sampling.repetition_penalty != 1:
            # a padded position repeats the row's last prompt token, which the penalty sees anyway
            seen = torch.where(prompt_mask.bool(), prompt_ids, prompt_ids[:, -1:]).repeat_interleave(n, dim=0)
        stops = _StopStrings(self.tokenizer, sampling.stop, total) if sampling.stop else None
        tokens = []
        for t in range(steps):
            # logits and seen: the held rows'; tokens, finished, ended and lengths: all rows'
            # image placeholders are the prompt's, never the model's to write (the trainer masks them alike)
            logits = mask_placeholders(logits, banned)
            if t < sampling.min_new_tokens:
                logits = logits.index_fill(-1, eos_ids, float("-inf"))
            if seen is not None:
                logits = repetition_penalty(logits, seen, sampling.repetition_penalty)
            nxt = sample_next(logits, sampling, None if noise is None else noise[t].index_select(0, held))
            nxt = torch.where(finished.index_select(0, held), torch.full_like(nxt, self.pad_id), nxt)
            tokens.append(torch.full_like(finished, self.pad_id, dtype=nxt.dtype).index_copy_(0, held, nxt))
            if seen is not None:
                seen = torch.cat([seen, nxt.unsqueeze(1)], dim=1)
            stop = ~finished & torch.isin(tokens[-1], eos_ids)
            if stops is not None:  # looked for after min_new_tokens, as vLLM does after min_tokens
                stop |= stops.step(tokens[-1], finished, check=t + 1 > sampling.min_new_tokens).to(device)
            ended |= stop
            stop |= ~finished & (cap <= t + 1)
            lengths[stop] = t + 1
            finished |= stop
            if self.all_finished(bool(finished.all())) or t + 1 == steps:
                break
            keep = rows_to_keep(held, finished, total)
            if keep is not None:  # drop finished rows: every later step computes only the rows kept
                state.keep(keep)
                held, nxt = held.index_select(0, keep), nxt.index_select(0, keep)
                seen = None if seen is None else seen.index_select(0, keep)
            logits = state.step(nxt)

        completion_ids = torch.stack(tokens, dim=1)  # (N, T)
        width = completion_ids.shape[1]
        completion_mask = (torch.arange(width, device=device) < lengths.unsqueeze(1)).long()
        truncated = ~ended
        return Rollout(prompt_ids.repeat_interleave(n, dim=0), prompt_mask.repeat_interleave(n, dim=0),
                       completion_ids, completion_mask, truncated, self._texts(completion_ids, lengths, ended, stops),
                       images=None if images is None else [x for x in images for _ in range(n)])

    def _texts(self, completion_ids: torch.Tensor, lengths: torch.Tensor, ended: torch.Tensor,
               stops: _StopStrings | None) -> list[str]:
        """The completions' texts: the tokens before EOS (EOS itself is not text); after a stop string, the
        tokens up to and including the one that completed it, the text cut after the string."""
        by_string = stops.ended.to(ended.device) if stops is not None else torch.zeros_like(ended)
        text_len = (lengths - (ended & ~by_string).long()).tolist()
        texts = self.tokenizer.batch_decode([row[:k].tolist() for row, k in zip(completion_ids, text_len)],
                                            skip_special_tokens=True)
        for i in by_string.nonzero().flatten().tolist():  # cut after the string, as vLLM's engine does
            texts[i] = stop_text(self.tokenizer, completion_ids[i, :text_len[i]].tolist(), texts[i], stops.stop) \
                or texts[i]
        return texts

def _cloned(x: Images) -> Images:
    return Images(x.pixel_values.clone(), None if x.image_grid_thw is None else x.image_grid_thw.clone())


class _TransformersDecoding:
    """Decoding with the model's own forward and cache (any causal LM whose cache has transformers'
    `batch_repeat_interleave` and `batch_select_indices`), with the methods of `LeanDecoding`: `step(tokens)` ->
    the next logits of the rows held, `keep(rows)`."""

    def __init__(self, model, cache, attn: torch.Tensor, next_pos: torch.Tensor):
        self.model, self.cache, self.attn, self.next_pos = model, cache, attn, next_pos

    @classmethod
    def prefill(cls, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, images: dict | None = None):
        """The prompts prefilled once and the cache repeated for the n completions of each: the state and the
        first logits (P·n, V). `images`: the prompts' image tensors (`grpo.vision.join`); the decoding steps then
        go on from each row's last position (`ModelInputs.next_position`), the same on every rotary axis."""
        inputs = model_inputs(prompt_ids, prompt_mask, images, model)
        out = model(**inputs.forward_kwargs(), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)  # prefill once per prompt, share it across the group
        state = cls(model, cache, prompt_mask.repeat_interleave(n, dim=0),
                    inputs.next_position.unsqueeze(1).repeat_interleave(n, dim=0))
        return state, out.logits[:, -1].repeat_interleave(n, dim=0)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the cache, attention mask and positions of `rows` (indices of the rows held now)."""
        self.cache.batch_select_indices(rows)
        self.attn, self.next_pos = self.attn.index_select(0, rows), self.next_pos.index_select(0, rows)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) of the N rows held after feeding `tokens` (N,)."""
        self.attn = torch.cat([self.attn, torch.ones_like(self.attn[:, :1])], dim=1)
        out = self.model(input_ids=tokens.unsqueeze(1), attention_mask=self.attn, position_ids=self.next_pos,
                         past_key_values=self.cache, use_cache=True)
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1]


class _StopStrings:
    """Which rows' last token completed one of the stop strings: each step decodes the last few tokens of every
    unfinished row (enough for the longest string, one byte a token at worst, and a token before it for the
    tokenizer's context) and looks for a string ending in the text of the last token, the one that completes it:
    vLLM's rule (its detokenizer looks for the strings in each new token's text and the few characters before)."""

    def __init__(self, tokenizer, stop: tuple[str, ...], rows: int):
        self.tokenizer, self.stop = tokenizer, stop
        self.window = max(len(s.encode("utf-8")) for s in stop) + 2
        self.history: list[list[int]] = [[] for _ in range(rows)]
        self.ended = torch.zeros(rows, dtype=torch.bool)  # by a stop string

    def step(self, tokens: torch.Tensor, finished: torch.Tensor, check: bool = True) -> torch.Tensor:
        """Add this step's tokens (N,); (N,) bool on the CPU: the rows (not `finished` before) ended by them."""
        open_rows = (~finished).nonzero().squeeze(1).tolist()
        values = tokens.tolist()
        for i in open_rows:
            self.history[i].append(values[i])
        hit = torch.zeros(len(self.history), dtype=torch.bool)
        if not check or not open_rows:
            return hit
        texts = self.tokenizer.batch_decode([self.history[i][-self.window:] for i in open_rows],
                                            skip_special_tokens=True)
        for i, text in zip(open_rows, texts):
            # a string in the window: it counts if it ends in the last token's text (one found earlier was not
            # looked for, within min_new_tokens)
            if any(s in text for s in self.stop) and \
                    stop_text(self.tokenizer, self.history[i][-self.window:], text, self.stop) is not None:
                hit[i] = True
        self.ended |= hit
        return hit
