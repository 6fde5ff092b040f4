"""The GRPO training loop, top to bottom as SPEC section 9 lists it.

    for each step:
      1. draw this rank's prompts (whole groups: a group never spans ranks)
      2. sample G completions per prompt with the current policy
      3. score them with the reward functions (gathered across ranks)
      4. advantages within each group
      5. the step-wide loss normaliser (over all micro-batches and ranks)
      6. reference log-probs (β > 0) and old log-probs (μ > 1), without gradients
      7. μ policy updates, each accumulating gradients over micro-batches
      8. log metrics and samples; evaluate on the held-out split every `eval.every` steps

Variants never branch here: they are the values passed to `compute_advantages` and `policy_loss`.
"""
from __future__ import annotations

import math
import os
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from grpo.algo import compute_advantages, loss_normalizer, policy_loss
from grpo.checkpoint import (find_checkpoint, full_model_state, incompatible_keys, load_checkpoint, rng_states,
                             save_checkpoint)
from grpo.config import Config, to_yaml
from grpo.errors import ConfigError, GRPOError
from grpo.data import PromptStream
from grpo.distributed import Dist, LogprobModule, inference, no_sync, wrap_for_training
from grpo.evaluation import evaluate, example_fields
from grpo.metrics import RunLogger
from grpo.models import frozen_copy, is_lora, load_model, prompt_formatter, save_final
from grpo.rewards import RewardFn, build_rewards, resolve_reward, reward_name, score
from grpo.rollout import TRAIN, HFGenerator, Rollout, rollout_sampling, sampling_seed
from grpo.tasks import load_task


@dataclass
class TrainResult:
    output_dir: Path
    history: list[dict]
    initial_eval: dict[str, float] = field(default_factory=dict)
    final_eval: dict[str, float] = field(default_factory=dict)
    steps_done: int = 0
    stopped_by: str | None = None           # "SIGINT" or "SIGTERM" when a signal ended the run early
    checkpoint: Path | None = None          # the newest checkpoint written by this call
    resumed_from: Path | None = None


class TrainingAborted(GRPOError):
    """Too many consecutive non-finite steps: the run stops without writing weights."""


@dataclass
class StepBatch:
    """Everything one optimiser step trains on; rows are this rank's completions, group by group."""

    rollout: Rollout
    loss_mask: torch.Tensor              # (N, T)
    adv: torch.Tensor                    # (N,)
    rewards: torch.Tensor                # (N,) weighted total
    all_rewards: torch.Tensor            # (N · processes,) every process's rewards, in rank order
    per_fn: dict[str, torch.Tensor]      # name → (N,)
    ref_logp: torch.Tensor | None = None  # (N, T)
    old_logp: torch.Tensor | None = None  # (N, T)


