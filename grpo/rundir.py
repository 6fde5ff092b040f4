"""The run directory (`train.output_dir`): a new run claims it only if it holds no run yet, or when told to
replace one (`train.overwrite`); a resume continues the run it holds. Nothing of a user's is touched without
that instruction, and a directory that cannot be written is one clear error before anything runs. Also the file
helpers of what grpo writes (a directory replaced atomically, a file's checksum), shared by checkpoints, the
final model and the packaged models' cache."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from grpo.errors import ConfigError

# what a run writes into its directory; anything else there is the user's and is never touched
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "chart.png", "tracking.json", "tensorboard",
             "wandb", "checkpoints", "model", "model-merged")


# what a final save killed midway leaves (`replace_dir`): put back or removed by the next save, or with the run's
# files
LEFTOVERS = (".tmp-model*", ".old-model*")


def run_files(out: Path) -> list[str]:
    """The run outputs `out` holds (names of RUN_FILES that exist there, and a killed final save's leftovers)."""
    return [n for n in RUN_FILES if (out / n).exists()] + sorted(p.name for g in LEFTOVERS for p in out.glob(g))


@contextlib.contextmanager
def replace_dir(final: Path):
    """Yield an empty temporary directory beside `final`, which replaces `final` when the block ends; if the block
    fails it is removed and `final` is left as it was. A process killed inside the block leaves only the
    temporary directory (never a half-written `final`), which the next call removes."""
    for old in sorted(final.parent.glob(f".old-{final.name}-*")):  # killed between the two renames below
        if not final.exists():
            os.rename(old, final)
        else:
            shutil.rmtree(old, ignore_errors=True)
    for left in final.parent.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(left, ignore_errors=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path) -> str:
    """The hex SHA-256 of a file."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def discard_unstarted(out: Path) -> None:
    """After a new run failed before its first update step: remove what it wrote (config, an evaluation row,
    trackers' files), so the directory holds no half-written run. A run with an update step logged, a
    checkpoint or a model keeps everything."""
    if (out / "checkpoints").exists() or (out / "model").exists() or _logged_a_step(out / "metrics.jsonl"):
        return
    for n in run_files(out):
        path = out / n
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _logged_a_step(metrics: Path) -> bool:
    try:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
    except OSError:
        return True  # unreadable: keep it
    for line in lines:
        try:
            if json.loads(line).get("step", 0) >= 1:
                return True
        except (ValueError, AttributeError):
            continue
    return False


def claim(out: Path, *, overwrite: bool, resuming: bool, asked_resume: bool = False) -> list[str]:
    """Check that `out` can take a run, and return the old run's files that the new one replaces (to `clear` once
    the new run has been built, so that a run failing at start-up leaves the old one whole). A new run
    (`resuming` False) into a directory that holds one is refused, unless `overwrite`, or unless `asked_resume`
    (train.resume=auto found no complete checkpoint) and that run never finished. Every process checks, so every
    process refuses alike."""
    found = run_files(out) if out.is_dir() else []
    if found and not resuming:
        finished = "model" in found or "model-merged" in found
        # train.resume=auto without a complete checkpoint: a run stopped before its first one starts over, but a
        # finished run (its model written) is not replaced
        if not overwrite and not (asked_resume and not finished):
            shown = ", ".join(n + ("/" if (out / n).is_dir() else "") for n in found)
            if asked_resume:
                raise ConfigError(f"train.output_dir={str(out)!r} holds a finished run ({shown}) but no complete "
                                  "checkpoint to resume from; choose another train.output_dir, or replace the run "
                                  "with train.overwrite=true (and no train.resume)")
            raise ConfigError(f"train.output_dir={str(out)!r} already holds a run ({shown}); continue it with "
                              "train.resume=auto, choose another train.output_dir, or replace it with "
                              "train.overwrite=true")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.output_dir={str(out)!r} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # can a file be written there?
            pass
    except OSError as e:
        raise ConfigError(f"train.output_dir={str(out)!r} cannot be written: {e.strerror or e}") from None
    return found if found and not resuming else []


def clear(out: Path, names: list[str]) -> None:
    """Delete the named run files of `out` (what `claim` returned)."""
    for n in names:
        path = out / n
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
