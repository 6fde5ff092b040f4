"""Checkpoints that resume a run exactly, written atomically.

A checkpoint is a directory `<run>/checkpoints/step-00000010/` holding the model weights (safetensors), the
optimizer and LR-schedule state, every RNG state, the trainer state (step, data position, evaluations) and
the resolved config. It is written into a temporary directory and renamed into place; the last file written
is `COMPLETE`, which records the size and SHA-256 of every other file. A directory without a valid marker (a
process killed mid-write, a full disk, a file damaged later) is never loaded: `find_checkpoint` skips it with
a warning naming what was wrong and takes the newest complete one before it.

Weights and optimizer state are written as full (unsharded) state dicts through
`torch.distributed.checkpoint.state_dict`, so a checkpoint written by an FSDP2 run loads in a single process
and vice versa. Everything is loaded with safetensors or `torch.load(weights_only=True)`: no pickled code
runs on resume.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from grpo.errors import NO_ROOM, ConfigError, WriteError, os_reason, write_failure
from grpo.policy.weights import FULL, full_model_state, tied_names
from grpo.rundir import replace_dir, sha256_file

MARKER = "COMPLETE"
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json", "config.yaml")
REFERENCE = "reference.safetensors"  # with algo.ref_sync_every on a full model: the reference as it is now
# with rollout.max_staleness = k: the engine-format weights of the versions that sample the k batches in flight
# (`lagged_name(v)`), so that a resume samples them again exactly as the uninterrupted run did
LAGGED = "lagged-v{:08d}.safetensors"


def lagged_name(version: int) -> str:
    return LAGGED.format(version)


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


# ---------------------------------------------------------------------------------------------------------
# RNG states

def rng_states() -> dict:
    """Python, NumPy, torch (and CUDA) generator states. Rollout sampling needs none: each prompt's generator
    is seeded from the run seed and the prompt's position in the data stream (`sampling_seed`)."""
    np_state = np.random.get_state()
    states = {"python": random.getstate(), "torch": torch.get_rng_state(),
              "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]]}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(_tuples(states["python"]))
    torch.set_rng_state(states["torch"])
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------------------------------------------------
# writing

def save_checkpoint(run_dir: Path, step: int, *, model, optimizer, scheduler, rng: dict, state: dict,
                    config_yaml: str, keep_last: int, is_main: bool = True,
                    reference: dict[str, torch.Tensor] | None = None,
                    lagged: dict[int, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write the checkpoint of `step` atomically and keep only the newest `keep_last` complete ones. Every
    process calls it (gathering sharded state is collective); only the main process writes. `reference`: the
    weights of a reference that resets have moved, stored beside the model's. `lagged`: weights by version that
    asynchronous sampling still needs (`LAGGED`)."""
    weights = full_model_state(model)
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)
    root = checkpoint_root(run_dir)
    final = root / f"step-{step:08d}"
    if not is_main:
        return final
    try:
        _write(final, step, weights, optim, scheduler, rng, state, config_yaml, reference, lagged or {})
    except OSError as e:  # a full disk, a quota: nothing half-written stays, and the message says where to resume
        raise WriteError(f"could not write the checkpoint of step {step} into {root}: {os_reason(e)}; "
                         f"{resume_hint(run_dir, e)}") from None
    _prune(root, keep_last)
    return final


def resume_hint(run_dir: Path, error: BaseException | None = None) -> str:
    """Where a run stopped by a failed write can continue from: its newest intact checkpoint, if any."""
    fix = "make room" if getattr(error, "errno", errno.ENOSPC) in NO_ROOM else "fix that"
    for ckpt in sorted(checkpoint_root(run_dir).glob("step-*"), reverse=True):
        if verify(ckpt) is None:
            return f"the last good checkpoint is {ckpt}: {fix} and continue with train.resume=auto"
    return f"no checkpoint was complete yet: {fix} and run again with train.resume=auto, which starts the run over"


def _write(final: Path, step: int, weights, optim, scheduler, rng, state, config_yaml, reference=None,
           lagged: dict | None = None) -> None:
    """The checkpoint's files, each synced, the marker last, written beside `final` and renamed into it
    (`grpo.rundir.replace_dir`: a checkpoint of the same step, from a resumed run saving where it started, is
    replaced only once the new one is complete; a failed write leaves nothing behind)."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with replace_dir(final) as tmp:
        _save_tensors(weights, tmp / "model.safetensors")
        if reference is not None:
            _save_tensors({k: v.detach().contiguous() for k, v in reference.items()}, tmp / REFERENCE)
        lagged = lagged or {}
        for version, tensors in sorted(lagged.items()):
            _save_tensors({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp / lagged_name(version))
        _torch_save(optim, tmp / "optimizer.pt")
        _torch_save({"rng": rng, "scheduler": scheduler.state_dict()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.yaml").write_text(config_yaml)
        files = {}
        for name in FILES + ((REFERENCE,) if reference is not None else ()) + tuple(map(lagged_name, sorted(lagged))):
            _fsync(tmp / name)
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        (tmp / MARKER).write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync(tmp / MARKER)
        _fsync(tmp)
    _fsync(root)


def _save_tensors(tensors: dict, path: Path) -> None:
    try:
        save_file(tensors, str(path))
    except Exception as e:  # safetensors' SafetensorError: the reason is in its message
        failed = write_failure(e)
        if failed is None:
            raise
        raise OSError(failed.errno, failed.strerror, str(path)) from None


class _Writes:
    """A file torch.save writes through, keeping the OSError of a failed write (torch reports it as a
    RuntimeError without the reason: "unexpected pos 704 vs 598")."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        out = _Writes(f)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is None:
                raise
            raise OSError(out.error.errno, out.error.strerror, str(path)) from None


def _prune(root: Path, keep_last: int) -> None:
    complete = [p for p in sorted(root.glob("step-*")) if (p / MARKER).exists()]
    for old in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in [*root.glob(".tmp-step-*"), *root.glob(".old-step-*")]:  # left by processes that died while writing
        if not tmp.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------
# finding and reading

def verify(ckpt: Path) -> str | None:
    """None if `ckpt` is complete and intact, else what is wrong with it."""
    marker = ckpt / MARKER
    if not marker.is_file():
        return f"no {MARKER} marker (the write did not finish)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"unreadable {MARKER} marker"
    for name in sorted(set(FILES) | set(files)):
        p = ckpt / name
        if name not in files or not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != files[name]["bytes"] or sha256_file(p) != files[name]["sha256"]:
            return f"{name} does not match its recorded size and checksum"
    return None


def find_checkpoint(spec: str, run_dir: Path) -> Path | None:
    """`spec` "auto": the newest complete checkpoint of `run_dir`, or None if it has none. A path: that
    checkpoint (it must be complete), or the newest complete one of the run directory it names."""
    if spec != "auto":
        path = Path(spec)
        if (path / MARKER).exists() or path.name.startswith("step-"):
            problem = verify(path)
            if problem:
                raise ConfigError(f"train.resume={spec!r}: cannot resume from it: {problem}")
            return path
        if not path.is_dir():
            raise ConfigError(f"train.resume={spec!r} is neither 'auto' nor an existing checkpoint or run directory")
        run_dir = path
    for ckpt in sorted(checkpoint_root(run_dir).glob("step-*"), reverse=True):
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        warnings.warn(f"skipping checkpoint {ckpt}: {problem}", stacklevel=2)
    if spec != "auto":
        raise ConfigError(f"train.resume={spec!r}: no complete checkpoint in {checkpoint_root(run_dir)}")
    return None


def load_lagged(ckpt: Path, versions: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The lagged weights of `versions` that checkpoint `ckpt` holds (`save_checkpoint(lagged=...)`)."""
    missing = [v for v in versions if not (ckpt / lagged_name(v)).is_file()]
    if missing:
        raise ConfigError(f"checkpoint {ckpt} has no {lagged_name(missing[0])}: it was not written by a run with "
                          "this rollout.max_staleness")
    return {v: load_file(str(ckpt / lagged_name(v))) for v in versions}


def load_model_weights(ckpt: Path, model, *, which: str = "this model") -> None:
    """The checkpoint's model weights into `model` in place (its LoRA wrapping too, tied weights left out); a
    ConfigError when they do not fit it (`which` names the model in it)."""
    weights = load_file(str(ckpt / "model.safetensors"))
    expected = set(get_model_state_dict(model).keys())
    missing = sorted(expected - set(weights) - tied_names(model))
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise ConfigError(f"checkpoint {ckpt} does not fit {which} (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))


def load_checkpoint(ckpt: Path, *, model, optimizer, scheduler, reference: dict | None = None) -> dict:
    """Restore model, optimizer, LR schedule and RNG states in place; return the trainer state. `reference`: the
    reference's tensors by name, filled from the checkpoint's reference.safetensors (which must then exist)."""
    load_model_weights(ckpt, model)
    set_optimizer_state_dict(model, optimizer, torch.load(ckpt / "optimizer.pt", weights_only=True),
                             options=StateDictOptions(full_state_dict=True))
    if reference is not None:
        if not (ckpt / REFERENCE).is_file():
            raise ConfigError(f"checkpoint {ckpt} has no {REFERENCE}: it was written without algo.ref_sync_every")
        saved = load_file(str(ckpt / REFERENCE))
        with torch.no_grad():
            for name, t in reference.items():
                t.copy_(saved[name])
    extra = torch.load(ckpt / "rng.pt", weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    set_rng_states(extra["rng"])
    return json.loads((ckpt / "trainer_state.json").read_text())