def train(cfg: Config, *, rewards: list[RewardFn] | None = None, dist: Dist | None = None) -> TrainResult:
    """Run GRPO as configured; `rewards` replaces `cfg.rewards` with Python callables."""
    dist = dist or Dist()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    _seed_everything(cfg.train.seed)
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_yaml = to_yaml(cfg)

    if cfg.lora.rank and cfg.train.sharding == "fsdp":
        raise ConfigError("lora.rank > 0 with train.sharding=fsdp is not supported; use train.sharding=ddp")
    if cfg.train.prompts_per_step % dist.world_size:
        raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be a multiple of the "
                          f"number of processes ({dist.world_size})")
    task = load_task(cfg.data, cfg.train.seed)
    policy, tokenizer = load_model(cfg.model, cfg.lora)
    m = cfg.model
    # how log-probs are computed, the same for the reference and the training pass, so at the first step the
    # two agree bit for bit: full logits under FSDP (the root's forward gathers the shards), full rows under
    # FSDP or gradient checkpointing (no KV cache in train mode)
    sharded = cfg.train.sharding == "fsdp"
    path = dict(fused=not sharded, autocast_bf16=m.autocast_bf16, lean=cfg.train.lean_forward,
                share_prompt=cfg.train.share_prompt and not (sharded or m.gradient_checkpointing))
    # the reference is the initial policy (before any resume or sharding), frozen; with LoRA, the same model
    # with its adapter disabled
    reference = None
    if cfg.algo.beta > 0:
        reference = LogprobModule(policy if is_lora(policy) else frozen_copy(policy), adapter_off=is_lora(policy),
                                  **path)
    trainable = wrap_for_training(policy, dist, cfg.train.sharding, train_mode=m.gradient_checkpointing,
                                  **path)  # plain, DDP or FSDP2
    render = prompt_formatter(tokenizer, m)
    generator = HFGenerator(policy, tokenizer, all_finished=lambda done: not dist.any(not done),
                            add_special_tokens=not m.chat_template, autocast_bf16=m.autocast_bf16,
                            lean=cfg.rollout.lean_decoding)
    if rewards is not None:
        reward_fns = [(reward_name(f), f) for f in rewards]
    else:
        reward_fns = build_rewards(cfg.rewards, tokenizer=tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                                   overlong_buffer=cfg.overlong_buffer)
    if cfg.reward_weights is not None and len(cfg.reward_weights) != len(reward_fns):
        raise ConfigError(f"reward_weights has {len(cfg.reward_weights)} values for {len(reward_fns)} reward "
                          "functions; give one weight per function")
    correct_fn = resolve_reward(cfg.eval.reward, field="eval.reward")
    optimizer, scheduler = _optimizer(cfg, trainable)
    stream = PromptStream(task.train, cfg.train.prompts_per_step, cfg.train.seed)
    eval_set = task.eval[:cfg.eval.size] if cfg.eval.size else task.eval

    ckpt = find_checkpoint(cfg.train.resume, out) if cfg.train.resume else None
    state = {"step": 0, "nonfinite_streak": 0, "initial_eval": {}, "final_eval": {}}
    if ckpt is not None:
        state = _restore(cfg, ckpt, policy, optimizer, scheduler, stream)
    if dist.is_main:
        (out / "config.yaml").write_text(config_yaml)
    logger = RunLogger(out, cfg.log, cfg.train.steps, resume_step=state["step"] if ckpt else None,
                       enabled=dist.is_main)
    result = TrainResult(out, logger.history, state["initial_eval"], state["final_eval"], state["step"],
                         resumed_from=ckpt)
    if ckpt is not None:
        logger.write(f"resumed from {ckpt} at step {state['step']}")

    if not eval_set:
        logger.write("no held-out examples (data.eval_path, data.eval_split, data.eval_fraction): no evaluation")

    def run_eval(step: int) -> dict[str, float]:
        if not eval_set:
            return {}
        metrics = evaluate(generator, eval_set, correct_fn, max_new_tokens=cfg.rollout.max_new_tokens,
                           pass_k=cfg.eval.pass_k, temperature=cfg.eval.temperature, top_p=cfg.rollout.top_p,
                           seed=cfg.train.seed, dist=dist, render=render)
        logger.write(f"step {step:>4}: held-out accuracy {metrics['eval/accuracy']:.3f}"
                     + "".join(f", {k[5:]} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/pass@")))
        return metrics

    def save(step: int) -> None:
        state.update(step=step, stream={"epoch": stream.epoch, "position": stream.position},
                     initial_eval=result.initial_eval, final_eval=result.final_eval)
        result.checkpoint = save_checkpoint(out, step, model=policy, optimizer=optimizer, scheduler=scheduler,
                                            rng=rng_states(), state=state, config_yaml=config_yaml,
                                            keep_last=cfg.train.keep_last, is_main=dist.is_main)
        dist.barrier()

    if ckpt is None:
        result.initial_eval = run_eval(0)
        logger.log(0, result.initial_eval)
    sampling = rollout_sampling(cfg.rollout, cfg.rollout.group_size)
    with GracefulStop() as stop:
        for step in range(state["step"] + 1, cfg.train.steps + 1):
            start = time.perf_counter()
            # 1-2. this rank's prompts, G completions each; a prompt's seed is its position in the stream
            first = stream.drawn
            examples = _shard(stream.next_batch(), dist)
            seeds = _shard([sampling_seed(cfg.train.seed, TRAIN, first + i) for i in range(cfg.train.prompts_per_step)],
                           dist)
            prompts = [render(e.prompt) for e in examples]
            rollout = generator.generate(prompts, sampling, seeds)
            rollout_seconds = time.perf_counter() - start
            # 3-4. rewards and advantages
            batch = _score(cfg, dist, reward_fns, examples, prompts, rollout)
            # 5-6. step-wide normaliser; reference and old log-probs
            # every process holds an equal share of sequences, so only the token count needs a collective
            normalizer = loss_normalizer(cfg.algo.aggregation, num_sequences=len(rollout) * dist.world_size,
                                         num_tokens=int(dist.sum(batch.loss_mask.sum().item())),
                                         max_completion_length=cfg.rollout.max_new_tokens)
            if reference is not None:
                batch.ref_logp = _logprobs_no_grad(cfg, reference, rollout)
            if cfg.algo.num_iterations > 1:
                batch.old_logp = _logprobs_no_grad(cfg, trainable, rollout)
            # 7. μ updates (an update whose loss or gradient is not finite is skipped)
            updates = [_update(cfg, dist, trainable, optimizer, batch, normalizer)
                       for _ in range(cfg.algo.num_iterations)]
            scheduler.step()
            # 8. log, sample, evaluate
            metrics = _step_metrics(cfg, dist, batch, updates, time.perf_counter() - start, rollout_seconds,
                                    lr=scheduler.get_last_lr()[0])
            _check_finite(cfg, state, updates, metrics, step, logger, result)
            if cfg.log.samples_every and step % cfg.log.samples_every == 0:
                logger.samples(step, _sample_rows(cfg, examples, batch))
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                result.final_eval = run_eval(step)
                metrics.update(result.final_eval)
            logger.log(step, metrics)
            logger.advance()
            result.steps_done = step
            stopping = dist.any(stop.signal is not None)  # every process stops after the same step
            if stopping or (cfg.train.save_every and (step % cfg.train.save_every == 0 or step == cfg.train.steps)):
                save(step)
            if stopping:
                result.stopped_by = stop.signal or "SIGTERM"
                break

    if result.stopped_by is None:
        # gathered from the shards under FSDP (every process takes part)
        weights = None if is_lora(policy) else full_model_state(policy)
        if dist.is_main:
            save_final(policy, tokenizer, out, state_dict=weights, lora=cfg.lora)
    logger.close()
    return result


