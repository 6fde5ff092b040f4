"""Data-parallel training with torchrun (gloo on CPU): one step on 2 processes equals one step on 1, on one launcher
or on two (two "machines" on 127.0.0.1); a directory another run holds, and a write the main process cannot make,
stop every process with one line."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.rundir import LOCK_FILE, RunLock

FAST = ["rollout.group_size=4", "train.prompts_per_step=4", "rollout.max_new_tokens=5", "eval.size=8",
        "eval.pass_k=2", "log.progress=false", "log.trackers=[]", "log.chart=false", "train.lr=1e-3",
        "log.samples_every=1", "compute.micro_batch_size=3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
DEFAULT_JOB = str(Path(__file__).resolve().parents[2] / "grpo" / "configs" / "tiny.yaml")  # what `grpo train` reads


def grpo_train(out, model_dir, *extra, nproc=1, own_process=False):
    """`grpo train` of the default job: under torchrun with nproc > 1, else in this process on one thread (in a
    process of its own with own_process)."""
    overrides = [f"model.path={model_dir}", f"train.output_dir={out}", *FAST, *extra]
    if nproc == 1 and not own_process:
        from grpo import load_config, train
        train(load_config(DEFAULT_JOB, [*overrides, "compute.threads=1"]))
        return
    args = ["-m", "grpo", "train", *overrides]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    else:
        args.append("compute.threads=1")
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]


def metrics(out):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def assert_same(a, b, atol=1e-6):
    wa, wb = load_file(Path(a) / "model" / "model.safetensors"), load_file(Path(b) / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=atol, rtol=0), (k, (wa[k] - wb[k]).abs().max())
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    for ra, rb in zip(ma, mb):
        assert ra.keys() == rb.keys()
        for k in ra:
            if isinstance(ra[k], float):
                assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), k
            else:
                assert ra[k] == rb[k], k


# FSDP2's training pass runs every row in full, so the runs compared with it keep prompt sharing off, for the
# reference too
FULL = "compute.share_prompt=false"


@pytest.fixture(scope="module")
def one_step(random_model_dir, tmp_path_factory):
    """One process, one step without prompt sharing, evaluated after it: the run that FSDP2 (with and without
    torchrun) and the library under torchrun are each compared with."""
    out = tmp_path_factory.mktemp("distributed") / "one_step"
    grpo_train(out, random_model_dir, "train.steps=1", "eval.every=1", FULL)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("extra", [
    # beta > 0, mu > 1, seq_mean, two mini-batches of whole groups (one group of each process in each), under a
    # reward with a signal: the random model's answers all score 0 under the default reward, and an update with no
    # advantage is rounding noise (its KL gradient is 0 at the first update), which AdamW scales up to about lr/10
    # in a pattern that depends on the order of the sums, as test_trainer's micro-batch cases say
    ["algo.preset=grpo", "algo.dynamic_sampling=false", "algo.num_iterations=2", "train.steps_per_generation=2",
     "rewards=[tests.integration.rewards:odd_length]"],
    # step-wide token mean, batch std, dynamic sampling under a reward that leaves some groups without signal
    ["algo.preset=dapo", "algo.scale=batch", "rewards=[tests.integration.rewards:starts_below_digits]"],
])
def test_two_processes_equal_one(tmp_path, random_model_dir, extra):
    steps = "train.steps=2" if "algo.preset=dapo" in extra else "train.steps=1"
    grpo_train(tmp_path / "one", random_model_dir, steps, *extra)
    grpo_train(tmp_path / "two", random_model_dir, steps, *extra, nproc=2)
    assert_same(tmp_path / "one", tmp_path / "two")
    samples = (tmp_path / "two" / "samples.jsonl").read_text().splitlines()
    assert len(samples) == int(steps[-1]) * 2 * 4  # rank 0 writes its own groups only, once a step
    if "algo.preset=dapo" in extra:  # groups were dropped and replaced, identically on one and two processes
        assert sum(r["sampling/groups_dropped"] for r in metrics(tmp_path / "two")[1:]) > 0


@pytest.mark.distributed
def test_fsdp2_equals_one_process_and_its_checkpoint_loads_in_one(tmp_path, random_model_dir, one_step):
    # rewards are all zero on a random model, so the first step's gradient is the KL term's alone: exactly zero
    # where the reference and policy log-probs agree bit for bit, and rounding noise that AdamW magnifies to
    # lr-sized steps where they do not: hence prompt sharing off in every run compared
    grpo_train(tmp_path / "one", random_model_dir, "train.steps=2", "eval.every=1", FULL)
    grpo_train(tmp_path / "fsdp", random_model_dir, "train.steps=1", "compute.sharding=fsdp", "train.save_every=1",
               "eval.every=1", FULL, nproc=2)
    ckpt = tmp_path / "fsdp" / "checkpoints" / "step-00000001"
    assert (ckpt / "COMPLETE").exists()
    # the sharded run's final weights equal one process's after the same step
    assert_same(one_step, tmp_path / "fsdp", atol=1e-5)
    # ... and its checkpoint resumes in a single process, ending where the single-process run ends
    grpo_train(tmp_path / "fsdp", random_model_dir, "train.steps=2", "train.resume=auto", "eval.every=1", FULL)
    assert_same(tmp_path / "one", tmp_path / "fsdp", atol=1e-5)


def test_fsdp2_in_one_process_without_torchrun(tmp_path, random_model_dir, one_step):
    # plain `grpo train compute.sharding=fsdp`: a process group of one is made for FSDP2 (it needs one)
    grpo_train(tmp_path / "fsdp", random_model_dir, "train.steps=1", "eval.every=1", FULL, "compute.sharding=fsdp",
               own_process=True)
    assert_same(one_step, tmp_path / "fsdp", atol=1e-5)


@pytest.mark.distributed
def test_fsdp2_packed_equals_one_process_unpacked(tmp_path, random_model_dir):
    # compute.packing under FSDP2 on two processes: transformers' full-logits path over one packed row per
    # micro-batch (position ids restarting at each sequence) gives the unpacked run's figures and weights, in an
    # update with a signal (the reference, the old log-probs at mu = 2, two mini-batches)
    from grpo.config import ModelConfig
    from grpo.models import load_model
    from grpo.policy import forward_path
    model, _ = load_model(ModelConfig(path=str(random_model_dir)))
    assert forward_path(model, sharded=True, share_prompt=True, lean=True, packing=True).packing
    extra = ["train.steps=1", FULL, "algo.dynamic_sampling=false", "algo.num_iterations=2",
             "train.steps_per_generation=2", "rewards=[tests.integration.rewards:odd_length]"]
    grpo_train(tmp_path / "one", random_model_dir, *extra)
    grpo_train(tmp_path / "fsdp", random_model_dir, *extra, "compute.sharding=fsdp", "compute.packing=true", nproc=2)
    assert metrics(tmp_path / "one")[1]["grad_norm"] > 0  # an update that trains
    assert_same(tmp_path / "one", tmp_path / "fsdp", atol=1e-5)


@pytest.mark.distributed
def test_a_checkpoint_the_main_process_cannot_write_stops_every_process(tmp_path, random_model_dir):
    import resource

    limit = 32 * 1024  # the config and metrics fit, the checkpoint's weights do not
    out = tmp_path / "two"
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "grpo", "train",
            f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST, "train.steps=2", "train.save_every=1"]
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=ENV,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert r.returncode != 0  # and it did not hang: rank 1 was told instead of waiting for rank 0
    assert r.stderr.count("grpo: error: could not write the checkpoint of step 1") == 2, r.stderr[-3000:]


SCRIPT = """
import sys
from grpo import load_config, train

