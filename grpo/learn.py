"""Loop steps 5–7, `Experience` → policy updates: the step-wide loss normaliser, reference and old log-probs
without gradients, then μ updates, each accumulating gradients over micro-batches (SPEC 9 and 12).

Nothing here branches on a variant: the algorithm's choices are the values handed to `grpo.algo.policy_loss`
and `loss_normalizer`. The per-token advantages and the loss mask come from the Experience as they are.
When the sampler is an engine of its own (vLLM), `Experience.sampler_logp` holds its log-probs and the policy
term is weighted by the sampler–trainer correction `grpo.algo.sampler_weights` (SPEC 13.1), with the trainer's
old log-probs (the weights the sampler was given) against the sampler's. The in-process generator reports none:
its log-probs are the trainer's own, so the weight is exactly 1 and nothing is computed.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from grpo.algo import entropy_figures, entropy_threshold, loss_normalizer, policy_loss, sampler_weights, top_entropy_mask
from grpo.distributed import Dist, no_sync
from grpo.experience import Experience
from grpo.policy import inference


@dataclass(frozen=True)
class Learner:
    """The modules, the optimiser and the settings of the update, bound once when the trainer builds it."""

    trainable: torch.nn.Module               # a LogprobModule, possibly in DDP or over FSDP2 shards
    reference: torch.nn.Module | None        # the frozen reference's LogprobModule; None when beta = 0
    optimizer: torch.optim.Optimizer
    temperature: float                       # log-probs from logits / the sampling temperature
    chunk_size: int
    max_rows: int                            # compute.micro_batch_size
    max_tokens: int                          # compute.micro_batch_tokens (0: no cap)
    max_completion_length: int               # L_max of the constant normaliser
    max_grad_norm: float                     # 0: no clipping
    beta: float = 0.04
    kl_kind: str = "k3"
    clip_low: float = 0.2
    clip_high: float = 0.2
    ratio_level: str = "token"
    aggregation: str = "seq_mean"
    num_iterations: int = 1
    surrogate: str = "clip"                  # algo.surrogate; dual_clip None when algo.dual_clip = 0
    dual_clip: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    top_entropy_quantile: float = 1.0        # ρ: the highest-entropy fraction of tokens that carries the policy term
    correction: str = "token_tis"            # algo.sampler_correction, when the Experience has sampler log-probs
    correction_cap: float = 2.0
    correction_floor: float = 0.0


def learn(lr: Learner, exp: Experience, dist: Dist) -> list[dict]:
    """μ updates on `exp` (this process's rows; every process calls it): one dict of summed figures per update
    (`grpo.metrics.step_metrics` reduces them)."""
    # 5. the normaliser over the whole step: every process holds an equal share of sequences, so only the token
    # count needs a collective
    normalizer = loss_normalizer(lr.aggregation, num_sequences=len(exp) * dist.world_size,
                                 num_tokens=int(dist.sum(exp.loss_mask.sum().item())),
                                 max_completion_length=lr.max_completion_length)
    parts = list(micro_batches(exp.prompt_mask, exp.completion_mask, lr.max_rows, lr.max_tokens))
    # 6. reference and old log-probs, without gradients
    ref_logp = _logprobs_no_grad(lr, lr.reference, exp, parts)[0] if lr.reference is not None else None
    masking = lr.top_entropy_quantile < 1
    old_logp, old_entropy = (_logprobs_no_grad(lr, lr.trainable, exp, parts, entropy=masking)
                             if lr.num_iterations > 1 or masking else (None, None))
    if lr.num_iterations == 1:  # μ = 1: the ratio is to the training pass itself (logp.detach())
        old_logp = None
    # top-entropy masking: the threshold over every loss token of the step, on every process (SPEC 13.8)
    keep = None
    if masking:
        mine = old_entropy[exp.loss_mask.bool()].cpu()
        threshold = entropy_threshold(torch.cat(dist.gather_objects(mine)), lr.top_entropy_quantile)
        keep = top_entropy_mask(old_entropy, exp.loss_mask, threshold)
    # 7. μ updates
    return [_update(lr, dist, exp, parts, normalizer, ref_logp, old_logp, keep) for _ in range(lr.num_iterations)]


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


def _mb_logprobs(lr: Learner, module, exp: Experience, rows, pcols, ccols, entropy: bool = False):
    return module(exp.prompt_ids[rows, pcols], exp.prompt_mask[rows, pcols], exp.completion_ids[rows, ccols],
                  exp.completion_mask[rows, ccols], temperature=lr.temperature, chunk_size=lr.chunk_size,
                  entropy=entropy)


def _logprobs_no_grad(lr: Learner, module, exp: Experience, parts, entropy: bool = False):
    """(N, T) log-probs of the whole step without gradients, and its entropies if asked (else None)."""
    out = torch.zeros(exp.completion_ids.shape, dtype=torch.float32, device=exp.completion_ids.device)  # (N, T)
    ent = torch.zeros_like(out) if entropy else None
    for rows, pcols, ccols in parts:
        with inference(module):  # no autograd bookkeeping; the copy into `out` leaves inference mode
            result = _mb_logprobs(lr, module, exp, rows, pcols, ccols, entropy=entropy)
        logp, h = result if entropy else (result, None)
        out[rows, ccols] = logp.float()
        if entropy:
            ent[rows, ccols] = h.float()
    return out, ent


def _update(lr: Learner, dist: Dist, exp: Experience, parts, normalizer: float, ref_logp, old_logp, keep) -> dict:
    """One optimiser update over the whole step: gradients summed over micro-batches and processes. An update
    whose loss or gradient is not finite is skipped, on every process alike."""
    lr.optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    nonfinite = None
    for i, (rows, pcols, ccols) in enumerate(parts):
        with no_sync(lr.trainable, skip=i < len(parts) - 1):  # DDP all-reduces once, after the last micro-batch
            logp, entropy = _mb_logprobs(lr, lr.trainable, exp, rows, pcols, ccols, entropy=True)
            old = old_logp[rows, ccols] if old_logp is not None else logp.detach()
            ref = ref_logp[rows, ccols] if ref_logp is not None else None
            _add(totals, entropy_figures(entropy, exp.loss_mask[rows, ccols]))  # the current policy's, as logged
            weight = keep[rows, ccols] if keep is not None else None  # 0 on tokens below the entropy threshold
            if exp.sampler_logp is not None:  # π_old / π_smp: the trainer's log-probs against the sampler's
                correction, mismatch = sampler_weights(old, exp.sampler_logp[rows, ccols], exp.loss_mask[rows, ccols],
                                                       mode=lr.correction, cap=lr.correction_cap,
                                                       floor=lr.correction_floor)
                weight = correction if weight is None else weight * correction
                totals["mismatch/abs_diff_max"] = max(totals.get("mismatch/abs_diff_max", 0.0),
                                                      mismatch.pop("abs_diff_max").item())
                mismatch.pop("tokens")
                _add(totals, {f"mismatch/{k}": v.item() for k, v in mismatch.items()})
            loss, stats = policy_loss(logp, old, exp.advantages[rows, ccols], exp.loss_mask[rows, ccols],
                                      ref_logp=ref, beta=lr.beta, clip_low=lr.clip_low, clip_high=lr.clip_high,
                                      ratio_level=lr.ratio_level, aggregation=lr.aggregation,
                                      normalizer=normalizer, max_completion_length=lr.max_completion_length,
                                      kl_kind=lr.kl_kind, surrogate=lr.surrogate, dual_clip=lr.dual_clip,
                                      sapo_tau_pos=lr.sapo_tau_pos, sapo_tau_neg=lr.sapo_tau_neg, is_weight=weight)
            if not torch.isfinite(loss) and nonfinite is None:
                nonfinite = "loss"
            # the normaliser already counts every process; DDP and FSDP average gradients over processes,
            # so scale by the world size to get their sum
            (loss * dist.world_size).backward()
        tokens = stats["tokens"].item()
        _add(totals, {"loss": loss.item(), "loss/policy": stats["loss/policy"].item(),
                      "loss/kl": stats["loss/kl"].item(), "tokens": tokens})
        _add(totals, {k: stats[k].item() * tokens for k in ("kl", "ratio/mean", "clip/frac", "clip/low_frac",
                                                            "clip/high_frac", "clip/dual_frac") if k in stats})
    params = [p for p in lr.trainable.parameters() if p.requires_grad]
    max_norm = lr.max_grad_norm if lr.max_grad_norm > 0 else math.inf
    totals["grad_norm"] = _full(torch.nn.utils.clip_grad_norm_(params, max_norm)).item()
    if nonfinite is None and not math.isfinite(totals["grad_norm"]):
        name = next((n for n, p in lr.trainable.named_parameters() if p.grad is not None
                     and not torch.isfinite(_full(p.grad)).all()), "?")
        nonfinite = f"gradient ({name})"
    if dist.any(nonfinite is not None) and nonfinite is None:  # every process skips the same updates
        nonfinite = "loss on another process"
    totals["nonfinite"] = nonfinite
    if nonfinite is None:
        lr.optimizer.step()
    lr.optimizer.zero_grad(set_to_none=True)
    return totals


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) as the whole tensor; any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _add(into: dict[str, float], values: dict[str, float]) -> None:
    for k, v in values.items():
        into[k] = into.get(k, 0.0) + v