def _restore(cfg: Config, ckpt: Path, policy, optimizer, scheduler, stream: PromptStream) -> dict:
    """Load a checkpoint into the freshly built objects, after checking the config still matches."""
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    bad = incompatible_keys(saved, cfg.to_dict())
    if bad:
        raise ConfigError(f"cannot resume from {ckpt}: the config differs in keys that change the results: "
                          + "; ".join(bad))
    if saved["train"]["steps"] != cfg.train.steps and cfg.train.lr_schedule != "constant":
        warnings.warn(f"train.steps changed from {saved['train']['steps']} to {cfg.train.steps}: the "
                      f"{cfg.train.lr_schedule} LR decay now ends at the new step count", stacklevel=3)
    state = load_checkpoint(ckpt, model=policy, optimizer=optimizer, scheduler=scheduler)  # into the shards too
    stream.restore(state["stream"]["epoch"], state["stream"]["position"])
    return state


def _check_finite(cfg: Config, state: dict, updates: list[dict], metrics: dict, step: int, logger,
                  result: TrainResult) -> None:
    """Count consecutive steps with a skipped (non-finite) update; abort after `max_nonfinite_steps`."""
    bad = [u["nonfinite"] for u in updates if u["nonfinite"]]
    metrics["fault/skipped_updates"] = len(bad)
    if not bad:
        state["nonfinite_streak"] = 0
        return
    state["nonfinite_streak"] += 1
    metrics["fault/nonfinite"] = bad[0]
    logger.write(f"step {step}: non-finite {bad[0]}; update skipped "
                 f"({state['nonfinite_streak']}/{cfg.train.max_nonfinite_steps} in a row)")
    if state["nonfinite_streak"] >= cfg.train.max_nonfinite_steps:
        logger.log(step, metrics)
        logger.close()
        where = f"; the last good checkpoint is {result.checkpoint}" if result.checkpoint else ""
        raise TrainingAborted(f"aborted at step {step}: non-finite {bad[0]} in {state['nonfinite_streak']} "
                              f"consecutive steps (train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); "
                              f"no weights were written{where}. Lower train.lr or check the rewards")


class GracefulStop:
    """SIGINT/SIGTERM: let the current step finish, checkpoint, and stop. A second signal exits at once."""

    def __init__(self):
        self.signal: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal is not None:
            sys.stderr.write(f"\ngrpo: second {name}: exiting now without a checkpoint\n")
            os._exit(128 + signum)
        self.signal = name
        sys.stderr.write(f"\ngrpo: {name} received: finishing this step, then writing a checkpoint "
                         "(send it again to exit at once)\n")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        return False


# ---------------------------------------------------------------------------------------------------------
# the pieces of a step

