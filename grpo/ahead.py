"""Asynchronous rollouts (`rollout.max_staleness` = k ≥ 1; SPEC 14.1 and 14.13, docs/async.md): a `Lane` samples,
scores and chooses each step's batch (`grpo.collect.collect`, which the trainer hands it; steps 1–4 of the loop) on
a thread of its own while the trainer learns from the batches before it.

The schedule is a function of k alone. Versions count training steps (the generator's `version`: 0 as built, t
after step t). Batch s is sampled by version max(0, s − 1 − k), so while step t trains, the lane samples batch
t + k + 1 with the weights of step t... as soon as step t has published them (`publish`): at most k + 1 batches
are ahead of the trainer, and the batch step t trains is η = min(k, t − 1) versions behind the weights it is first
updated from. After step t the trainer hands its weights to the lane as a copy (`snapshot_weights`), which the
lane loads into the engine when a batch needs that version; the copies of the k versions the batches in flight
need are what a checkpoint stores (`lagged-v*.safetensors`), so that a resumed run samples them again exactly.

`staleness_mode`:
- "fixed": batch s is sampled by exactly version max(0, s − 1 − k), whatever the timing: a run is a function of
  its seed and k, and a resumed or a two-process run equals it figure for figure;
- "freshest": batch s is sampled by the newest version the trainer has published when the lane starts it (at
  least s − 1 − k): less waiting for the trainer, but which version depends on timing (not reproducible).

Held-out evaluations after step t run on the lane too, in a fixed place of its sequence (before batch t + k + 1,
with the weights of step t), so that the engine is never used by two threads and every process's lane runs the
same collectives in the same order. The lane's collectives (dynamic sampling's verdicts, the rewards of the
advantages, the evaluation's figures) run in a process group of its own (`Dist.own_group`), so they never
interleave with the trainer's.

A failure on the lane (a server lost, a reward function raising) is raised by the trainer when it next asks for a
batch or an evaluation: nothing half-trained, and the last checkpoint resumes the run.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo.data import PromptStream
from grpo.distributed import Dist
from grpo.experience import Experience

MODES = ("fixed", "freshest")


def sampled_by(step: int, k: int) -> int:
    """The version that samples batch `step` in fixed-lag mode: max(0, step − 1 − k)."""
    return max(0, step - 1 - k)


def lagged_versions(step: int, k: int) -> list[int]:
    """The versions that sample the k batches after step `step` (those in flight then), other than step's own
    weights: what a checkpoint after `step` stores beside the model."""
    return sorted({sampled_by(s, k) for s in range(step + 1, step + k + 1)} - {step})


@dataclass
class Batch:
    """One step's batch as the lane made it."""

    step: int
    exp: Experience
    version: int            # the weights that sampled it
    stream: dict            # {"epoch", "position"} of the prompt stream after its draws
    seconds: float          # the lane's time to sample and score it


class LaneFailed(Exception):
    """Carries the lane's exception to the trainer (raised as the exception itself)."""


