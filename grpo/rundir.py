"""The run directory (`train.output_dir`): one run at a time holds it (`RunLock`, an flock on a file inside it);
a new run claims it only if it holds no run yet, or when told to replace one (`train.overwrite`); a resume
continues the run it holds. Nothing of a user's is touched without that instruction, and a directory that cannot
be written, or that another live run holds, is one clear error before anything runs. Also the file helpers of
what grpo writes (a directory replaced atomically, a file's checksum), shared by checkpoints, the final model and
the packaged models' cache."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import warnings
from datetime import datetime, timezone
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
        raise _not_a_dir(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # can a file be written there?
            pass
    except OSError as e:
        raise _unwritable(out, e) from None
    return found if found and not resuming else []


def clear(out: Path, names: list[str]) -> None:
    """Delete the named run files of `out` (what `claim` returned)."""
    for n in names:
        path = out / n
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


# ---------------------------------------------------------------------------------------------------------
# one run per directory

LOCK_FILE = ".grpo.lock"  # in the run directory; it names the process that holds the run (JSON)

# the lock files this process holds, by descriptor: a child made by fork() closes its copies at once, so a
# child left running after its parent was killed (-9) does not keep the parent's lock
_HELD: dict[int, Path] = {}


def _close_held_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class RunLock:
    """The lock of a run directory, held for the length of a run by its main process: an exclusive `flock` on
    `<out>/.grpo.lock`, which also names the holder (pid, host, start time). The kernel drops an flock when
    its process dies however it ends (kill -9 included), so a lock left by a killed run is stale by
    construction and the next run takes it over; the file it leaves says whose it was."""

    def __init__(self, out: Path):
        """Take the lock of `out` (made if missing) without waiting; a ConfigError naming the holder if another
        live process holds it, or if `out` is a file or cannot be written. Nothing else in `out` is read or
        written."""
        out = Path(out)
        self.path = out / LOCK_FILE
        if out.exists() and not out.is_dir():
            raise _not_a_dir(out)
        while True:
            try:
                out.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise _unwritable(out, e) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd, wait=1.0)
                os.close(fd)
                raise ConfigError(f"train.output_dir={str(out)!r} is in use by another run ({_describe(holder)}); "
                                  "wait for it to end or stop it, or choose another train.output_dir") from None
            except OSError as e:  # a file system without locks (an NFS mount with `nolock`, say)
                os.close(fd)
                warnings.warn(f"train.output_dir={str(out)!r} cannot be locked ({e.strerror}): another run into it "
                              "would not be refused", stacklevel=2)
                self.fd = None
                return
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder removed the file as it ended, after we opened it: take the new one
        left = _holder(fd, wait=0)
        if left is not None:  # a run removes the file as it ends: this one was killed
            warnings.warn(f"took over the lock of train.output_dir={str(out)!r} from a run that ended without "
                          f"releasing it ({_describe(left)})", stacklevel=2)
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")})
        self.fd = fd
        _HELD[fd] = self.path
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode() + b"\n", 0)
        except OSError as e:  # a full disk
            self.release()
            raise _unwritable(out, e) from None

    def release(self) -> None:
        """Remove the lock file and drop the lock (the file first, while still held: a run that opened it
        meanwhile sees it gone and makes a new one)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        _HELD.pop(fd, None)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino)


def _holder(fd: int, wait: float) -> dict | None:
    """What the lock file says of its holder ({"pid", "host", "started"}), None if it says nothing. A holder that
    has just taken the lock may not have written it yet: wait up to `wait` seconds for it."""
    deadline = time.monotonic() + wait
    while True:
        try:
            info = json.loads(os.pread(fd, 4096, 0) or b"null")
        except ValueError:
            info = None
        if isinstance(info, dict) or time.monotonic() >= deadline:
            return info if isinstance(info, dict) else None
        time.sleep(0.05)


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "a process that has not named itself yet"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _not_a_dir(out: Path) -> ConfigError:
    return ConfigError(f"train.output_dir={str(out)!r} is a file, not a directory")


def _unwritable(out: Path, e: OSError) -> ConfigError:
    return ConfigError(f"train.output_dir={str(out)!r} cannot be written: {e.strerror or e}")