def _score(cfg: Config, dist: Dist, reward_fns, examples, prompts: list[str], rollout: Rollout) -> StepBatch:
    g = cfg.rollout.group_size
    prompts = [p for p in prompts for _ in range(g)]
    total, per_fn = score(reward_fns, cfg.reward_weights, prompts, rollout.texts, example_fields(examples, g))
    # advantages on the rewards of every rank (batch std needs them all), then this rank's slice
    everyone = dist.gather(total)
    adv_all = compute_advantages(everyone, g, scale=cfg.algo.scale, std=cfg.algo.std, eps=cfg.algo.eps)
    device = rollout.completion_ids.device
    adv = adv_all[dist.rank * len(total):(dist.rank + 1) * len(total)].to(device)
    loss_mask = rollout.completion_mask.clone()
    if cfg.algo.mask_truncated:
        loss_mask[rollout.truncated] = 0
    return StepBatch(rollout, loss_mask, adv, total, everyone, per_fn)


def _micro_batches(cfg: Config, rollout: Rollout):
    """Consecutive row slices, each trimmed to its own longest prompt and completion (no padding beyond them):
    at most `micro_batch_size` rows and, with `micro_batch_tokens`, at most that many positions (rows × trimmed
    width; a single longer row still makes a micro-batch of its own)."""
    n, lp = rollout.prompt_ids.shape
    prompt_len = rollout.prompt_mask.sum(1).clamp(min=1).tolist()
    completion_len = rollout.completion_mask.sum(1).clamp(min=1).tolist()
    rows_cap, budget = cfg.train.micro_batch_size, cfg.train.micro_batch_tokens
    start = 0
    while start < n:
        end, wp, wc = start + 1, prompt_len[start], completion_len[start]
        while end < n and end - start < rows_cap:
            p, c = max(wp, prompt_len[end]), max(wc, completion_len[end])
            if budget and (end + 1 - start) * (p + c) > budget:
                break
            end, wp, wc = end + 1, p, c
        yield slice(start, end), slice(lp - wp, None), slice(0, wc)
        start = end


def _mb_logprobs(cfg: Config, module, rollout: Rollout, rows, pcols, ccols) -> torch.Tensor:
    """Log-probs of one micro-batch through a `LogprobModule` (possibly wrapped by DDP or sharded)."""
    return module(rollout.prompt_ids[rows, pcols], rollout.prompt_mask[rows, pcols],
                  rollout.completion_ids[rows, ccols], rollout.completion_mask[rows, ccols],
                  temperature=cfg.rollout.temperature, chunk_size=cfg.model.logprob_chunk_size)


def _logprobs_no_grad(cfg: Config, module, rollout: Rollout) -> torch.Tensor:
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    for rows, pcols, ccols in _micro_batches(cfg, rollout):
        with inference(module):  # no autograd bookkeeping; the copy into `out` leaves inference mode
            logp = _mb_logprobs(cfg, module, rollout, rows, pcols, ccols)
        out[rows, ccols] = logp.float()
    return out


def _update(cfg: Config, dist: Dist, trainable, optimizer, batch: StepBatch, normalizer: float) -> dict[str, float]:
    """One optimiser update over the whole step batch: gradients summed over micro-batches and processes."""
    a = cfg.algo
    optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = {}
    nonfinite = None
    parts = list(_micro_batches(cfg, batch.rollout))
    for i, (rows, pcols, ccols) in enumerate(parts):
        with no_sync(trainable, skip=i < len(parts) - 1):  # DDP all-reduces once, after the last micro-batch
            logp = _mb_logprobs(cfg, trainable, batch.rollout, rows, pcols, ccols)
            old = batch.old_logp[rows, ccols] if batch.old_logp is not None else logp.detach()
            ref = batch.ref_logp[rows, ccols] if batch.ref_logp is not None else None
            loss, stats = policy_loss(logp, old, batch.adv[rows], batch.loss_mask[rows, ccols], ref_logp=ref,
                                      beta=a.beta, clip_low=a.clip_low, clip_high=a.clip_high,
                                      ratio_level=a.ratio_level, aggregation=a.aggregation, normalizer=normalizer,
                                      max_completion_length=cfg.rollout.max_new_tokens, kl_kind=a.kl_kind)
            if not torch.isfinite(loss) and nonfinite is None:
                nonfinite = "loss"
            # the normaliser already counts every process; DDP and FSDP average gradients over processes,
            # so scale by the world size to get their sum
            (loss * dist.world_size).backward()
        tokens = stats["tokens"].item()
        _add(totals, {"loss": loss.item(), "loss/policy": stats["loss/policy"].item(),
                      "loss/kl": stats["loss/kl"].item(), "tokens": tokens})
        _add(totals, {k: stats[k].item() * tokens for k in ("kl", "ratio/mean", "clip/frac", "clip/low_frac",
                                                            "clip/high_frac")})
    params = [p for p in trainable.parameters() if p.requires_grad]
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
    totals["grad_norm"] = _full(torch.nn.utils.clip_grad_norm_(params, max_norm)).item()
    if nonfinite is None and not math.isfinite(totals["grad_norm"]):
        name = next((n for n, p in trainable.named_parameters() if p.grad is not None
                     and not torch.isfinite(_full(p.grad)).all()), "?")
        nonfinite = f"gradient ({name})"
    if dist.any(nonfinite is not None) and nonfinite is None:  # every process skips the same updates
        nonfinite = "loss on another process"
    totals["nonfinite"] = nonfinite
    if nonfinite is None:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals


