"""The run directory: one run at a time holds it (a lock a killed run leaves is taken over), a new run refuses one
that holds a run, replaces it only when told, never touches other files, and an unwritable directory is one clear
error."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.errors import ConfigError
from grpo.rundir import LOCK_FILE, RunLock, claim, clear, discard_unstarted, replace_dir, run_files


def old_run(out):
    (out / "model").mkdir(parents=True)
    (out / "model" / "model.safetensors").write_bytes(b"weights")
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    (out / "config.yaml").write_text("train: {}\n")
    (out / "notes.txt").write_text("mine")


def test_a_new_run_refuses_a_directory_that_holds_one(tmp_path):
    old_run(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"already holds a run \(config.yaml, metrics.jsonl, model/\); continue it "
                                          r"with train.resume=auto, choose another train.output_dir, or replace it "
                                          r"with train.overwrite=true"):
        claim(tmp_path, overwrite=False, resuming=False)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # untouched
    with pytest.raises(ConfigError, match="holds a finished run .* but no complete checkpoint to resume from"):
        claim(tmp_path, overwrite=False, resuming=False, asked_resume=True)
    assert claim(tmp_path, overwrite=False, resuming=True) == []  # a resume continues it


def test_resume_auto_starts_over_a_run_stopped_before_its_first_checkpoint(tmp_path):
    (tmp_path / "config.yaml").write_text("train: {}\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "tensorboard").mkdir()
    replaced = claim(tmp_path, overwrite=False, resuming=False, asked_resume=True)
    assert replaced == ["config.yaml", "metrics.jsonl", "tensorboard"] and run_files(tmp_path) == replaced
    clear(tmp_path, replaced)  # once the new run is built
    assert run_files(tmp_path) == []


def test_overwrite_deletes_only_the_run_files(tmp_path):
    old_run(tmp_path)
    clear(tmp_path, claim(tmp_path, overwrite=True, resuming=False))
    assert run_files(tmp_path) == [] and (tmp_path / "notes.txt").read_text() == "mine"


def test_an_empty_or_new_directory_is_fine(tmp_path):
    claim(tmp_path / "a" / "b", overwrite=False, resuming=False)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "data.jsonl").write_text("{}\n")  # someone else's file is not a run
    claim(tmp_path / "c", overwrite=False, resuming=False)


def test_an_unwritable_directory(tmp_path):
    if os.geteuid() == 0:  # root writes through file modes; /sys refuses even root
        where = Path("/sys/grpo-run")
    else:
        where = tmp_path / "ro"
        where.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=f"train.output_dir='{where}' cannot be written: "):
        claim(where, overwrite=False, resuming=False)


def test_a_file_is_not_a_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        claim(tmp_path / "f", overwrite=False, resuming=False)
    with pytest.raises(ConfigError, match="cannot be written"):
        claim(tmp_path / "f" / "sub", overwrite=False, resuming=False)


def test_a_run_that_failed_before_its_first_step_leaves_nothing(tmp_path):
    (tmp_path / "config.yaml").write_text("train: {}\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    (tmp_path / "wandb").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    discard_unstarted(tmp_path)
    assert run_files(tmp_path) == [] and (tmp_path / "notes.txt").exists()
    # one that got as far as an update step keeps its files, to be read
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "loss": 0.1}\n')
    discard_unstarted(tmp_path)
    assert run_files(tmp_path) == ["metrics.jsonl"]


def test_replace_dir_is_all_or_nothing(tmp_path):
    final = tmp_path / "model"
    with replace_dir(final) as tmp:
        (tmp / "a").write_text("1")
    assert (final / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    with pytest.raises(OSError), replace_dir(final) as tmp:  # a failed write leaves the old one whole
        (tmp / "a").write_text("2")
        raise OSError(28, "No space left on device")
    assert (final / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    (tmp_path / ".tmp-model-999999").mkdir()  # left by a process killed mid-write: the next write removes it
    with replace_dir(final) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in final.iterdir()) == ["b"] and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_killed_final_save_is_part_of_the_run(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("train: {}\n")
    (out / ".tmp-model-123").mkdir()
    assert run_files(out) == ["config.yaml", ".tmp-model-123"]
    clear(out, claim(out, overwrite=True, resuming=False))
    assert list(out.iterdir()) == []


def test_replace_dir_puts_back_a_model_moved_aside_by_a_killed_save(tmp_path):
    (tmp_path / ".old-model-4242").mkdir()  # killed between moving the old model aside and renaming the new in
    (tmp_path / ".old-model-4242" / "w").write_text("old")
    with pytest.raises(RuntimeError), replace_dir(tmp_path / "model"):
        raise RuntimeError("the next save fails too")
    assert (tmp_path / "model" / "w").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["model"]


# a process that takes the lock of a directory and forks a child (as a run's helpers may), both then waiting; the
# child says it runs before the parent names it, since until the child's at-fork handler has closed its copy of
# the lock's file it still holds the lock (on a busy machine the parent could be killed before the child ran)
HOLDER = """
import os, sys, time
from grpo.rundir import RunLock
lock = RunLock(sys.argv[1])
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.write(w, b"x")  # fork() has returned here: the at-fork handlers have run
    time.sleep(120)
    os._exit(0)
os.read(r, 1)
print(child, flush=True)
time.sleep(120)
"""


def test_one_run_per_directory_and_a_killed_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        assert sorted(os.listdir(out)) == [LOCK_FILE]
        # while it lives, the directory is refused, naming it
        with pytest.raises(ConfigError) as e:
            RunLock(out)
        assert str(e.value).startswith(f"train.output_dir='{out}' is in use by another run (pid {holder.pid} on host "
                                       f"{socket.gethostname()}, started 20")
        assert str(e.value).endswith("UTC); wait for it to end or stop it, or choose another train.output_dir")
        # killed (-9), it cannot release the lock; its forked child, still running, does not hold it
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # alive
        with pytest.warns(UserWarning, match=f"took over the lock of train.output_dir='{out}' from a run that ended "
                                             f"without releasing it \\(pid {holder.pid} on host "):
            lock = RunLock(out)
        assert f'"pid": {os.getpid()}' in (out / LOCK_FILE).read_text()
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} "):
            RunLock(out)  # a second run in this process (the Python API) is refused too
        lock.release()
        assert os.listdir(out) == []  # a run that ends removes its lock file
        RunLock(out).release()
    finally:
        os.kill(child, signal.SIGKILL)
        holder.kill()


def test_the_lock_refuses_a_file_and_an_unwritable_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        RunLock(tmp_path / "f")
    where = Path("/sys/grpo-run") if os.geteuid() == 0 else tmp_path / "ro"
    if os.geteuid() != 0:
        where.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match=f"train.output_dir='{where}' cannot be written: "):
        RunLock(where)
