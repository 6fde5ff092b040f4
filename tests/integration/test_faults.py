"""kill -9 in each phase of a run (sampling, rewards, the update, evaluation, logging, a checkpoint write, the
final save), and again and again in one run (at start-up after a resume, in a checkpoint's weights, while old
checkpoints are deleted), and in the phases new with a vLLM engine (its sampling, its weight sync) and with tools
(between the turns of multi-turn episodes): `train.resume=auto` always reads what the killed runs left and ends in
the state of a run that was never killed, bit for bit (metrics, samples, weights). Each killed run is a process of
its own; the uninterrupted run and the resume that finishes run in this one. And one run per directory: a second
run into a live run's directory is refused; once that run is killed, the next one takes the directory over."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import grpo.trainer as trainer
from grpo.checkpoint import find_checkpoint
from grpo.cli import DEFAULT_JOB
from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.rundir import LOCK_FILE
from test_resume import FAST, assert_same_run, cfg_for, rows

# The runner counts the steps the trainer has begun (its calls of `collect`) and SIGKILLs itself inside the named
# phase of the given step, at the given call of that phase; a file write is killed half-way through its file.
RUNNER = r"""
import os, signal, sys
from pathlib import Path

phase, at_step, at_call = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
state = {"step": 0, "calls": 0}

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def inject(owner, name, *, half_write=None):
    real = getattr(owner, name)
    def wrapper(*args, **kwargs):
        if state["step"] == at_step:
            state["calls"] += 1
            if state["calls"] == at_call:
                if half_write:
                    half_write(*args)
                    die()
                out = real(*args, **kwargs)  # the phase's work is done, its result never used
                die()
        return real(*args, **kwargs)
    setattr(owner, name, wrapper)

import grpo.trainer as trainer
real_collect = trainer.collect
def counting(*args, **kwargs):
    state["step"] += 1
    return real_collect(*args, **kwargs)
trainer.collect = counting

if phase == "sampling":
    import grpo.rollout.hf as hf
    inject(hf.HFGenerator, "generate")
elif phase == "rewards":
    import grpo.collect as collect
    inject(collect, "score")
elif phase == "update":  # between the μ = 2 optimiser steps of a batch
    import torch
    inject(torch.optim.AdamW, "step")
elif phase == "evaluation":
    inject(trainer, "evaluate")