def _step_metrics(cfg: Config, dist: Dist, batch: StepBatch, updates: list[dict], seconds: float,
                  rollout_seconds: float, lr: float) -> dict[str, float]:
    """Figures of the whole step (all ranks), averaged over the μ updates."""
    g = cfg.rollout.group_size
    rewards = batch.all_rewards
    grouped = rewards.view(-1, g)
    lengths = dist.gather(batch.rollout.lengths.float().cpu())
    m: dict[str, float] = {
        "reward/mean": _nanmean(rewards),
        "reward/std": _nanstd(rewards),
    }
    for name, values in batch.per_fn.items():
        m[f"reward/{name}"] = _nanmean(dist.gather(values))
    spread = grouped.nan_to_num(0.0)
    m["adv/std_zero_frac"] = (spread.amax(1) == spread.amin(1)).float().mean().item()
    u = {k: dist.sum(sum(d[k] for d in updates)) / len(updates) for k in updates[0]
         if k not in ("grad_norm", "nonfinite")}
    tokens = max(u.pop("tokens"), 1.0)
    m.update({k: u[k] / tokens for k in ("kl", "ratio/mean", "clip/frac", "clip/low_frac", "clip/high_frac")})
    m.update({"loss": u["loss"], "loss/policy": u["loss/policy"], "loss/kl": u["loss/kl"]})
    m["grad_norm"] = sum(d["grad_norm"] for d in updates) / len(updates)
    m["completion/mean_length"] = lengths.mean().item()
    m["completion/truncated_frac"] = dist.gather(batch.rollout.truncated.float().cpu()).mean().item()
    m["lr"] = lr
    m["perf/step_seconds"] = seconds
    m["perf/rollout_seconds"] = rollout_seconds
    m["perf/completion_tokens"] = lengths.sum().item()
    m["perf/tokens_per_s"] = lengths.sum().item() / max(seconds, 1e-9)
    return m


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) as the whole tensor; any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sample_rows(cfg: Config, examples, batch: StepBatch) -> list[dict]:
    g = cfg.rollout.group_size
    rows = []
    for i, e in enumerate(examples[:cfg.log.samples_per_step]):
        for j in range(i * g, (i + 1) * g):
            row = {"prompt": e.prompt, "answer": e.answer, "completion": batch.rollout.texts[j],
                   "reward": _json_float(batch.rewards[j].item()), "advantage": batch.adv[j].item(),
                   "truncated": bool(batch.rollout.truncated[j])}
            row.update({f"reward/{k}": _json_float(v[j].item()) for k, v in batch.per_fn.items()})
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------
# set-up helpers

def _shard(batch: list, dist: Dist) -> list:
    k = len(batch) // dist.world_size
    return batch[dist.rank * k:(dist.rank + 1) * k]


def _optimizer(cfg: Config, policy):
    t = cfg.train
    params = [p for p in policy.parameters() if p.requires_grad]
    # the fused kernel: one pass per parameter instead of a dozen small ops (FSDP2's DTensors included)
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay,
                                  fused=True)

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        if t.lr_schedule == "linear":
            return max(0.0, 1.0 - progress)
        if t.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _add(into: dict[str, float], values: dict[str, float]) -> None:
    for k, v in values.items():
        into[k] = into.get(k, 0.0) + v


def _nanmean(x: torch.Tensor) -> float:
    return x.nanmean().item() if (~x.isnan()).any() else float("nan")


def _nanstd(x: torch.Tensor) -> float:
    x = x[~x.isnan()]
    return x.std().item() if x.numel() > 1 else 0.0


def _json_float(v: float) -> float | None:
    return None if math.isnan(v) else v