class Lane:
    """The sampling thread of an asynchronous run: batches first..last, and evaluations after the steps in
    `eval_steps`, in the order the module docstring gives."""

    def __init__(self, collect: Callable[[PromptStream, Dist], Experience], stream: PromptStream, generator,
                 dist: Dist, *, k: int, mode: str, first: int, last: int, eval_steps: set[int],
                 evaluate: Callable[[Dist], dict], weights: dict[int, dict]):
        """`collect(stream, dist)`: the next batch (`grpo.collect.collect` with the run's `Collector`). `dist`: the
        lane's own `Dist` (`Dist.own_group`). `weights`: the versions that sample the first
        batches, by version (the weights before step `first`, and those a checkpoint held). `evaluate(dist)`: the
        held-out figures with the engine's current weights."""
        if mode not in MODES:
            raise ValueError(f"staleness mode {mode!r}; choose one of {MODES}")
        self.collect, self.stream, self.generator, self.dist = collect, stream, generator, dist
        self.k, self.mode, self.first, self.last = k, mode, first, last
        self.eval_steps, self.evaluate = set(eval_steps), evaluate
        self._weights = dict(weights)
        self._cond = threading.Condition()
        self._stop = False
        self._batches: queue.Queue = queue.Queue()
        self._evals: queue.Queue = queue.Queue()
        self.engine_wait = 0.0          # seconds the lane waited for weights, since the trainer last took them
        self.engine_wait_total = 0.0
        self.busy_total = 0.0           # seconds it sampled, scored and evaluated
        self._thread = threading.Thread(target=self._run, name="grpo-ahead", daemon=True)
        self._threads = torch.get_num_threads()
        self._thread.start()

    # ---- the trainer's side

    def publish(self, version: int, weights: dict) -> None:
        """The weights after step `version` (a `snapshot_weights` copy); versions no batch or checkpoint can need
        any more are let go."""
        with self._cond:
            self._weights[version] = weights
            keep = sampled_by(version + 1, self.k)
            for v in [v for v in self._weights if v < keep]:
                del self._weights[v]
            self._cond.notify_all()

    def lagged(self, step: int) -> dict[int, dict]:
        """The weights a checkpoint after `step` stores (`lagged_versions`)."""
        with self._cond:
            return {v: self._weights[v] for v in lagged_versions(step, self.k)}

    def next_batch(self, step: int) -> tuple[Batch, float]:
        """Batch `step` and the seconds the trainer waited for it."""
        start = time.perf_counter()
        batch = self._take(self._batches)
        if batch.step != step:  # the schedule is the lane's and the trainer's alike
            raise RuntimeError(f"the sampling lane handed batch {batch.step} for step {step}")
        return batch, time.perf_counter() - start

    def evaluation(self, step: int) -> dict:
        """The held-out figures after `step` (the lane runs them with the weights of `step`)."""
        got_step, metrics = self._take(self._evals)
        if got_step != step:
            raise RuntimeError(f"the sampling lane evaluated after step {got_step}, not {step}")
        return metrics

    def take_engine_wait(self) -> float:
        with self._cond:
            seconds, self.engine_wait = self.engine_wait, 0.0
        return seconds

    def close(self, timeout: float | None = None) -> None:
        """Stop the lane after what it is doing (a batch in progress is finished, then dropped)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _take(self, q: queue.Queue):
        while True:
            try:
                item = q.get(timeout=1.0)
            except queue.Empty:
                if self._thread.is_alive():
                    continue
                try:  # its last item may have come between the wait and the check
                    item = q.get_nowait()
                except queue.Empty:
                    raise RuntimeError("the sampling lane stopped without a word") from None
            if isinstance(item, LaneFailed):
                raise item.args[0]
            return item

    # ---- the lane's side

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # a new thread starts with PyTorch's default; the run's setting
        try:
            for s in range(self.first, self.last + self.k + 2):
                t = s - 1 - self.k  # the version batch s is sampled by, at the latest
                if t >= self.first and t in self.eval_steps:  # the evaluation after step t, with its weights
                    version = self._agree(self._wait(t, exact=True), exact=True)
                    if version is None:
                        return
                    self._load(version)
                    start = time.perf_counter()
                    self._evals.put((t, self.evaluate(self.dist)))
                    self.busy_total += time.perf_counter() - start
                if s > self.last:
                    continue
                version = self._agree(self._wait(max(0, t), exact=self.mode == "fixed"), exact=self.mode == "fixed")
                if version is None:
                    return
                self._load(version)
                start = time.perf_counter()
                exp = self.collect(self.stream, self.dist)
                seconds = time.perf_counter() - start
                self.busy_total += seconds
                self._batches.put(Batch(s, exp, version, {"epoch": self.stream.epoch,
                                                          "position": self.stream.position}, seconds))
        except BaseException as e:  # noqa: BLE001 - raised by the trainer, where it waits
            failed = LaneFailed(e)
            self._batches.put(failed)
            self._evals.put(failed)

    def _wait(self, version: int, *, exact: bool) -> int | None:
        """Block until the trainer has published `version` (fixed) or any newer one (freshest): this process's
        choice of the version to load (freshest: its newest). None: this lane is stopping."""
        start = time.perf_counter()
        with self._cond:
            while not self._stop and not self._ready(version, exact):
                self._cond.wait()
            if self._stop:
                return None
            waited = time.perf_counter() - start
            self.engine_wait += waited
            self.engine_wait_total += waited
            return version if exact else max(self._weights)

    def _agree(self, version: int | None, *, exact: bool) -> int | None:
        """What every process's lane does next, decided together: stop (None) if any lane is stopping, so that
        none starts a batch whose collectives the others would never join (a lane stops when its own trainer
        closes it, and trainers stop at slightly different moments); else load `version`, in freshest mode the
        oldest of the processes' newest (which every process holds)."""
        if self.dist.world_size == 1:
            return version
        if self.dist.any(version is None):
            return None
        return version if exact else int(-self.dist.max(-float(version)))

    def _ready(self, version: int, exact: bool) -> bool:
        return version in self._weights if exact else any(v >= version for v in self._weights)

    def _load(self, version: int) -> int | None:
        """The engine holds `version` (loaded if it holds another)."""
        if self.generator.version != version:
            with self._cond:
                weights = self._weights.get(version)
            if weights is None:
                raise RuntimeError(f"the sampling lane needs the weights of version {version}, which are gone")
            self.generator.sync_weights(weights, version)
        return version
