"""The GRPO training loop, top to bottom as SPEC section 9 lists it (docs/training.md draws it):

    for each step:
      1-4. collect: this process's prompts → environment and generator (G episodes each, grpo/sampling.py) →
           rewards → per-token advantages, as one `Experience` (grpo/collect.py)
      5-7. learn: the step-wide loss normaliser, reference and old log-probs, μ updates over micro-batches
           (grpo/learn.py)
      8.   the generator samples from the new weights (`Generator.sync_weights`)
      9.   log metrics and samples; evaluate every `eval.every` steps; checkpoint every `train.save_every`

Variants never branch here: they are the values bound into the `Collector` and the `Learner` when they are
built, and the pure functions of `grpo.algo` consume them.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import random
import re
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import yaml

from grpo.ahead import Lane, lagged_versions
from grpo.algo import AdvantageSpec, LossSpec
from grpo.allocator import reuse_freed_memory
from grpo.budgets import max_episode_tokens, prompt_limit
from grpo.checkpoint import find_checkpoint, load_checkpoint, load_lagged, resume_hint, rng_states, save_checkpoint
from grpo.collect import Collector, collect, probe_rewards
from grpo.config import Config, config_changes, may_change, to_yaml
from grpo.data import PromptStream, fit_prompts
from grpo.distributed import Dist, process_group, wrap_for_training
from grpo.envs import build_environment, environment_name, prompt_formatter, tool_names
from grpo.errors import NO_ROOM, ConfigError, DataError, GRPOError, WriteError, write_failure
from grpo.evaluation import evaluate
from grpo.images import NO_VISION_TOWER, image_prompts_for
from grpo.learn import EntropyControl, Learner, learn
from grpo.metrics import sample_rows, step_metrics
from grpo.model_card import model_card
from grpo.models import frozen_copy, is_lora, load_model, save_final
from grpo.optim import build_optimizer
from grpo.policy import LogprobModule, forward_path, packing_unavailable
from grpo.policy.reference_sync import ReferenceSync, reference_weights
from grpo.policy.weights import full_model_state
from grpo.precision import resolved
from grpo.rewards import (RewardFn, build_rewards, close_rewards, example_fields, field_names, missing_fields,
                          needs_fields_error, recorded_name, resolve_reward, reward_name, take_figures)
from grpo.rundir import RunLock, claim, clear, discard_unstarted
from grpo.runlog import RunLogger, format_samples, samples_due
from grpo.rollout import build_generator, rollout_sampling, snapshot_weights
from grpo.sampling import Sampler
from grpo.sandbox import Limits
from grpo.signals import GracefulStop
from grpo.tasks import load_task
from grpo.tracking import check_installed
from grpo.validate import carry_validation, validate_once


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
class TrainState:
    """All a resume needs besides the weights, the optimiser and the RNGs (trainer_state.json)."""

    step: int = 0
    nonfinite_streak: int = 0
    initial_eval: dict = field(default_factory=dict)
    final_eval: dict = field(default_factory=dict)
    stream: dict = field(default_factory=dict)  # {"epoch", "position"} of the prompt stream
    entropy: dict = field(default_factory=dict)  # {"coef", "last_entropy" (None: +∞)} of algo.use_adaptive_entropy


@dataclass
class Given:
    """What `grpo.train` was given as objects rather than config (`train`'s keywords): a loaded model and its
    tokenizer or processor, data sets in memory, tools and an environment."""

    model: object = None
    processing_class: object = None
    train_dataset: object = None
    eval_dataset: object = None
    tools: object = None
    environment: object = None


def train(cfg: Config, *, rewards: list[RewardFn] | None = None, dist: Dist | None = None, model=None,
          processing_class=None, train_dataset=None, eval_dataset=None, tools=None, environment=None) -> TrainResult:
    """Run GRPO as configured; `rewards` replaces `cfg.rewards` with Python callables (the run's config.yaml then
    names them, `recorded_name`, and a resume with others is refused; eval.reward and eval.rewards may name them
    by their names). Without `dist`, the processes torchrun describes in the environment (one process without
    torchrun) are the run's. `model`, `processing_class`, `train_dataset`, `eval_dataset`, `tools` and
    `environment`: see `grpo.train`; a path given as `model` or a data set is model.path, data.path or
    data.eval_path."""
    if dist is None:
        with process_group() as dist:
            return train(cfg, rewards=rewards, dist=dist, model=model, processing_class=processing_class,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, tools=tools, environment=environment)
    started = time.perf_counter()  # perf/elapsed_seconds counts from here: building the model and engine is run time
    before = cfg
    cfg, given = _given(cfg, Given(model, processing_class, train_dataset, eval_dataset, tools, environment))
    carry_validation(before, cfg)  # a trap `load_config` warned of is not warned of again
    names = tuple(reward_name(f) for f in rewards or ())
    validate_once(cfg, dist.world_size, num_rewards=len(rewards) if rewards is not None else None, reward_names=names,
                  given=given)
    if rewards is not None:  # the run's config says which functions it was trained with (eval.reward too)
        recorded = {reward_name(f): recorded_name(f) for f in reversed(rewards)}  # a name given twice: the first
        cfg = replace(cfg, rewards=[recorded_name(f) for f in rewards],
                      eval=replace(cfg.eval, reward=recorded.get(cfg.eval.reward, cfg.eval.reward),
                                   rewards=[recorded.get(n, n) for n in cfg.eval.rewards]))
    if dist.is_main:
        check_installed(cfg.log.trackers)
    if cfg.compute.threads:
        torch.set_num_threads(cfg.compute.threads)
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    out = Path(cfg.train.output_dir)
    with _run_lock(out, dist):  # before anything in the directory is read or written: one run at a time
        return _claimed(cfg, rewards, dist, out, started, given)


def _given(cfg: Config, given: Given) -> tuple[Config, Given]:
    """The objects given to `train`, sorted: a path (a str) given as the model or a data set goes into the config
    (model.path, data.path, data.eval_path) and out of `given`, as an environment's name goes into
    rollout.environment; a model object's name_or_path becomes model.path, so that the run's config.yaml says which
    model it started from; data sets given as objects are listed in data.given; tools (one alone: a list of one)
    are recorded in tools.names and imply rollout.environment=tools in place of single_turn, as TRL's tools= does,
    so that the config is validated as what runs. `cfg` itself is never changed (a new one is returned)."""
    if isinstance(given.model, (str, Path)):
        cfg, given = replace(cfg, model=replace(cfg.model, path=str(given.model))), replace(given, model=None)
    elif given.model is not None:
        name = getattr(given.model, "name_or_path", "") or ""
        cfg = replace(cfg, model=replace(cfg.model, path=str(name) or "(a model object)"))
    for what, data, key, path in (("train_dataset", given.train_dataset, "data.path", cfg.data.path),
                                  ("eval_dataset", given.eval_dataset, "data.eval_path", cfg.data.eval_path)):
        if data is not None and path:
            raise ConfigError(f"{what} is given, and the config sets {key}={path}; give one of them")
    if isinstance(given.train_dataset, (str, Path)):
        cfg = replace(cfg, data=replace(cfg.data, path=str(given.train_dataset)))
        given = replace(given, train_dataset=None)
    if isinstance(given.eval_dataset, (str, Path)):
        cfg = replace(cfg, data=replace(cfg.data, eval_path=str(given.eval_dataset)))
        given = replace(given, eval_dataset=None)
    if given.eval_dataset is not None and given.train_dataset is None and not cfg.data.path:
        raise ConfigError("eval_dataset is given without training data: give train_dataset (or data.path) too")
    if given.eval_dataset is not None and (cfg.data.eval_split or cfg.data.eval_fraction):
        raise ConfigError("eval_dataset is given, and so is data.eval_split or data.eval_fraction; give one source "
                          "of held-out examples")
    objects = [what for what, data in (("train_dataset", given.train_dataset), ("eval_dataset", given.eval_dataset))
               if data is not None]
    lacking = [what for what in cfg.data.given if what not in objects
               and not (cfg.data.path if what == "train_dataset" else cfg.data.eval_path)]
    if lacking:
        keys = " and ".join("data.path" if w == "train_dataset" else "data.eval_path" for w in lacking)
        raise ConfigError(f"data.given: this config's run was given {' and '.join(lacking)} as an object to "
                          f"grpo.train, which the config cannot hold; give it again (grpo.train({lacking[0]}=...)), "
                          f"or set {keys}")
    if objects != cfg.data.given:
        cfg = replace(cfg, data=replace(cfg.data, given=objects))
    if callable(given.tools) or isinstance(given.tools, str):
        given = replace(given, tools=[given.tools])
    elif given.tools is not None:
        given = replace(given, tools=list(given.tools))
    if isinstance(given.environment, str):
        cfg = replace(cfg, rollout=replace(cfg.rollout, environment=given.environment))
        given = replace(given, environment=None)
    if given.tools is not None:
        single = given.environment is None and cfg.rollout.environment == "single_turn"
        cfg = replace(cfg, tools=replace(cfg.tools, names=tool_names(given.tools)),
                      rollout=replace(cfg.rollout, environment="tools") if single else cfg.rollout)
    return cfg, given


def _given_header(cfg: Config, given: Given) -> str:
    """YAML comments at the top of the run's config.yaml for what was given as objects, which the keys cannot
    hold (a resume or `grpo eval` needs them given again)."""
    lines = []
    if given.model is not None:
        lines.append(f"# model: a {type(given.model).__name__} object given to grpo.train(model=...); model.path "
                     f"records its name_or_path ({cfg.model.path})")
    for what, data in (("train_dataset", given.train_dataset), ("eval_dataset", given.eval_dataset)):
        if data is not None:
            rows = f" of {len(data)} rows" if hasattr(data, "__len__") else ""
            lines.append(f"# {what}: a {type(data).__name__}{rows} given to grpo.train({what}=...), not a file")
    return "".join(line + "\n" for line in lines)


@contextlib.contextmanager
def _run_lock(out: Path, dist: Dist):
    """The main process (the one that writes) holds the lock of the run directory for the run's length
    (grpo/rundir.py); if another live run holds it, every process refuses with the same line."""
    lock, error = None, None
    if dist.is_main:
        try:
            lock = RunLock(out)
        except ConfigError as e:
            error = str(e)
    first = next((e for e in dist.gather_objects(error) if e), None)
    if first:
        raise ConfigError(first)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _claimed(cfg: Config, rewards: list[RewardFn] | None, dist: Dist, out: Path, started: float,
             given: Given) -> TrainResult:
    """The run, in the directory this process group holds."""
    # before anything is built or written: a new run refuses a directory that holds one (grpo/rundir.py)
    ckpt = find_checkpoint(cfg.train.resume, out) if cfg.train.resume else None
    replaced = claim(out, overwrite=cfg.train.overwrite, resuming=ckpt is not None,
                     asked_resume=bool(cfg.train.resume))
    dist.barrier()
    writing = False
    try:
        # a broken reward, model or data set fails here, the old run still whole
        run = _build(cfg, rewards, dist, given)
        cfg = run.config  # with what only the build knows (the chat template of conversations, the environment)
        if dist.is_main:
            clear(out, replaced)
        writing = True
        with contextlib.ExitStack() as stack:  # an engine of its own (vLLM) is shut down however the run ends
            if hasattr(run.generator, "close"):
                stack.callback(run.generator.close)
            # and a judge's launched server
            stack.callback(close_rewards, [fn for _, fn in [*run.collector.rewards, *run.eval_rewards]])
            return _train(cfg, run, dist, out, started, ckpt)
    except BaseException as e:
        if writing and ckpt is None and dist.is_main:  # a new run that failed before its first step leaves nothing
            discard_unstarted(out)
        failed = write_failure(e) if isinstance(e, Exception) else None
        if failed is not None and failed.errno in NO_ROOM:  # metrics, samples, a tracker's files: one line
            what = failed.filename or f"into {out}"
            raise WriteError(f"could not write {what}: {failed.strerror}; {resume_hint(out)}") from None
        raise


def _train(cfg: Config, run: _Run, dist: Dist, out: Path, started: float, ckpt: Path | None) -> TrainResult:
    state = _restore(cfg, ckpt, run) if ckpt is not None else TrainState()
    error = None
    try:  # only the main process writes: if it cannot (a full disk, a tracker that cannot start), none goes on
        if dist.is_main:
            (out / "config.yaml").write_text(run.config_yaml)
        logger = RunLogger(out, cfg.log, cfg.train.steps, resume_step=state.step if ckpt else None,
                           enabled=dist.is_main, config=cfg.to_dict(), started=started)
    except OSError as e:
        error = _write_error(e, out)
    except GRPOError as e:
        error = e
    _raise_on_every_process(dist, error)
    with logger:  # the trackers are closed however the run ends; a failed run is marked failed in them
        return _loop(cfg, run, dist, out, ckpt, state, logger)


def _loop(cfg: Config, run: _Run, dist: Dist, out: Path, ckpt: Path | None, state: TrainState,
          logger: RunLogger) -> TrainResult:
    result = TrainResult(out, logger.history, state.initial_eval, state.final_eval, state.step, resumed_from=ckpt)
    logger.write(run.precision)
    if run.packing:
        logger.write(run.packing)
    if ckpt is not None:
        logger.write(f"resumed from {ckpt} at step {state.step}")
    if not run.eval_set:
        logger.write("no held-out examples (data.eval_path, data.eval_split, data.eval_fraction): no evaluation")
    if ckpt is None:
        result.initial_eval, seconds = _evaluate(cfg, run, dist, logger, 0)
        logger.log(0, {**result.initial_eval, **seconds})
        _raise_on_every_process(dist, _log_failure(logger, out))

    lane = _start_lane(cfg, run, state) if cfg.rollout.max_staleness else None
    idle = _Idle()
    try:
        _steps(cfg, run, dist, out, state, logger, result, lane, idle)
    finally:
        if lane is not None:
            lane.close(timeout=cfg.vllm.timeout_s)
    logger.write(idle.summary(lane))

    error = None
    if result.stopped_by is None:
        weights = None if is_lora(run.policy) else full_model_state(run.policy)  # every process, under FSDP
        if dist.is_main:
            try:
                save_final(run.policy, run.tokenizer, out, state_dict=weights, lora=cfg.lora,
                           base_moved=is_lora(run.policy) and cfg.algo.ref_sync_every > 0,
                           card=functools.partial(model_card, cfg, initial_eval=result.initial_eval,
                                                  final_eval=result.final_eval, history=logger.history,
                                                  steps=result.steps_done))
            except WriteError as e:
                error = f"{e}; {resume_hint(out, e)}"
    if error is None and dist.is_main:  # the run log's last writes (the files' close, the chart)
        try:
            logger.close()
        except OSError as e:
            error = _write_error(e, out)
    _raise_on_every_process(dist, error)
    return result


def _steps(cfg: Config, run: _Run, dist: Dist, out: Path, state: TrainState, logger: RunLogger,
           result: TrainResult, lane: Lane | None, idle: _Idle) -> None:
    """The steps from state.step + 1 on; with `lane` (rollout.max_staleness >= 1) its batches were sampled ahead."""
    first = state.step + 1
    with GracefulStop() as stop:
        for step in range(first, cfg.train.steps + 1):
            start = time.perf_counter()
            # 1-4. prompts → episodes → rewards → advantages (sampled ahead on the lane, or now)
            if lane is not None:
                batch, rollout_seconds = lane.next_batch(step)
                exp, stream = batch.exp, batch.stream
                _check_fresh(exp, step, cfg.rollout.max_staleness)  # before anything learns from it
            else:
                exp = collect(run.collector, run.stream, dist)
                rollout_seconds = time.perf_counter() - start
                stream = None
            # 5-7. normaliser, reference and old log-probs, μ updates; none when dynamic sampling found no group
            # to train on (every process alike)
            updates = learn(run.learner, exp, dist) if len(exp) else []
            if not updates:
                st = exp.stats
                found = st["sampling/prompts_drawn"] - st["sampling/groups_dropped"]
                logger.write(f"step {step}: dynamic sampling found {found} informative groups in "
                             f"{st['sampling/rounds']} rounds, too few for {dist.world_size} process(es): no update")
            with warnings.catch_warnings():  # a step without an update moves the LR schedule on all the same
                warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()` before"))
                run.scheduler.step()
            reset = run.reference_sync(step)  # algo.ref_sync_every: the reference takes the policy's weights
            # 8. the generator samples from the new weights from now on (asynchronous: the lane, once a batch needs
            # them, from a copy)
            synced = time.perf_counter()
            if lane is not None:
                lane.publish(step, snapshot_weights(run.policy))
            else:
                run.generator.sync_weights(run.policy)
            # 9. log, evaluate, checkpoint
            done = time.perf_counter()
            metrics = step_metrics(exp, updates, dist, group_size=cfg.rollout.group_size, seconds=done - start,
                                   rollout_seconds=rollout_seconds, sync_seconds=done - synced,
                                   lr=run.scheduler.get_last_lr()[0])
            metrics.update(reset)
            if lane is not None:
                metrics.update(_staleness(exp, step, cfg, dist), **{
                    "perf/sample_seconds": batch.seconds, "perf/engine_wait_seconds": lane.take_engine_wait()})
            idle.add(rollout_seconds, done - start, metrics.get("perf/engine_wait_seconds"))
            _check_finite(cfg, state, updates, metrics, step, logger, result)
            _warn_unscored(exp, step, logger)
            if samples_due(step, cfg.log.samples_every, cfg.train.steps):
                logger.samples(step, sample_rows(exp, cfg.log.samples_per_step))
            if cfg.log.print_samples and len(exp) and (step in (first, cfg.train.steps) or samples_due(
                    step, cfg.log.samples_every, cfg.train.steps)):  # TRL's log_completions, on the console
                logger.write(format_samples(step, sample_rows(exp, len(exp)), cfg.log.print_samples))
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                result.final_eval, seconds = _evaluate(cfg, run, dist, logger, step, lane)
                idle.evaluated(seconds.get("perf/eval_seconds", 0.0))
                metrics.update({**result.final_eval, **seconds})
            logger.log(step, metrics)
            logger.advance()
            result.steps_done = step
            stopping = _stop_after_step(dist, stop, _log_failure(logger, out))  # every process alike
            if stopping or (cfg.train.save_every and (step % cfg.train.save_every == 0 or step == cfg.train.steps)):
                state.step, state.initial_eval, state.final_eval = step, result.initial_eval, result.final_eval
                result.checkpoint = _save(cfg, run, dist, state, stream=stream,
                                          lagged=lane.lagged(step) if lane is not None else None)
            if stopping:
                result.stopped_by = stop.signal or "SIGTERM"
                break


def _start_lane(cfg: Config, run: _Run, state: TrainState) -> Lane:
    """The sampling lane of an asynchronous run, from the step after state.step, with the weights of that step and
    those of the batches in flight (a resume's, from its checkpoint)."""
    every, last = cfg.eval.every, cfg.train.steps
    eval_steps = {t for t in range(state.step + 1, last + 1) if t == last or (every and t % every == 0)}
    evaluate_on = functools.partial(_held_out, cfg, run)
    weights, run.lagged = {**run.lagged, state.step: snapshot_weights(run.policy)}, {}  # the lane's alone now
    return Lane(functools.partial(collect, run.collector), run.stream, run.generator, run.sampling_dist,
                k=cfg.rollout.max_staleness, mode=cfg.rollout.staleness_mode, first=state.step + 1, last=last,
                eval_steps=eval_steps if run.eval_set else set(), evaluate=evaluate_on, weights=weights)


def _check_fresh(exp, step: int, k: int) -> None:
    """No row of step `step`'s batch was sampled by weights older than its bound, step − 1 − k (the lane waits for
    them, so this never fails; checked before the batch is learnt from, on this process's rows)."""
    if len(exp) and int(exp.version.min()) < step - 1 - k:
        raise RuntimeError(f"step {step} was handed rows sampled by the weights of step {int(exp.version.min())}, "
                           f"older than rollout.max_staleness={k} allows ({step - 1 - k})")


def _staleness(exp, step: int, cfg: Config, dist: Dist) -> dict[str, float]:
    """η of the step's groups (SPEC 14.13): the versions between the weights the batch is first updated from (step
    − 1) and those that sampled each group, mean and max over every process's groups. None exceeds the bound
    (`_check_fresh`, before the update)."""
    g = cfg.rollout.group_size
    mine = ((step - 1) - exp.version.view(-1, g)[:, 0]).double().cpu() if len(exp) else torch.zeros(0)
    count, total = dist.sum(float(mine.numel())), dist.sum(float(mine.sum()))
    top = dist.max(float(mine.max()) if mine.numel() else -1.0)
    return {"staleness/mean": total / count if count else float("nan"), "staleness/max": top if count else float("nan")}


@dataclass
class _Idle:
    """How long each side of the run waited for the other (the end-of-run summary)."""

    trainer: float = 0.0       # waiting for rollouts (synchronous: all of sampling and scoring)
    engine: float = 0.0        # waiting for weights (synchronous: all of the update and the evaluation gaps)
    steps: float = 0.0         # the steps' wall time, evaluations included
    synchronous: bool = True

    def add(self, rollout_seconds: float, step_seconds: float, engine_wait: float | None) -> None:
        self.trainer += rollout_seconds
        self.steps += step_seconds
        if engine_wait is None:  # synchronous: the engine idles while the trainer learns
            self.engine += step_seconds - rollout_seconds
        else:
            self.engine += engine_wait
            self.synchronous = False

    def evaluated(self, seconds: float) -> None:
        self.steps += seconds
        self.trainer += 0.0 if self.synchronous else seconds  # asynchronous: the trainer waits for the lane's

    def summary(self, lane: Lane | None) -> str:
        if not self.steps:
            return "no steps run: nothing to say of idle time"
        how = "asynchronous (rollout.max_staleness)" if lane is not None else "synchronous"
        return (f"{how} run: of {self.steps:.1f} s of steps, the trainer waited {self.trainer:.1f} s "
                f"({100 * self.trainer / self.steps:.0f} %) for rollouts and the engine {self.engine:.1f} s "
                f"({100 * self.engine / self.steps:.0f} %) for weights")


# ---------------------------------------------------------------------------------------------------------
# building the pieces of a run

@dataclass
class _Run:
    policy: torch.nn.Module
    tokenizer: object
    generator: object
    environment: object
    collector: Collector
    learner: Learner
    optimizer: torch.optim.Optimizer
    scheduler: object
    stream: PromptStream
    eval_set: list
    correct_fn: RewardFn
    config_yaml: str
    reference_sync: ReferenceSync
    sampling_dist: Dist                      # the Dist of sampling's collectives (its own group when asynchronous)
    eval_rewards: list = field(default_factory=list)  # eval.rewards: (name, function), logged as eval/reward/<name>
    config: Config | None = None             # the run's config as recorded in config.yaml (`_built`)
    lagged: dict = field(default_factory=dict)  # a resume's weights of the batches in flight, by version
    precision: str = ""                      # the run's first line: bfloat16 autocast on or off, and why
    packing: str = ""                        # why compute.packing, asked for, does not apply ("" where it does)

    def moved_reference(self) -> dict | None:
        """A full model's reference tensors when resets can move them (checkpointed and restored), else None."""
        sync = self.reference_sync
        return reference_weights(sync.reference_model) if sync.every and sync.reference_model is not None else None


def _build(cfg: Config, rewards: list[RewardFn] | None, dist: Dist, given: Given | None = None) -> _Run:
    """The run's objects (`_built`); a reward that holds a process of its own (a judge's launched server, started
    by the probe of the rewards) is stopped if the rest of the build fails."""
    made: list = []
    try:
        return _built(cfg, rewards, dist, made, given or Given())
    except BaseException:
        close_rewards(made)
        raise


def _built(cfg: Config, rewards: list[RewardFn] | None, dist: Dist, made: list, given: Given) -> _Run:
    """Model, reference, generator, environment, rewards, optimiser and data, each from its config section (or
    what `given` holds in its place)."""
    m, a, c = cfg.model, cfg.algo, cfg.compute
    task = load_task(cfg.data, cfg.train.seed, train_dataset=given.train_dataset, eval_dataset=given.eval_dataset)
    # conversational prompts, and prompts with images (placed by the template), always go through the chat template,
    # which writes the special tokens itself
    chat = any(e.conversation is not None for e in [*task.train[:1], *task.eval[:1]])
    pictures = any(e.images for e in itertools.chain(task.train, task.eval))
    if chat or pictures:  # recorded, so that grpo eval/sample RUN_DIR render and tokenize the prompts as training did
        cfg = replace(cfg, model=replace(cfg.model, chat_template=True))
        m = cfg.model  # and the generator tokenizes them as such (no special tokens added to the template's)
    if chat and cfg.rollout.environment == "tools" and given.environment is None:
        raise ConfigError("the prompts are conversations (lists of messages); rollout.environment=tools takes text "
                          "prompts (its system prompt is model.system_prompt): give the prompt column as text")
    policy, tokenizer = load_model(m, cfg.lora, model=given.model, processing_class=given.processing_class)
    if c.reuse_memory:
        reuse_freed_memory(policy.device)
    image_prompts = image_prompts_for(policy, tokenizer, m.path)
    if pictures and image_prompts is None:  # now, before the reference, the engine and the rewards are built
        raise DataError(NO_VISION_TOWER)
    # model.autocast_bf16=auto decided for this model on this device; the run's config keeps 'auto'
    m, precision = resolved(m, policy)
    decided = replace(cfg, model=m)
    # one forward path for the reference and the training pass, so at the first step the two agree bit for bit
    path = forward_path(policy, sharded=c.sharding == "fsdp", share_prompt=c.share_prompt, lean=c.lean_forward,
                        autocast_bf16=m.autocast_bf16, packing=c.packing)
    packing = "" if path.packing or not c.packing else "compute.packing: the forward passes run unpacked: " + \
        packing_unavailable(policy, share_prompt=path.share_prompt, lean=path.lean)
    if path.multimodal:  # what does not apply to a vision-language model, said once
        packing = ("a vision-language model: every forward pass runs each row in full through the whole model, its "
                   "images and multimodal positions included (compute.packing, compute.share_prompt and "
                   "compute.lean_forward do not apply; docs/vision.md)")
    # the reference is the initial policy (before any resume or sharding), frozen; with LoRA, the same model
    # with its adapter disabled
    reference, reference_copy = None, None
    if a.beta > 0:
        reference_copy = None if is_lora(policy) else frozen_copy(policy)
        reference = LogprobModule(policy if reference_copy is None else reference_copy, path,
                                  adapter_off=is_lora(policy))
    trainable = wrap_for_training(policy, dist, c.sharding, path, train_mode=m.gradient_checkpointing)
    # asynchronous sampling runs its collectives in a group of its own, on its own thread (grpo/ahead.py)
    sampling_dist = dist.own_group() if cfg.rollout.max_staleness else dist
    all_finished = lambda done: not sampling_dist.any(not done)  # noqa: E731 - every process is done
    environment = build_environment(policy, tokenizer, decided, all_finished=all_finished, tools=given.tools,
                                    environment=given.environment)
    if given.environment is not None:  # the run's config.yaml names the environment that ran
        cfg = replace(cfg, rollout=replace(cfg.rollout, environment=environment_name(given.environment, environment)))
    build = functools.partial(build_rewards, tokenizer=tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                              overlong_buffer=cfg.overlong_buffer, sandbox_limits=Limits.from_config(cfg.sandbox),
                              reward_model=cfg.reward_model, device=str(next(policy.parameters()).device),
                              judge=cfg.judge, run_dir=Path(cfg.train.output_dir), vllm_cfg=cfg.vllm,
                              seed=cfg.train.seed)
    if rewards is not None:  # reward_weights fit them (validate)
        reward_fns = [(reward_name(f), f) for f in rewards]
    else:
        reward_fns = build(cfg.rewards)
    # eval.rewards: a reward the training also takes is the same object (one reward model loaded, one judge); a
    # Python function, by the name the run's config records it under (`train`)
    built = dict(zip(cfg.rewards, reward_fns))
    eval_rewards = [built[name] if name in built else build([name])[0] for name in cfg.eval.rewards]
    made.extend(fn for _, fn in [*reward_fns, *eval_rewards])
    if task.train:  # a broken reward fails now, in seconds (an empty training set is refused below)
        for _, fn in [*reward_fns, *eval_rewards]:  # a judge's template names only fields the examples have
            if hasattr(fn, "check_fields"):
                fn.check_fields(field_names(task.train[:1]))
        probe_rewards(reward_fns, cfg.reward_weights, tokenizer, task.train[0],
                      multi_turn=cfg.rollout.environment != "single_turn")
        take_figures(fn for _, fn in reward_fns)  # the probe is not part of the first step's figures
    optimizer, scheduler = build_optimizer((p for p in trainable.parameters() if p.requires_grad), cfg.optim,
                                           cfg.train.lr, cfg.train.steps)
    reference_sync = ReferenceSync(policy, reference_copy, optimizer, every=a.ref_sync_every,
                                   alpha=a.ref_sync_alpha, lora=is_lora(policy))
    # the generator last: an engine of its own (vLLM) starts only once everything else has been built
    generator = build_generator(policy, tokenizer, decided,
                                all_finished=all_finished, world_size=dist.world_size,
                                run_dir=Path(cfg.train.output_dir), group=sampling_dist.group)
    sampler = Sampler(environment, generator, rollout_sampling(cfg.rollout, cfg.rollout.group_size), cfg.train.seed)
    collector = Collector(sampler, reward_fns, cfg.reward_weights, tokenizer, cfg.train.prompts_per_step,
                          AdvantageSpec.from_algo(a))
    learner = Learner(trainable, reference, optimizer,
                      LossSpec.from_algo(a, max_completion_length=max_episode_tokens(cfg, policy)),
                      cfg.rollout.temperature, m.logprob_chunk_size, c.micro_batch_size, c.micro_batch_tokens,
                      cfg.optim.max_grad_norm, EntropyControl(a.entropy_coef) if a.use_adaptive_entropy else None,
                      cfg.train.steps_per_generation, rollout_sampling(cfg.rollout, 1).truncation)
    # every prompt fits the context with room for a completion (refused, or cut from the left)
    limit, why = prompt_limit(policy, cfg)
    fit = functools.partial(fit_prompts, render=prompt_formatter(tokenizer, m), tokenizer=tokenizer,
                            add_special_tokens=not (m.chat_template or chat), limit=limit,
                            truncate=cfg.data.truncate_prompts, why=why,
                            image_prompts=image_prompts)
    stream = PromptStream(fit(task.train, what="training"), cfg.train.prompts_per_step, cfg.train.seed)
    eval_set = fit(task.eval[:cfg.eval.size] if cfg.eval.size else task.eval, what="held-out")
    correct_fn = built[cfg.eval.reward][1] if rewards is not None and cfg.eval.reward in built else \
        resolve_reward(cfg.eval.reward, field="eval.reward", sandbox_limits=Limits.from_config(cfg.sandbox))
    given_fields = {"prompts": [], "completions": [], **example_fields(eval_set[:1]),  # and a multi-turn episode's
                    **({"messages": [], "turn_ends": []} if cfg.rollout.environment != "single_turn" else {})}
    if eval_set and (missing := missing_fields(correct_fn, given_fields)):  # now, not at the step-0 evaluation
        raise needs_fields_error(reward_name(correct_fn), missing, given_fields, field="eval.reward")
    return _Run(policy, tokenizer, generator, environment, collector, learner, optimizer, scheduler, stream, eval_set,
                correct_fn, _given_header(cfg, given) + to_yaml(cfg), reference_sync, sampling_dist, eval_rewards,
                config=cfg, precision=precision, packing=packing)


def _restore(cfg: Config, ckpt: Path, run: _Run) -> TrainState:
    """Load a checkpoint into the freshly built objects, after checking the config still matches."""
    saved = yaml.safe_load((ckpt / "config.yaml").read_text())
    if "optim" not in saved:
        raise ConfigError(f"cannot resume from {ckpt}: it was written by an earlier grpo, before train.* was split "
                          "into train.*, optim.* and compute.*; resume it with the grpo version that wrote it")
    refused, rounding = config_changes(saved, cfg.to_dict(), defaults=Config().to_dict())
    if refused:
        raise ConfigError(f"cannot resume from {ckpt}: the config differs in keys that change what is trained or "
                          "measured: "
                          + "; ".join(refused) + f". A resume may change only {may_change()}; to change the "
                          "others, start a new run")
    if rounding:
        warnings.warn(f"resuming with {'; '.join(rounding)}: the same computation in another order, so the run "
                      "is no longer bit for bit the uninterrupted one (it differs by rounding)", stacklevel=3)
    if saved["train"]["steps"] != cfg.train.steps and cfg.optim.lr_schedule != "constant":
        warnings.warn(f"train.steps changed from {saved['train']['steps']} to {cfg.train.steps}: the "
                      f"{cfg.optim.lr_schedule} LR decay now ends at the new step count", stacklevel=3)
    raw = load_checkpoint(ckpt, model=run.policy, optimizer=run.optimizer, scheduler=run.scheduler,  # shards too
                          reference=run.moved_reference())
    state = TrainState(**raw)
    # an engine started from the initial weights samples from these, the version after state.step steps
    run.generator.sync_weights(run.policy, state.step)
    run.stream.restore(state.stream["epoch"], state.stream["position"])
    if cfg.rollout.max_staleness:  # the weights that sample the batches in flight
        run.lagged = load_lagged(ckpt, lagged_versions(state.step, cfg.rollout.max_staleness))
    if run.learner.entropy is not None and state.entropy:
        last = state.entropy["last_entropy"]
        run.learner.entropy.coef = state.entropy["coef"]
        run.learner.entropy.last_entropy = math.inf if last is None else last
    return state


def _save(cfg: Config, run: _Run, dist: Dist, state: TrainState, *, stream: dict | None = None,
          lagged: dict | None = None) -> Path:
    """The checkpoint after state.step. Asynchronous: `stream`, the prompt stream after the step's batch (the lane
    has drawn further), and `lagged`, the weights of the batches in flight."""
    state.stream = stream or {"epoch": run.stream.epoch, "position": run.stream.position}
    if (control := run.learner.entropy) is not None:
        state.entropy = {"coef": control.coef,
                         "last_entropy": None if math.isinf(control.last_entropy) else control.last_entropy}
    path, error = None, None
    try:  # only the main process writes; if it cannot, every process stops with its message (none waits for it)
        path = save_checkpoint(Path(cfg.train.output_dir), state.step, model=run.policy, optimizer=run.optimizer,
                               scheduler=run.scheduler, rng=rng_states(), state=asdict(state),
                               config_yaml=run.config_yaml, keep_last=cfg.train.keep_last, is_main=dist.is_main,
                               reference=run.moved_reference(), lagged=lagged)
    except WriteError as e:
        error = str(e)
    _raise_on_every_process(dist, error)
    return path


def _raise_on_every_process(dist: Dist, error: str | GRPOError | None) -> None:
    """A sync point of all processes at which an error of any one of them (the main process writes) is raised by
    every one, so that none is left waiting for the others: a message is raised as a WriteError, a GRPOError as
    itself."""
    first = next((e for e in dist.gather_objects(error) if e), None)
    if first:
        raise first if isinstance(first, GRPOError) else WriteError(first)


def _stop_after_step(dist: Dist, stop: GracefulStop, log_failure: str | None) -> bool:
    """Whether every process stops after this step (a signal reached any of them); a write of the run log that
    failed on the main process is raised by every process."""
    told = dist.gather_objects((stop.signal is not None, log_failure))  # one exchange for both
    failed = next((e for _, e in told if e), None)
    if failed:
        raise WriteError(failed)
    return any(signalled for signalled, _ in told)


def _log_failure(logger: RunLogger, out: Path) -> str | None:
    return _write_error(logger.failure, out) if logger.failure is not None else None


def _write_error(e: OSError, out: Path) -> str:
    """A failed write of the run's files as its one line: what, why, and where the run can continue from."""
    return f"could not write {e.filename or f'into {out}'}: {e.strerror or e}; {resume_hint(out, e)}"


def _evaluate(cfg: Config, run: _Run, dist: Dist, logger: RunLogger, step: int,
              lane: Lane | None = None) -> tuple[dict, dict]:
    """The held-out figures, and {"perf/eval_seconds": ...} (both empty without held-out examples); with `lane`,
    the ones it made with the weights of `step` (the seconds: the trainer's wait for them)."""
    if not run.eval_set:
        return {}, {}
    start = time.perf_counter()
    if lane is not None:
        metrics = lane.evaluation(step)
    else:
        metrics = _held_out(cfg, run, dist)
    logger.write(f"step {step:>4}: held-out accuracy {metrics['eval/accuracy']:.3f}"
                 + "".join(f", {k[5:]} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/pass@")))
    return metrics, {"perf/eval_seconds": time.perf_counter() - start}


def _held_out(cfg: Config, run: _Run, dist: Dist) -> dict[str, float]:
    """`grpo.evaluation.evaluate` of the run's held-out examples, with the run's sampler settings."""
    return evaluate(run.environment, run.generator, run.eval_set, run.correct_fn,
                    max_new_tokens=cfg.rollout.max_new_tokens, pass_k=cfg.eval.pass_k, temperature=cfg.eval.temperature,
                    seed=cfg.train.seed, dist=dist, rewards=run.eval_rewards, threshold=cfg.eval.threshold,
                    sampling=rollout_sampling(cfg.rollout, 1))


def _warn_unscored(exp, step: int, logger: RunLogger) -> None:
    """A step in which no reward function applied to any completion (every value None) has no signal: say so."""
    if len(exp) and exp.all_rewards.isnan().all():
        logger.write(f"step {step}: no reward function applied to any of the {exp.all_rewards.numel()} completions "
                     "(every reward was None): the step has no policy gradient")


def _check_finite(cfg: Config, state: TrainState, updates: list[dict], metrics: dict, step: int, logger,
                  result: TrainResult) -> None:
    """Count consecutive steps with a skipped (non-finite) update; abort after `max_nonfinite_steps`."""
    bad = [u["nonfinite"] for u in updates if u["nonfinite"]]
    metrics["fault/skipped_updates"] = len(bad)
    if not bad:
        state.nonfinite_streak = 0
        return
    state.nonfinite_streak += 1
    metrics["fault/nonfinite"] = bad[0]
    logger.write(f"step {step}: non-finite {bad[0]}; update skipped "
                 f"({state.nonfinite_streak}/{cfg.train.max_nonfinite_steps} in a row)")
    if state.nonfinite_streak >= cfg.train.max_nonfinite_steps:
        logger.log(step, metrics)
        where = f"; the last good checkpoint is {result.checkpoint}" if result.checkpoint else ""
        raise TrainingAborted(f"aborted at step {step}: non-finite {bad[0]} in {state.nonfinite_streak} "
                              f"consecutive steps (train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); "
                              f"no weights were written{where}. Lower train.lr or check the rewards")
