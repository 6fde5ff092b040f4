"""Loop steps 5–7, `Experience` → policy updates: reference and old log-probs without gradients, once per batch of
rollouts, then its updates, each accumulating gradients over micro-batches with its own normaliser (SPEC 9, 12):
μ updates of the whole batch, or with `train.steps_per_generation` = S its S mini-batches of whole groups, one
update each, replayed μ times, every one against the old log-probs of the policy before the first (SPEC 14.8).

Nothing here branches on a variant: the algorithm's choices are one `grpo.algo.LossSpec`, handed as it is to
`grpo.algo.policy_loss`, `loss_normalizer` and `sampler_weights`. The per-token advantages and the loss mask come
from the Experience as they are. When the sampler is an engine of its own (vLLM), `Experience.sampler_logp` holds
its log-probs and the policy term is weighted by the sampler–trainer correction `grpo.algo.sampler_weights`
(SPEC 13.1), with the trainer's old log-probs (the weights the sampler was given) against the sampler's. The
in-process generator reports none: its log-probs are the trainer's own, so the weight is exactly 1 and nothing is
computed.

Nothing in the micro-batch loop waits for the device: the figures are summed as float64 tensors where they are
computed (in the order the micro-batches come, so the sums are those of adding their values one by one) and come
to the host once per update, with the gradient norm that decides whether the update is applied.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from grpo.algo import (LossSpec, applied_entropy_coef, entropy_bonus, entropy_figures, entropy_threshold,
                       loss_normalizer, next_entropy_coef, policy_loss, proximal_terms, top_entropy_mask)
from grpo.algo.entropy import QUARTERS, position_quarters, quarter_counts, quarter_index
from grpo.distributed import Dist, no_sync
from grpo.experience import Experience
from grpo.policy import inference
from grpo.vision import join


@dataclass
class EntropyControl:
    """The adaptive entropy coefficient between optimiser steps (SPEC 14.7; `algo.use_adaptive_entropy`): c_k, and
    H_{k−1}, the mean entropy of the last step (+∞ before the first). The trainer checkpoints both."""

    coef: float
    last_entropy: float = math.inf


@dataclass(frozen=True)
class Learner:
    """The modules, the optimiser and the settings of the update, bound once when the trainer builds it."""

    trainable: torch.nn.Module               # a LogprobModule, possibly in DDP or over FSDP2 shards
    reference: torch.nn.Module | None        # the frozen reference's LogprobModule; None when spec.beta = 0
    optimizer: torch.optim.Optimizer
    spec: LossSpec                           # the algorithm's choices (algo.*)
    temperature: float                       # log-probs from logits / the sampling temperature
    chunk_size: int
    max_rows: int                            # compute.micro_batch_size
    max_tokens: int                          # compute.micro_batch_tokens (0: no cap)
    max_grad_norm: float                     # 0: no clipping
    entropy: EntropyControl | None = None    # the adaptive entropy coefficient's state; None: a fixed one
    steps_per_generation: int = 1            # mini-batches (optimiser updates) per batch of rollouts, each ×μ
    truncation: tuple[int, float] | None = None  # (top_k, top_p) of truncated sampling, None without: the ratio is
    # then to the policy renormalised over the kept set of each position, the KL stays full-vocabulary (SPEC 14.12)


# the figures of `policy_loss` that are not means over the loss tokens (the others are summed as mean × tokens)
_LOSS_PARTS = ("loss/policy", "loss/kl", "loss/entropy", "tokens")


def learn(learner: Learner, exp: Experience, dist: Dist) -> list[dict]:
    """The updates of one batch of rollouts `exp` (this process's rows; every process calls it): its
    `steps_per_generation` mini-batches, each one optimiser update, replayed μ times (SPEC 14.8); one dict of
    summed figures per update (`grpo.metrics.step_metrics` reduces them). With one mini-batch, μ updates on the
    whole batch."""
    spec, steps = learner.spec, learner.steps_per_generation
    whole = list(micro_batches(exp.prompt_mask, exp.completion_mask, learner.max_rows, learner.max_tokens))
    # 6. reference and old log-probs without gradients, once per batch: π_old is the policy before the batch's first
    # update, for every mini-batch (the ratio of mini-batch m is to θ_vprox, m − 1 updates back)
    ref_logp = _logprobs_no_grad(learner, learner.reference, exp, whole)[0] if learner.reference is not None else None
    masking = spec.top_entropy_quantile < 1
    reused = spec.num_iterations > 1 or steps > 1  # else one update: the ratio is to the training pass itself
    old_logp, old_entropy = (_logprobs_no_grad(learner, learner.trainable, exp, whole, entropy=masking, ratio=reused)
                             if reused or masking else (None, None))
    if not reused:  # (logp.detach())
        old_logp = None
    minis = [_mini_batch(learner, exp, rows, whole, ref_logp, old_logp, old_entropy, dist)
             for rows in mini_batch_rows(exp.group, steps)]
    # 7. the updates: each mini-batch in turn, μ times
    return [_update(learner, dist, *m) for _ in range(spec.num_iterations) for m in minis if m is not None]


def mini_batch_rows(group: torch.Tensor, steps: int) -> list[list[int]]:
    """The rows of each of `steps` mini-batches: whole groups, group g in mini-batch g mod `steps` (interleaved, so
    that with as many groups on every process the mini-batches of several processes together are those of one
    process holding them all). One mini-batch: every row, in order."""
    if steps == 1:
        return [list(range(group.numel()))]
    which = (group % steps).tolist()
    return [[i for i, k in enumerate(which) if k == m] for m in range(steps)]


def _mini_batch(learner: Learner, exp: Experience, rows: list[int], exp_parts, ref_logp, old_logp, old_entropy,
                dist: Dist):
    """What one optimiser update needs of the rows `rows` of `exp` (None when no process has any: the step then
    makes fewer updates, on every process alike): the rows, their micro-batches and quarters, the normaliser
    and the loss-token count over this update's rows of every process, their reference and old log-probs, and the
    top-entropy mask. `exp_parts`: the micro-batches of the whole of `exp`, which a mini-batch of every row keeps."""
    spec = learner.spec
    whole = len(rows) == len(exp)
    part = exp if whole else exp.select(rows)
    pick = (lambda t: t) if whole else (lambda t: None if t is None else t[rows])
    # 5. the normaliser over this update's rows, from every process's counts: its sequences (an unscorable one,
    # which no reward function scored, is not one: SPEC 14.11) and its loss tokens
    counts = torch.tensor([float(len(part)), float((~part.rewards.isnan()).sum()), float(part.loss_mask.sum())],
                          dtype=torch.float64)
    rows_seen, sequences, tokens = dist.gather(counts).view(-1, 3).sum(0).tolist()
    if not rows_seen:
        return None
    normalizer = loss_normalizer(spec, num_sequences=int(sequences), num_tokens=int(tokens))
    parts = exp_parts if whole else list(micro_batches(part.prompt_mask, part.completion_mask, learner.max_rows,
                                                       learner.max_tokens))
    # top-entropy masking: the threshold over every loss token of the update, on every process (SPEC 13.8)
    keep = None
    if spec.top_entropy_quantile < 1:
        entropy = pick(old_entropy)
        mine = entropy[part.loss_mask.bool()].cpu()
        threshold = entropy_threshold(torch.cat(dist.gather_objects(mine)), spec.top_entropy_quantile)
        keep = top_entropy_mask(entropy, part.loss_mask, threshold)
    return part, parts, _quarters(part, parts), normalizer, tokens, pick(ref_logp), pick(old_logp), keep


def _quarters(exp: Experience, parts) -> list[tuple[list[torch.Tensor], list[int]]]:
    """Each micro-batch's loss tokens by quarter of their episode (`grpo.algo.entropy`): the flat positions and
    the counts, the counts of every micro-batch brought to the host at once, for the whole step."""
    quarters = [position_quarters(exp.loss_mask[rows, ccols], exp.completion_mask[rows, ccols])
                for rows, _, ccols in parts]
    counts = torch.stack([quarter_counts(q) for q in quarters]).tolist() if parts else []
    return [(quarter_index(q, n), n) for q, n in zip(quarters, counts)]


def micro_batches(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, max_rows: int,
                  max_tokens: int = 0) -> Iterator[tuple[slice, slice, slice]]:
    """Consecutive row slices (rows, prompt columns, completion columns), each trimmed to its own longest prompt
    and completion (no padding beyond them): at most `max_rows` rows and, with `max_tokens`, at most that many
    positions (rows × trimmed width; a single longer row still makes a micro-batch of its own)."""
    n, lp = prompt_mask.shape
    prompt_len = prompt_mask.sum(1).clamp(min=1).tolist()
    completion_len = completion_mask.sum(1).clamp(min=1).tolist()
    start = 0
    while start < n:
        end, wp, wc = start + 1, prompt_len[start], completion_len[start]
        while end < n and end - start < max_rows:
            p, c = max(wp, prompt_len[end]), max(wc, completion_len[end])
            if max_tokens and (end + 1 - start) * (p + c) > max_tokens:
                break
            end, wp, wc = end + 1, p, c
        yield slice(start, end), slice(lp - wp, None), slice(0, wc)
        start = end


def _mb_logprobs(learner: Learner, module, exp: Experience, rows, pcols, ccols, entropy: bool = False,
                 ratio: bool = False):
    """A micro-batch's (log-probs, entropies or None, log-probs of the ratio or None): the last, with `ratio`
    and truncated sampling, renormalised over the sampler's kept set (SPEC 14.12); None when they are the first."""
    images = {} if exp.images is None else join(exp.images[rows], exp.completion_ids.device)  # with their rows
    out = module(exp.prompt_ids[rows, pcols], exp.prompt_mask[rows, pcols], exp.completion_ids[rows, ccols],
                 exp.completion_mask[rows, ccols], temperature=learner.temperature, chunk_size=learner.chunk_size,
                 entropy=entropy, truncation=learner.truncation if ratio else None, images=images or None)
    out = out if isinstance(out, tuple) else (out,)
    # (logp, [H], [ℓ^K]): the last is there only when something was truncated
    return out[0], out[1] if entropy else None, out[-1] if len(out) > 1 + entropy else None


def _logprobs_no_grad(learner: Learner, module, exp: Experience, parts, entropy: bool = False, ratio: bool = False):
    """(N, T) log-probs of the whole step without gradients (with `ratio`, those of the ratio: `_mb_logprobs`),
    and its entropies if asked (else None)."""
    out = torch.zeros(exp.completion_ids.shape, dtype=torch.float32, device=exp.completion_ids.device)  # (N, T)
    ent = torch.zeros_like(out) if entropy else None
    for rows, pcols, ccols in parts:
        with inference(module):  # no autograd bookkeeping; the copy into `out` leaves inference mode
            logp, h, logp_k = _mb_logprobs(learner, module, exp, rows, pcols, ccols, entropy=entropy, ratio=ratio)
        out[rows, ccols] = (logp if logp_k is None else logp_k).float()
        if entropy:
            ent[rows, ccols] = h.float()
    return out, ent


def _update(learner: Learner, dist: Dist, exp: Experience, parts, quarters, normalizer: float, tokens: float,
            ref_logp, old_logp, keep) -> dict:
    """One optimiser update over the whole step: gradients summed over micro-batches and processes. An update
    whose loss or gradient is not finite is skipped, on every process alike. `tokens`: the step's loss tokens,
    every process's (the entropy bonus's normaliser)."""
    spec = learner.spec
    control = learner.entropy
    coef = applied_entropy_coef(control.coef if control else spec.entropy_coef,
                                control.last_entropy if control else math.inf, spec)
    bonused = control is not None or spec.entropy_coef > 0  # "loss/entropy" and "entropy_coef" are logged
    learner.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, torch.Tensor] = {}     # float64 on the device, added micro-batch by micro-batch
    largest: dict[str, torch.Tensor] = {}  # the same, for figures that are maxima
    counts = [0.0] * QUARTERS              # the tokens of each quarter, known on the host
    finite = torch.ones((), dtype=torch.bool, device=exp.completion_ids.device)
    for i, ((rows, pcols, ccols), (index, n)) in enumerate(zip(parts, quarters)):
        with no_sync(learner.trainable, skip=i < len(parts) - 1):  # DDP all-reduces once, after the last micro-batch
            full, entropy, truncated = _mb_logprobs(learner, learner.trainable, exp, rows, pcols, ccols, entropy=True,
                                                    ratio=True)
            logp = full if truncated is None else truncated  # the ratio's (SPEC 14.12)
            old = old_logp[rows, ccols] if old_logp is not None else logp.detach()
            ref = ref_logp[rows, ccols] if ref_logp is not None else None
            mask = exp.loss_mask[rows, ccols]
            figures = entropy_figures(entropy.detach(), mask, index)  # the current policy's, as logged
            counts = [c + k for c, k in zip(counts, n)]
            # π_prox and the sampler weight (SPEC 14.1): the trainer's log-probs against the sampler's, if it has any
            sampler = exp.sampler_logp[rows, ccols] if exp.sampler_logp is not None else None
            old, correction, mismatch = proximal_terms(old, sampler, mask, spec)
            loss, stats = policy_loss(logp, old, exp.advantages[rows, ccols], mask, spec, ref_logp=ref,
                                      normalizer=normalizer, is_weight=correction,
                                      keep=keep[rows, ccols] if keep is not None else None,  # the top-entropy mask
                                      behaviour_logp=sampler, kl_logp=None if truncated is None else full)
            if bonused:  # −c·H̄ over the step's loss tokens (SPEC 14.7)
                bonus = entropy_bonus(entropy, mask, coef, tokens)
                loss = loss + bonus
                stats["loss/entropy"] = bonus.detach()
            finite = finite & torch.isfinite(loss)
            # the normaliser already counts every process; DDP and FSDP average gradients over processes,
            # so scale by the world size to get their sum
            (loss * dist.world_size).backward()
        count = stats["tokens"].double()
        _add(sums, {"loss": loss.detach(), **{k: stats[k] for k in _LOSS_PARTS if k in stats}})
        _add(sums, {k: v.double() * count for k, v in stats.items() if k not in _LOSS_PARTS})  # mean × tokens
        if mismatch is not None:
            top = mismatch.pop("abs_diff_max").double()
            largest["mismatch/abs_diff_max"] = torch.fmax(largest.get("mismatch/abs_diff_max", torch.zeros_like(top)),
                                                          top)  # NaN never wins, as in Python's max
            mismatch.pop("tokens")
            _add(sums, {f"mismatch/{k}": v for k, v in mismatch.items()})
        _add(sums, figures)
    params = [p for p in learner.trainable.parameters() if p.requires_grad]
    max_norm = learner.max_grad_norm if learner.max_grad_norm > 0 else math.inf
    grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm))
    # the one transfer of the update: its figures, the gradient norm and whether every loss was finite
    names = [*sums, *largest]
    *values, grad_norm, loss_finite = torch.stack([*sums.values(), *largest.values(), grad_norm.double(),
                                                   finite.double()]).tolist()
    totals: dict = dict(zip(names, values))
    totals.update({f"entropy/q{k + 1}_tokens": c for k, c in enumerate(counts)})
    totals["grad_norm"] = grad_norm
    if bonused:
        totals["entropy_coef"] = coef
    if control is not None:  # the step's mean entropy, every process's, sets the next coefficient
        control.last_entropy = dist.sum(totals["entropy"]) / max(tokens, 1.0)
        control.coef = next_entropy_coef(control.coef, control.last_entropy, spec)
    nonfinite = None if loss_finite else "loss"
    if nonfinite is None and not math.isfinite(grad_norm):
        name = next((n for n, p in learner.trainable.named_parameters() if p.grad is not None
                     and not torch.isfinite(_full(p.grad)).all()), "?")
        nonfinite = f"gradient ({name})"
    if dist.any(nonfinite is not None) and nonfinite is None:  # every process skips the same updates
        nonfinite = "loss on another process"
    totals["nonfinite"] = nonfinite
    if nonfinite is None:
        learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return totals


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) as the whole tensor; any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _add(into: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    """Add each value to its float64 sum, which starts at 0 (as a Python float sum does: 0 + (−0) = +0)."""
    for k, v in values.items():
        v = v.detach().double()
        into[k] = into.get(k, torch.zeros_like(v)) + v
