"""Experiment trackers (`log.trackers`): TensorBoard, Weights & Biases and Trackio, each given every step's
metrics, the resolved config once and the sample completions as a table. Only the main process reports
(`RunLogger` makes none elsewhere). docs/tracking.md.

A resumed run continues the same tracked run: `tracking.json` in the output directory keeps the trackers of
the run and its W&B run id. A tracker that was already reporting skips the steps it has (an exact resume
recomputes them to the same values); one added on resume first gets the history up to the checkpoint.
"""
from __future__ import annotations

import importlib
import json
import math
import uuid
from pathlib import Path
from typing import Protocol

from grpo.errors import GRPOError

STATE_FILE = "tracking.json"


class Tracker(Protocol):
    name: str
    rewrites: bool  # a resumed run's later steps replace the ones it had logged (TensorBoard's purge_step)
    where: str      # a line that says where to look, or "" when the tracker prints its own

    def log(self, step: int, metrics: dict) -> None: ...

    def samples(self, step: int, rows: list[dict]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def open_trackers(names: list[str], out_dir: Path, *, config: dict, project: str, run_name: str,
                  resume_step: int | None) -> tuple[list[Tracker], list[str]]:
    """Start each named tracker; with `resume_step`, continue the runs the earlier process started. Returns the
    trackers and the names of those that reported before this resume (empty for a new run)."""
    state_path = out_dir / STATE_FILE
    state = json.loads(state_path.read_text()) if resume_step is not None and state_path.exists() else {}
    state.setdefault("wandb_id", uuid.uuid4().hex[:12])
    name = run_name or out_dir.resolve().name
    # a run written before tracking.json existed is taken to have reported where it reports now
    earlier = list(state.get("trackers", names if resume_step is not None else []))
    state["trackers"] = sorted(set(earlier) | set(names))
    trackers: list[Tracker] = []
    try:
        for kind in names:
            if kind == "tensorboard":
                trackers.append(TensorBoard(out_dir / "tensorboard", config, resume_step,
                                            with_config=kind not in earlier))
            elif kind == "wandb":
                trackers.append(Wandb(out_dir, config, project, name, state["wandb_id"], kind in earlier))
            elif kind == "trackio":
                trackers.append(Trackio(config, project, name, kind in earlier))
    except BaseException:
        for t in trackers:
            t.close(failed=True)
        raise
    state_path.write_text(json.dumps(state, indent=1) + "\n")
    return trackers, earlier


def check_installed(names: list[str]) -> None:
    """Each tracker's package imports (before a run builds anything), or one error naming its extra."""
    for name in names:
        if name == "tensorboard":
            continue
        try:
            module = importlib.import_module(name)
            found = "" if hasattr(module, "init") else f" ('import {name}' finds only {_where(module)})"
        except ImportError:
            found = None
        if found is None or found:  # not importable, or only a directory of that name (W&B writes ./wandb)
            raise GRPOError(f"log.trackers names {name}, which is not installed{found or ''}; install it with pip "
                            f"install 'grpo[{name}]', or leave it out of log.trackers")


def _where(module) -> str:
    return ", ".join(getattr(module, "__path__", [])) or str(getattr(module, "__file__", module.__name__))


def scalars(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics row (a NaN, e.g. the KL of a step without loss tokens, is not a point)."""
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Columns and rows of sample completions; a multi-turn episode's messages are left out (samples.jsonl has
    them), any other non-scalar becomes its JSON text."""
    columns = [c for c in dict.fromkeys(k for r in rows for k in r) if c != "messages"]
    plain = lambda v: v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v, default=repr)  # noqa: E731
    return columns, [[plain(r.get(c)) for c in columns] for r in rows]


class TensorBoard:
    name, rewrites = "tensorboard", True

    def __init__(self, path: Path, config: dict, resume_step: int | None, with_config: bool):
        from torch.utils.tensorboard import SummaryWriter

        import yaml
        self._writer = SummaryWriter(str(path), purge_step=None if resume_step is None else resume_step + 1)
        self.where = f"tensorboard: tensorboard --logdir {path}"
        if with_config:
            text = yaml.safe_dump(config, sort_keys=False)
            self._writer.add_text("config", "".join("    " + line + "\n" for line in text.splitlines()), 0)

    def log(self, step: int, metrics: dict) -> None:
        # one event per step holding every scalar: add_scalar writes an event per value, ten times the cost
        # (about 2 ms a step for 25 values, a few percent of a small model's step)
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars(metrics).items()]
        self._writer._get_file_writer().add_summary(Summary(value=values), step)

    def samples(self, step: int, rows: list[dict]) -> None:
        columns, data = table(rows)
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ⏎ ")  # noqa: E731 - one markdown table cell
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
        self._writer.add_text("samples", "\n".join(lines), step)

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class _LibraryRun:
    """What W&B and Trackio share: a run object with `log(values, step=)` and a `Table(columns=, data=)` type in
    the library's module (`self._lib`)."""

    def log(self, step: int, metrics: dict) -> None:
        self._run.log(scalars(metrics), step=step)

    def samples(self, step: int, rows: list[dict]) -> None:
        columns, data = table(rows)
        self._run.log({"samples": self._lib.Table(columns=columns, data=data)}, step=step)


class Wandb(_LibraryRun):
    """A W&B run with the id kept in tracking.json; its files go to <output_dir>/wandb. WANDB_MODE=offline logs
    without a network (`wandb sync` uploads later); WANDB_ENTITY and the other WANDB_* settings apply."""

    name, rewrites, where = "wandb", False, ""

    def __init__(self, out_dir: Path, config: dict, project: str, name: str, run_id: str, resuming: bool):
        import wandb

        self._lib = wandb
        try:
            self._run = wandb.init(project=project, name=name, id=run_id, dir=str(out_dir), config=config,
                                   resume="allow" if resuming else "never", reinit="create_new")
        except Exception as e:  # no API key, no network, a refused id: the run has not started
            raise GRPOError(f"wandb could not start its run: {' '.join(str(e).split())[:300]} (set WANDB_MODE="
                            "offline to log locally and upload later with wandb sync)") from None

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class Trackio(_LibraryRun):
    """A Trackio run in its local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show`
    opens the dashboard), or on a Hugging Face Space with TRACKIO_SPACE_ID. A resumed run continues the latest
    run of that name in the project."""

    name, rewrites, where = "trackio", False, ""  # its own lines say where the run is

    def __init__(self, config: dict, project: str, name: str, resuming: bool):
        import trackio

        self._lib = trackio
        try:
            self._run = trackio.init(project=project, name=name, config=config,
                                     resume="allow" if resuming else "never")
        except Exception as e:  # a project name it refuses, a Space without a Hugging Face login
            raise GRPOError(f"trackio could not start its run: {' '.join(str(e).split())[:300]}") from None

    def close(self, failed: bool = False) -> None:
        if self._lib.context_vars.current_run.get() is self._run:
            self._lib.finish()  # also un-registers it, or trackio would finish it again at exit
        else:
            self._run.finish()