result = train(load_config(sys.argv[1], sys.argv[2:]))
print(f"steps done: {result.steps_done}")
"""


@pytest.mark.distributed
def test_the_library_under_torchrun_is_one_run_on_every_process(tmp_path, random_model_dir, one_step):
    # a script calling grpo.train(cfg), without a dist, launched with torchrun: one run of two processes, as
    # `grpo train` is, not two one-process runs racing on one directory
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), DEFAULT_JOB, f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST,
                        "train.steps=1", "eval.every=1", FULL], capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("steps done: 1") == 2  # both processes return the run's result
    assert r.stdout.count("held-out accuracy") == 2, r.stdout  # the main process alone reports (steps 0 and 1)
    assert_same(one_step, out)


@pytest.mark.distributed
def test_two_launchers_as_two_machines_equal_one_process(tmp_path, random_model_dir, one_step):
    # torchrun --nnodes=2 twice on this machine (one process each), as on two machines (docs/distributed.md)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two"
    launchers = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={n}",
                                   "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
                                   "-m", "grpo", "train", f"model.path={random_model_dir}", f"train.output_dir={out}",
                                   *FAST, "train.steps=1", "eval.every=1", FULL],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
                 for n in (0, 1)]
    for n, launcher in enumerate(launchers):
        output = launcher.communicate(timeout=600)[0]
        assert launcher.returncode == 0, (n, output[-3000:])
    assert_same(one_step, out)


@pytest.mark.distributed
def test_a_directory_another_run_holds_is_refused_by_every_process(tmp_path, random_model_dir):
    out = tmp_path / "two"
    with RunLock(out):  # another run (this process) holds it
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "-m", "grpo", "train", f"model.path={random_model_dir}", f"train.output_dir={out}",
                            *FAST, "train.steps=1"], capture_output=True, text=True, timeout=300, env=ENV)
        assert os.listdir(out) == [LOCK_FILE]  # nothing was written
    assert r.returncode != 0  # and no process waited for the others: rank 0 told rank 1
    assert r.stderr.count(f"grpo: error: train.output_dir='{out}' is in use by another run (pid {os.getpid()} "
                          ) == 2, r.stderr[-3000:]


# the main process (rank 0) finds the disk full when it writes the metrics of step 1
LOG_FULL = r"""
import errno, os, sys
import grpo.runlog as runlog
real = runlog._append
def full(f, text):
    if os.environ["RANK"] == "0" and f.name.endswith("metrics.jsonl") and text.startswith('{"step": 1,'):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
    return real(f, text)
runlog._append = full
from grpo.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
def test_a_run_log_the_main_process_cannot_write_stops_every_process(tmp_path, random_model_dir):
    script, out = tmp_path / "full.py", tmp_path / "two"
    script.write_text(LOG_FULL)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script), "train", f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST,
                        "train.steps=3", "eval.every=0"], capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode != 0  # and it did not hang: rank 1 was told instead of waiting for rank 0
    line = (f"grpo: error: could not write {out / 'metrics.jsonl'}: No space left on device; no checkpoint was "
            "complete yet: make room and run again with train.resume=auto, which starts the run over\n")
    assert r.stderr.count(line) == 2 and "trainer.py" not in r.stderr, r.stderr[-3000:]  # no worker's traceback
    assert os.listdir(out) == []  # failed before its first step was logged: nothing left, its lock file neither