elif phase == "logging":  # half a line of samples.jsonl or metrics.jsonl
    import grpo.runlog as runlog
    def half(f, text):
        f.write(text[: len(text) // 2])
        f.flush()
    inject(runlog, "_append", half_write=half)
elif phase == "checkpoint":  # model.safetensors written, optimizer.pt half-way
    import grpo.checkpoint as checkpoint
    inject(checkpoint, "_torch_save", half_write=lambda obj, path: Path(path).write_bytes(b"PK\x03\x04 torn"))
elif phase == "final_save":  # the weights written, the tokenizer half-way
    from transformers import PreTrainedTokenizerBase
    inject(PreTrainedTokenizerBase, "save_pretrained",
           half_write=lambda self, d, *a: (Path(d) / "tokenizer.json").write_text('{"version"'))
elif phase == "checkpoint_weights":  # a checkpoint's model.safetensors half-way
    import grpo.checkpoint as checkpoint
    inject(checkpoint, "_save_tensors", half_write=lambda tensors, path: Path(path).write_bytes(b"torn"))
elif phase == "resumed_start":  # a resumed run at start-up (step 0: before its first step), its logs cut back
    import grpo.runlog as runlog
    inject(runlog, "_truncate")
elif phase == "vllm_sampling":  # the vLLM engine sampling the step's completions
    from grpo.rollout.vllm_colocate import VLLMGenerator
    inject(VLLMGenerator, "generate")
elif phase == "vllm_sync":  # the step's new weights just loaded into the engine, not yet logged or saved
    from grpo.rollout.vllm_colocate import VLLMGenerator
    inject(VLLMGenerator, "sync_weights")
elif phase == "tool_call":  # multi-turn episodes half-way: a turn's calculator calls run, the next turn not sampled
    import grpo.envs.tools as tools
    inject(tools, "call_tools")
elif phase == "prune":  # deleting the checkpoints beyond train.keep_last: the oldest half-way (its weights gone)
    import grpo.checkpoint as checkpoint
    inject(checkpoint, "_prune",
           half_write=lambda root, keep: (sorted(Path(root).glob("step-*"))[0] / "model.safetensors").unlink())
else:
    raise SystemExit(f"unknown phase {phase}")

from grpo.cli import main
sys.exit(main(sys.argv[4:]))
"""

RUN = ["train.steps=4", "train.save_every=2", "train.keep_last=2", "eval.every=2", "algo.num_iterations=2"]

# phase, the step in which to kill (1-based; 4 is the last), the call of the phase within that step
CASES = [
    ("sampling", 3, 1),
    ("rewards", 3, 1),
    ("update", 3, 2),
    ("evaluation", 4, 1),
    ("logging", 3, 1),
    ("checkpoint", 2, 1),   # the first checkpoint: none is complete, so the run starts over
    ("checkpoint", 4, 1),   # the last one: the run continues from step 2
    ("final_save", 4, 1),   # every step done and checkpointed: only the final save is left
]


def grpo_train(model_dir, out, *extra, job=None):
    return ["train", *([job] if job else []), f"model.path={model_dir}", f"train.output_dir={out}", *FAST, *RUN,
            *extra]


@pytest.fixture(scope="module")
def straight(random_model_dir, tmp_path_factory):
    return straight_here(tmp_path_factory, random_model_dir)


def kill(tmp_path, model_dir, out, phase, step, call, *extra, job=None):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    killed = subprocess.run([sys.executable, str(script), phase, str(step), str(call),
                             *grpo_train(model_dir, out, *extra, job=job)], capture_output=True, text=True,
                            timeout=600)
    assert killed.returncode == -9, killed.stderr  # it died where it was meant to, not later


def resume(grpo_cli, model_dir, out, *extra, job=None):
    """train.resume=auto to the end, in this process."""
    resumed = grpo_cli(*grpo_train(model_dir, out, *extra, "train.resume=auto", job=job))
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("phase, step, call", CASES, ids=[f"{p}-step{s}" for p, s, _ in CASES])
def test_kill_9_in_each_phase_resumes_to_the_same_end_state(phase, step, call, straight, random_model_dir, tmp_path,
                                                            grpo_cli):
    out = tmp_path / "killed"
    kill(tmp_path, random_model_dir, out, phase, step, call)
    assert not (out / "model").exists()  # never a half-written final model
    # what the kill left is there for the resume to cope with
    if phase == "logging":  # a torn line
        assert any(not f.read_text().endswith("\n") for f in (out / "metrics.jsonl", out / "samples.jsonl"))
    if phase == "checkpoint":  # a half-written checkpoint beside the complete ones
        assert [p.name[:18] for p in (out / "checkpoints").glob(".tmp-*")] == [f".tmp-step-{step:08d}"]
    if phase == "final_save":  # a half-written model beside its place
        assert len(list(out.glob(".tmp-model-*"))) == 1 and (out / "checkpoints" / "step-00000004").is_dir()
    resume(grpo_cli, random_model_dir, out)
    assert_same_run(straight, out)
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3, 4]
    assert not list(out.rglob(".tmp-*")) and not list(out.rglob(".old-*"))  # nothing left behind


@pytest.mark.slow
def test_killed_again_and_again_it_resumes_to_the_same_end_state(straight, random_model_dir, tmp_path, grpo_cli):
    """One run directory, a checkpoint every step (keep_last=2), killed three times: a fresh run, then two resumed
    ones, each where the phases above do not reach; then resumed to the end."""
    out, every_step = tmp_path / "killed", ["train.save_every=1", "train.resume=auto"]
    ckpts = lambda: sorted(p.name for p in (out / "checkpoints").iterdir())  # noqa: E731
    # a fresh run: step 1 checkpointed, then killed half-way through the weights of the step-2 checkpoint
    kill(tmp_path, random_model_dir, out, "checkpoint_weights", 2, 1, *every_step)
    assert [p[:18] for p in ckpts()] == [".tmp-step-00000002", "step-00000001"]
    assert [r["step"] for r in rows(out)] == [0, 1, 2]
    # resumed from step 1, killed at start-up once it has cut its logs back to step 1
    kill(tmp_path, random_model_dir, out, "resumed_start", 0, 2, *every_step)
    assert [r["step"] for r in rows(out)] == [0, 1]
    # resumed from step 1 again: steps 2 and 3 checkpointed, killed while it deletes step 1's (keep_last=2)
    kill(tmp_path, random_model_dir, out, "prune", 2, 1, *every_step)
    assert ckpts() == ["step-00000001", "step-00000002", "step-00000003"]
    assert not (out / "checkpoints" / "step-00000001" / "model.safetensors").exists()
    resume(grpo_cli, random_model_dir, out, *every_step)
    assert_same_run(straight, out)
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3, 4]
    assert ckpts() == ["step-00000003", "step-00000004"]  # the half-deleted one went with step 2's
    assert not list(out.rglob(".tmp-*")) and not list(out.rglob(".old-*"))  # nothing left behind


def test_a_live_runs_directory_is_refused_and_a_killed_runs_is_taken_over(random_model_dir, tmp_path, grpo_cli):
    out, err = tmp_path / "run", tmp_path / "first.err"
    with err.open("w") as f:
        first = subprocess.Popen([sys.executable, "-m", "grpo", *grpo_train(
            random_model_dir, out, "train.steps=1000", "train.save_every=1", "eval.every=0")], stdout=f, stderr=f)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step-00000001" / "COMPLETE").exists():
            assert first.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        (out / "notes.txt").write_text("mine")
        # a second run into it, new, replacing it or resuming it, from the CLI or the library, is refused at once
        line = (f"grpo: error: train.output_dir='{out}' is in use by another run (pid {first.pid} on host "
                f"{socket.gethostname()}, started ")
        for how in ([], ["train.overwrite=true"], ["train.resume=auto"]):
            second = grpo_cli(*grpo_train(random_model_dir, out, "train.steps=2", *how))
            assert second.returncode == 2 and second.stderr.startswith(line), (how, second.stderr)
            assert second.stderr.count("\n") == 1 and second.stdout == ""
        third = subprocess.run([sys.executable, "-m", "grpo", *grpo_train(random_model_dir, out,
                                                                          "train.overwrite=true")],
                               capture_output=True, text=True, timeout=300)  # a process of its own too
        assert third.returncode == 2 and third.stderr.startswith(line) and third.stderr.count("\n") == 1, third.stderr
        with pytest.raises(ConfigError, match="is in use by another run"):
            trainer.train(cfg_for(random_model_dir, out, "train.steps=2", "train.overwrite=true"))
        # ... and touched nothing: the live run's files are there and it goes on
        assert [r["step"] for r in rows(out)][:2] == [0, 1] and (out / "notes.txt").read_text() == "mine"
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # killed, it left its lock file; the next run takes the directory over and continues the run
    assert f'"pid": {first.pid}' in (out / LOCK_FILE).read_text()
    step = int(find_checkpoint("auto", out).name[5:])
    with pytest.warns(UserWarning, match=f"took over the lock of train.output_dir='{out}' from a run that ended "
                                         f"without releasing it \\(pid {first.pid} on host "):
        resumed = grpo_cli(*grpo_train(random_model_dir, out, f"train.steps={step + 1}", "train.save_every=1",
                                       "eval.every=0", "train.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert rows(out)[-1]["step"] == step + 1 and (out / "model").is_dir()
    assert LOCK_FILE not in os.listdir(out)  # removed as the run ended


# other backends: only the phases that are new with them are killed (the rest is the code the cases above kill),
# in 2 steps, checkpointed after each, with one small evaluation before the first and after the last; the
# uninterrupted run and the resumes run in this process
SHORT = ["train.steps=2", "train.save_every=1", "eval.every=0", "eval.size=2", "eval.pass_k=0",
         "algo.num_iterations=1"]
# the bundled model, whose answers (in up to 32 tokens) are sometimes right: the weights move from the first step
VLLM = ["rollout.backend=vllm", "vllm.kv_cache_gib=0.25", "algo.dynamic_sampling=false", "rollout.max_new_tokens=32",
        *SHORT]
TOOLS = ["rollout.max_new_tokens=48", *SHORT]  # room for a call
TOOL_JOB = str(Path(__file__).resolve().parents[2] / "grpo" / "configs" / "tiny_tools.yaml")


def straight_here(tmp_path_factory, model, *extra, job=None):
    """The uninterrupted run, as `grpo train` runs it, in this process."""
    out = tmp_path_factory.mktemp("faults") / "straight"
    _, *overrides = grpo_train(model, out, *extra, job=job)
    trainer.train(load_config(job or DEFAULT_JOB, overrides[1:] if job else overrides))
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vllm_run_killed_while_sampling_then_while_syncing_weights_resumes_to_the_same_end_state(
        tmp_path, tmp_path_factory, grpo_cli):
    pytest.importorskip("vllm", reason="the vLLM backend's tests need vLLM: pip install -e '.[vllm]'")
    straight = straight_here(tmp_path_factory, "tiny", *VLLM)
    out = tmp_path / "killed"
    # a fresh run, killed while the engine samples step 2 (step 1 checkpointed)
    kill(tmp_path, "tiny", out, "vllm_sampling", 2, 1, *VLLM)
    assert [r["step"] for r in rows(out)] == [0, 1]
    # resumed from step 1 (the engine takes the checkpoint's weights), killed once step 2's weights reached the
    # engine
    kill(tmp_path, "tiny", out, "vllm_sync", 1, 1, *VLLM, "train.resume=auto")
    assert [r["step"] for r in rows(out)] == [0, 1]
    resume(grpo_cli, "tiny", out, *VLLM)
    assert_same_run(straight, out)
    assert rows(straight)[2]["kl"] > 0 and all(r["mismatch/abs_diff_max"] < 1e-3 for r in rows(out)[1:])


@pytest.mark.slow
def test_a_tool_run_killed_between_the_turns_of_its_episodes_resumes_to_the_same_end_state(tmp_path,
                                                                                           tmp_path_factory, grpo_cli):
    straight = straight_here(tmp_path_factory, "tiny-tools", *TOOLS, job=TOOL_JOB)
    out = tmp_path / "killed"
    kill(tmp_path, "tiny-tools", out, "tool_call", 2, 1, *TOOLS, job=TOOL_JOB)  # step 1 checkpointed
    assert [r["step"] for r in rows(out)] == [0, 1]
    resume(grpo_cli, "tiny-tools", out, *TOOLS, job=TOOL_JOB)
    assert_same_run(straight, out)
    assert rows(out)[2]["episode/tool_calls"] > 0  # the step killed had calls, and ran them again alike
