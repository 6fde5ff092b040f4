"""The run directory (`train.output_dir`): a new run claims it only if it holds no run yet, or when told to
replace one (`train.overwrite`); a resume continues the run it holds. Nothing of a user's is touched without
that instruction, and a directory that cannot be written is one clear error before anything runs."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from grpo.errors import ConfigError

# what a run writes into its directory; anything else there is the user's and is never touched
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "chart.png", "tracking.json", "tensorboard",
             "wandb", "checkpoints", "model", "model-merged")


def run_files(out: Path) -> list[str]:
    """The run outputs `out` holds (names of RUN_FILES that exist there)."""
    return [n for n in RUN_FILES if (out / n).exists()]


def claim(out: Path, *, overwrite: bool, resuming: bool, asked_resume: bool = False, is_main: bool = True) -> None:
    """Make `out` ready for a run. A new run (`resuming` False) into a directory that holds one is refused,
    unless `overwrite`: then the main process deletes that run's files (only those). Every process checks, so
    every process refuses alike."""
    found = run_files(out) if out.is_dir() else []
    if found and not resuming:
        if not overwrite:
            shown = ", ".join(n + ("/" if (out / n).is_dir() else "") for n in found)
            if asked_resume:  # train.resume=auto found no complete checkpoint to continue from
                raise ConfigError(f"train.output_dir={str(out)!r} holds a run ({shown}) but no complete checkpoint "
                                  "to resume from; choose another train.output_dir, or replace the run with "
                                  "train.overwrite=true (and no train.resume)")
            raise ConfigError(f"train.output_dir={str(out)!r} already holds a run ({shown}); continue it with "
                              "train.resume=auto, choose another train.output_dir, or replace it with "
                              "train.overwrite=true")
        if is_main:
            for n in found:
                path = out / n
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.output_dir={str(out)!r} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # can a file be written there?
            pass
    except OSError as e:
        raise ConfigError(f"train.output_dir={str(out)!r} cannot be written: {e.strerror or e}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"train.output_dir={str(out)!r} cannot be written: permission denied")
