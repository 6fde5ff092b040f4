"""Asynchronous rollouts end to end (rollout.max_staleness = k, grpo/ahead.py) on the bundled tiny model with the
colocated vLLM engine: a fixed-lag run is a function of its seed and k, so a run killed with -9 in the lane's
sampling, in an update and in a checkpoint write, resumed each time, and a two-process run, all equal the
uninterrupted one-process run figure for figure; the rows carry the staleness the schedule says; bad input is
one line and exit status 2. (A server lost with batches in flight: test_vllm_server.)"""
import os
import shutil
import signal  # noqa: F401 - used by the runner's text
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import load_config  # noqa: F401
from test_vllm_train import QUIET, _rows, _same

pytest.importorskip("vllm", reason="the vLLM backend's tests need vLLM: pip install -e '.[vllm]'")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# the default job (dynamic sampling on) shortened, k = 2 with μ = 2 updates per batch, a checkpoint every step
ASYNC = ["grpo/configs/tiny.yaml", "train.steps=6", "train.save_every=1", "train.keep_last=2",
         "train.prompts_per_step=8", "eval.size=50", "eval.every=3", "eval.pass_k=2", "compute.threads=1",
         "algo.num_iterations=2", "rollout.max_staleness=2", *QUIET]

# SIGKILLs itself at the n-th call of the phase's function in this process (a file write half-way through)
RUNNER = r"""
import os, signal, sys
from pathlib import Path

phase, at = sys.argv[1], int(sys.argv[2])
calls = [0]

def inject(owner, name, half_write=None):
    real = getattr(owner, name)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            if half_write:
                half_write(*args)
            else:
                real(*args, **kwargs)  # the work done, its result never used
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    setattr(owner, name, wrapper)

if phase == "sampling":  # the lane's engine sampling (evaluations sample too: any call of generate)
    from grpo.rollout.vllm_colocate import VLLMGenerator
    inject(VLLMGenerator, "generate")
elif phase == "update":  # between the μ = 2 optimiser steps of a batch
    import torch
    inject(torch.optim.AdamW, "step")
elif phase == "checkpoint":  # a checkpoint's tensors half-way (its second file: the weights of a batch in flight)
    import grpo.checkpoint as checkpoint
    inject(checkpoint, "_save_tensors", half_write=lambda tensors, path: Path(path).write_bytes(b"torn"))
else:
    raise SystemExit(f"unknown phase {phase}")

from grpo.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _train_args(out, *extra):
    return ["train", *ASYNC, f"train.output_dir={out}", *extra]


@pytest.fixture(scope="module")
def straight(finished_run):
    return finished_run("async-k2", *ASYNC)


def test_the_rows_carry_the_staleness_of_the_schedule_and_the_run_learns(straight):
    rows = _rows(straight)
    # batch s comes from the weights of step max(0, s - 3): η = min(2, s - 1) versions behind
    assert [r["staleness/max"] for r in rows[1:]] == [0, 1, 2, 2, 2, 2]
    assert [r["staleness/mean"] for r in rows[1:]] == [0, 1, 2, 2, 2, 2]
    # the sampler weight carries the lag: it moves away from 1 once batches are stale, and stays finite
    assert rows[1]["mismatch/abs_diff_max"] < 1e-3 and rows[3]["mismatch/abs_diff"] > rows[1]["mismatch/abs_diff"]
    assert all(0 <= r["perf/engine_wait_seconds"] and 0 <= r["perf/rollout_seconds"] for r in rows[1:])
    assert rows[-1]["eval/accuracy"] > rows[0]["eval/accuracy"]
    # a checkpoint holds the weights of the batches in flight: after step 6, those of batches 7 and 8 (versions 4, 5)
    last = straight / "checkpoints" / "step-00000006"
    assert sorted(p.name for p in last.glob("lagged-*")) == ["lagged-v00000004.safetensors",
                                                            "lagged-v00000005.safetensors"]


@pytest.mark.slow
def test_killed_in_sampling_in_an_update_and_in_a_checkpoint_write_it_resumes_to_the_same_run(straight, tmp_path,
                                                                                            grpo_cli):
    out, script = tmp_path / "killed", tmp_path / "runner.py"
    script.write_text(RUNNER)

    def kill(phase, at, *extra):
        r = subprocess.run([sys.executable, str(script), phase, str(at), *_train_args(out, *extra)],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == -9, r.stderr[-3000:]  # it died where it was meant to
        return sorted(p.name for p in (out / "checkpoints").glob("step-*")) if (out / "checkpoints").exists() else []

    kill("sampling", 8)  # the engine sampling a batch on the lane, steps ahead of the trainer
    kill("update", 3, "train.resume=auto")  # the second step of this process, between its two updates
    kill("checkpoint", 2, "train.resume=auto")  # this process's first checkpoint: its lagged weights torn
    assert list((out / "checkpoints").glob(".tmp-*"))  # the torn checkpoint is there for the resume to cope with
    resumed = grpo_cli(*_train_args(out, "train.resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same(_rows(straight), _rows(out))
    assert "asynchronous (rollout.max_staleness) run: of " in resumed.stdout  # the idle summary
    assert (straight / "samples.jsonl").read_text() == (out / "samples.jsonl").read_text()
    assert not list(out.rglob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_equal_one(straight, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "grpo", *_train_args(tmp_path)], capture_output=True, text=True, env=env, timeout=900,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    # the same batches from the same weights: every reward, choice of dynamic sampling, staleness and evaluation
    # figure equal; the update's figures up to the order in which two processes' sums are added (their forward
    # passes see half the rows each: float32 rounding, relative differences of 1e-5 at most here)
    one, two = _rows(straight), _rows(tmp_path)
    assert [sorted(k for k in r if not k.startswith("perf/")) for r in one] == \
        [sorted(k for k in r if not k.startswith("perf/")) for r in two]
    for x, y in zip(one, two):
        for k, v in x.items():
            if k.startswith(("reward/", "sampling/", "staleness/", "eval/", "adv/", "step")):
                assert v == y[k] or (v != v and y[k] != y[k]), (x["step"], k, v, y[k])
            elif not k.startswith("perf/"):
                assert y[k] == pytest.approx(v, rel=1e-4, abs=1e-7, nan_ok=True), (x["step"], k, v, y[k])


def test_a_resume_that_changes_k_is_refused(straight, tmp_path, grpo_cli):
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    r = grpo_cli(*_train_args(out, "train.resume=auto", "rollout.max_staleness=1", "train.steps=8"))
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "rollout.max_staleness" in last and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, says", [
    (["rollout.backend=hf", "rollout.max_staleness=1"],
     "rollout.max_staleness=1 samples ahead of the trainer, and rollout.backend=hf samples from the very model"),
    (["rollout.backend=vllm", "rollout.max_staleness=4", "train.steps=4"],
     "rollout.max_staleness=4 must be less than train.steps=4"),
    (["rollout.backend=vllm", "rollout.staleness_mode=newest"], "rollout.staleness_mode"),
])
def test_bad_asynchronous_settings_are_one_line_and_exit_2(args, says, tmp_path, grpo_cli):
    r = grpo_cli("train", f"train.output_dir={tmp_path / 'run'}", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert says in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("job, extra", [("grpo/configs/tiny_process.yaml", []), ("grpo/configs/tiny_tools.yaml", []),
                                        ("grpo/configs/tiny.yaml", ["lora.rank=8"])], ids=["process", "tools", "lora"])
def test_process_rewards_tools_and_lora_run_one_step_off(job, extra, tmp_path, grpo_cli):
    r = grpo_cli("train", job, *extra, *QUIET, "train.steps=3", "train.prompts_per_step=8", "eval.size=10",
                 "eval.every=0", "eval.pass_k=0", "compute.threads=1", "rollout.max_staleness=1",
                 f"train.output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [x["staleness/max"] for x in rows[1:]] == [0, 1, 1]
    # the engine took the policy's weights (LoRA merged) from the copies the lane hands it: on the fresh batch its
    # log-probs agree with the trainer's to float32 rounding
    assert rows[1]["mismatch/abs_diff_max"] < 1e-3
    if "tools" in job:
        assert sum(x["episode/tool_calls"] for x in rows[1:]) > 0
    if "process" in job:
        assert all("reward/arithmetic_steps" in x and x["adv/std_zero_frac"] < 1 for x in rows[1:])  # step rewards
