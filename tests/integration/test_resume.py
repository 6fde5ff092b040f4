"""Checkpoints: exact resume, torn checkpoints, SIGTERM and SIGINT, NaN steps, full disks, config checks (SIGKILL:
test_faults.py)."""
import contextlib
import errno
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpo.trainer as trainer
from grpo.checkpoint import MARKER, checkpoint_root, find_checkpoint
from grpo.config import load_config
from grpo.errors import ConfigError, GRPOError

FAST = ["rollout.group_size=4", "train.prompts_per_step=3", "rollout.max_new_tokens=5", "eval.size=8",
        "eval.pass_k=2", "log.progress=false", "log.trackers=[]", "log.chart=false", "train.lr=1e-3",
        "log.samples_every=1", "compute.threads=2"]


def cfg_for(model_dir, out, *extra):
    return load_config(None, [f"model.path={model_dir}", f"train.output_dir={out}", *FAST, *extra])


def rows(out, drop_perf=True):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not (drop_perf and k.startswith("perf/"))} for x in lines]


def weights(out):
    return load_file(Path(out) / "model" / "model.safetensors")


def assert_same_run(a, b):
    assert rows(a) == rows(b)
    assert (Path(a) / "samples.jsonl").read_text() == (Path(b) / "samples.jsonl").read_text()
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # bit for bit


def test_resume_is_bit_for_bit(tmp_path, random_model_dir):
    k = 3
    # the adaptive entropy coefficient (SPEC 14.7) is state a resume must carry: under a target above any entropy
    # it grows by Δ every optimiser step
    # it grows by Δ every optimiser step. Each step's 3 groups make 3 mini-batches (SPEC 14.8), replayed twice
    common = ["algo.num_iterations=2", "algo.beta=0.04", f"eval.every={k}", "optim.lr_schedule=constant",
              "algo.use_adaptive_entropy=true", "algo.entropy_coef=0.01", "algo.entropy_target=100",
              "train.steps_per_generation=3"]
    trainer.train(cfg_for(random_model_dir, tmp_path / "straight", f"train.steps={2 * k}", *common))
    trainer.train(cfg_for(random_model_dir, tmp_path / "split", f"train.steps={k}", f"train.save_every={k}",
                          *common))
    result = trainer.train(cfg_for(random_model_dir, tmp_path / "split", f"train.steps={2 * k}",
                                   "train.resume=auto", *common))
    assert result.resumed_from.name == f"step-{k:08d}"
    assert_same_run(tmp_path / "straight", tmp_path / "split")
    coefs = [r["entropy/coef"] for r in rows(tmp_path / "straight")[1:]]  # the mean of each step's six updates
    # update n applies 0.01 + 0.005·(n − 1), except the very first (H_0 = +∞): 0
    expect = [sum(0.01 + 0.005 * (6 * s + j) for j in range(6)) / 6 for s in range(2 * k)]
    expect[0] -= 0.01 / 6
    assert coefs == pytest.approx(expect)


def test_resume_is_bit_for_bit_with_dynamic_sampling(tmp_path, random_model_dir):
    # a reward under which some groups of the random model are uninformative, so steps draw extra rounds
    common = ["algo.preset=dapo", "rewards=[tests.integration.rewards:starts_below_digits]", "eval.every=2",
              "algo.max_sampling_rounds=3"]
    trainer.train(cfg_for(random_model_dir, tmp_path / "straight", "train.steps=4", *common))
    trainer.train(cfg_for(random_model_dir, tmp_path / "split", "train.steps=2", "train.save_every=2", *common))
    trainer.train(cfg_for(random_model_dir, tmp_path / "split", "train.steps=4", "train.resume=auto", *common))
    assert_same_run(tmp_path / "straight", tmp_path / "split")
    logged = rows(tmp_path / "straight")[1:]
    assert sum(r["sampling/groups_dropped"] for r in logged) > 0  # dynamic sampling did replace groups
    assert all(r["sampling/prompts_drawn"] == 3 * r["sampling/rounds"] for r in logged)


def test_keep_last_and_torn_checkpoints_are_skipped(tmp_path, random_model_dir):
    out = tmp_path / "run"
    trainer.train(cfg_for(random_model_dir, out, "train.steps=4", "train.save_every=1", "train.keep_last=3"))
    ckpts = sorted(p.name for p in checkpoint_root(out).iterdir())
    assert ckpts == ["step-00000002", "step-00000003", "step-00000004"]
    root = checkpoint_root(out)
    (root / "step-00000004" / "optimizer.pt").write_bytes(b"torn")      # damaged after the fact
    (root / "step-00000003" / MARKER).unlink()                          # killed before the marker
    (root / ".tmp-step-00000005-999999").mkdir()                        # killed mid-write
    with pytest.warns(UserWarning) as record:
        assert find_checkpoint("auto", out).name == "step-00000002"
    messages = " | ".join(str(w.message) for w in record)
    assert "step-00000004: optimizer.pt does not match its recorded size and checksum" in messages
    assert "step-00000003: no COMPLETE marker" in messages
    with pytest.raises(ConfigError, match="cannot resume from it: no COMPLETE marker"):
        find_checkpoint(str(root / "step-00000003"), out)


def test_resume_auto_without_checkpoint_starts_afresh(tmp_path, random_model_dir):
    result = trainer.train(cfg_for(random_model_dir, tmp_path / "r", "train.steps=1", "train.resume=auto"))
    assert result.resumed_from is None and result.steps_done == 1


def test_config_that_breaks_exactness_is_refused(tmp_path, random_model_dir):
    out = tmp_path / "run"
    trainer.train(cfg_for(random_model_dir, out, "train.steps=2", "train.save_every=2"))
    with pytest.raises(ConfigError) as e:
        trainer.train(cfg_for(random_model_dir, out, "train.steps=3", "train.resume=auto", "algo.beta=0.1",
                              "rollout.group_size=8"))
    msg = str(e.value)
    assert "algo.beta: 0.04 -> 0.1" in msg and "rollout.group_size: 4 -> 8" in msg and "\n" not in msg
    assert "A resume may change only train.steps" in msg
    for change in ("compute.share_prompt=false", "model.logprob_chunk_size=3", "eval.size=4"):  # the rule is inverted
        with pytest.raises(ConfigError, match=change.partition("=")[0]):
            trainer.train(cfg_for(random_model_dir, out, "train.steps=3", "train.resume=auto", change))
    # harmless: more steps, other logging and evaluation cadence; micro-batch size with a warning (rounding)
    with pytest.warns(UserWarning, match="compute.micro_batch_size: 64 -> 4: the same computation in another order"):
        result = trainer.train(cfg_for(random_model_dir, out, "train.steps=3", "train.resume=auto",
                                       "log.samples_every=2", "eval.every=5", "compute.micro_batch_size=4"))
    assert result.steps_done == 3 and [r["step"] for r in rows(out)] == [0, 1, 2, 3]


def test_nonfinite_updates_are_skipped_then_abort(tmp_path, random_model_dir, monkeypatch):
    import grpo.learn as learn

    real = learn.policy_loss
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] >= 2 else loss), stats  # finite first step, then NaN

    monkeypatch.setattr(learn, "policy_loss", flaky)
    out = tmp_path / "nan"
    with pytest.raises(trainer.TrainingAborted) as e:
        trainer.train(cfg_for(random_model_dir, out, "train.steps=10", "train.max_nonfinite_steps=3",
                              "compute.micro_batch_size=64", "train.save_every=1"))
    assert "aborted at step 4: non-finite loss in 3 consecutive steps (train.max_nonfinite_steps=3)" in str(e.value)
    assert "no weights were written; the last good checkpoint is" in str(e.value)
    assert str(e.value).count("step-00000003") == 1  # step 4 aborted before its checkpoint
    logged = rows(out)
    assert [r.get("fault/nonfinite") for r in logged[1:]] == [None, "loss", "loss", "loss"]
    assert not (out / "model").exists()
    # the skipped updates of steps 2 and 3 left the weights exactly as after step 1
    ckpts = checkpoint_root(out)
    w2, w3 = (load_file(ckpts / f"step-0000000{i}" / "model.safetensors") for i in (2, 3))
    assert all(torch.equal(w2[key], w3[key]) for key in w2)


# ---------------------------------------------------------------------------------------------------------
# processes killed and signalled

def spawn(model_dir, out, *extra, env=None):
    args = ["train", f"model.path={model_dir}", f"train.output_dir={out}", *FAST, *extra]
    return subprocess.Popen([sys.executable, "-m", "grpo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_for_rows(proc, out, n: int) -> None:
    """Until the run has logged n lines of metrics (step 0, the evaluation, is the first)."""
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < n):
        time.sleep(0.05)


# SIGKILL: tests/integration/test_faults.py kills a run in each phase, and one run again and again


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_says_how_to_resume(tmp_path, random_model_dir, grpo_cli):
    out = tmp_path / "term"
    proc = spawn(random_model_dir, out, "train.steps=200")
    wait_for_rows(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert code == 143, err
    assert "SIGTERM received: finishing this step" in err and "Traceback" not in err
    assert "resume with: grpo train" in err and err.strip().endswith("train.resume=auto")
    done = rows(out)[-1]["step"]
    assert find_checkpoint("auto", out).name == f"step-{done:08d}" and done < 200
    again = grpo_cli("train", f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST,
                     f"train.steps={done + 2}", "train.resume=auto")
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in rows(out)] == list(range(done + 3))


def interrupted(model_dir, out):
    """A long run into `out`, sent SIGINT once it has logged its first step."""
    proc = spawn(model_dir, out, "train.steps=200")
    wait_for_rows(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    return proc


def _read_until(proc, text: str) -> str:
    """The run's stderr until it holds `text` (it stops waiting after 60 s, or when the run ends). It reads the pipe
    itself, not through the text stream, whose buffer could hold `text` while select() waits on the empty pipe."""
    seen, deadline = b"", time.monotonic() + 60
    while text.encode() not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen
        if select.select([proc.stderr], [], [], 0.5)[0]:
            seen += os.read(proc.stderr.fileno(), 65536)
    return seen.decode()


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path, random_model_dir):
    out = tmp_path / "twice"
    # both signals in the middle of a step, while its reward sleeps for 2 s (it says when it starts); the second once
    # the first was received (two sent at once can merge into one pending signal on a busy machine)
    marker = tmp_path / "scoring"
    proc = spawn(random_model_dir, out, "train.steps=200", "rewards=[tests.integration.rewards:slow]",
                 "algo.dynamic_sampling=false",
                 env={**os.environ, "SLOW_REWARD_MARKER": str(marker)})
    wait_for_rows(proc, out, 2)  # step 1 is done
    scored = len(marker.read_text().splitlines())
    while proc.poll() is None and len(marker.read_text().splitlines()) == scored:  # step 2 is scoring
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    seen = _read_until(proc, "SIGINT received: finishing this step")
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=60)
    assert code == 130 and "second SIGINT: exiting now" in seen + proc.stderr.read()
    assert (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_signal_after_the_stop_exits_without_a_traceback(tmp_path, random_model_dir):
    out = tmp_path / "after"
    proc = interrupted(random_model_dir, out)
    _read_until(proc, "resume with:")  # stopped and checkpointed: the process is on its way out
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    assert code == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err


# ---------------------------------------------------------------------------------------------------------
# a full disk

def _no_room_on(call: int, real):
    """`real`, except that its `call`-th call fails as a full disk does, leaving a partial file."""
    calls = {"n": 0}

    def write(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(obj, path, *args, **kwargs)
    return write


def test_full_disk_while_checkpointing_names_the_last_good_one(tmp_path, random_model_dir, monkeypatch):
    import grpo.checkpoint as checkpoint

    steps = ["train.steps=4", "train.save_every=1", "eval.every=2"]
    trainer.train(cfg_for(random_model_dir, tmp_path / "straight", *steps))
    out = tmp_path / "full"
    monkeypatch.setattr(checkpoint, "_torch_save", _no_room_on(5, checkpoint._torch_save))  # 2 per checkpoint
    with pytest.raises(GRPOError) as e:
        trainer.train(cfg_for(random_model_dir, out, *steps))
    msg = str(e.value)
    assert msg == (f"could not write the checkpoint of step 3 into {checkpoint_root(out)}: No space left on device "
                   f"(writing optimizer.pt); the last good checkpoint is {checkpoint_root(out) / 'step-00000002'}: "
                   "make room and continue with train.resume=auto")
    assert sorted(p.name for p in checkpoint_root(out).iterdir()) == ["step-00000001", "step-00000002"]  # no temp
    monkeypatch.undo()
    result = trainer.train(cfg_for(random_model_dir, out, *steps, "train.resume=auto"))
    assert result.resumed_from.name == "step-00000002"
    assert_same_run(tmp_path / "straight", out)


def test_full_disk_in_the_final_save_leaves_no_half_written_model(tmp_path, random_model_dir, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    steps = ["train.steps=2", "train.save_every=1", "eval.every=0"]
    trainer.train(cfg_for(random_model_dir, tmp_path / "straight", *steps))
    out = tmp_path / "full"

    def no_room(self, directory, *args, **kwargs):  # the weights are written, then the disk is full
        (Path(directory) / "tokenizer.json").write_text("{")
        raise Exception("No space left on device (os error 28)")  # as the Rust tokenizers library reports it

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", no_room)
    with pytest.raises(GRPOError) as e:
        trainer.train(cfg_for(random_model_dir, out, *steps))
    assert str(e.value) == (f"could not write the trained model into {out}: No space left on device; the last good "
                            f"checkpoint is {checkpoint_root(out) / 'step-00000002'}: make room and continue with "
                            "train.resume=auto")
    assert not (out / "model").exists() and not list(out.glob(".tmp-*"))
    monkeypatch.undo()
    result = trainer.train(cfg_for(random_model_dir, out, *steps, "train.resume=auto"))
    assert result.resumed_from.name == "step-00000002" and result.steps_done == 2
    assert_same_run(tmp_path / "straight", out)


def test_a_real_write_limit_is_one_line_and_leaves_no_temporary_files(tmp_path, random_model_dir, grpo_cli):
    """The operating system refuses the write (RLIMIT_FSIZE: the file-size limit of `ulimit -f`, which any user
    can set; a full disk fails the same way, ENOSPC instead of EFBIG)."""
    import resource

    out = tmp_path / "limited"
    limit = 32 * 1024  # config.yaml and the metrics fit; the checkpoint's weights do not
    assert (Path(random_model_dir) / "model.safetensors").stat().st_size > limit
    proc = subprocess.run([sys.executable, "-m", "grpo", "train", f"model.path={random_model_dir}",
                           f"train.output_dir={out}", *FAST, "train.steps=2", "train.save_every=1"],
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"grpo: error: could not write the checkpoint of step 1 into {checkpoint_root(out)}: File too large "
        "(writing model.safetensors); no checkpoint was complete yet: make room and run again with train.resume=auto, "
        "which starts the run over")
    assert "Traceback" not in proc.stderr and list(checkpoint_root(out).iterdir()) == []
    # the run logged its first step, so its files stay; train.resume=auto starts it over and finishes
    assert [r["step"] for r in rows(out)] == [0, 1]
    again = grpo_cli("train", f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST, "train.steps=2",
                     "train.save_every=1", "train.resume=auto")
    assert again.returncode == 0, again.stderr
    assert (out / "model" / "model.safetensors").exists()


def test_a_full_disk_while_logging_is_one_line(tmp_path, random_model_dir):
    import resource

    out = tmp_path / "logging"
    limit = 6 * 1024  # the config fits; metrics.jsonl reaches the limit within a few steps
    proc = subprocess.run([sys.executable, "-m", "grpo", "train", f"model.path={random_model_dir}",
                           f"train.output_dir={out}", *FAST, "train.steps=40", "eval.every=0", "log.samples_every=0"],
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"grpo: error: could not write {out / 'metrics.jsonl'}: File too large; no checkpoint was complete yet: make "
        "room and run again with train.resume=auto, which starts the run over")


# ---------------------------------------------------------------------------------------------------------
# the run directory

def test_a_run_that_fails_leaves_the_existing_run_whole(tmp_path, random_model_dir):
    out = tmp_path / "run"
    trainer.train(cfg_for(random_model_dir, out, "train.steps=2", "train.save_every=1"))
    files = lambda: {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    with pytest.raises(ConfigError, match="already holds a run"):
        trainer.train(cfg_for(random_model_dir, out, "train.steps=2"))
    broken = "rewards=[tests.integration.rewards:raises]"
    for how in ("train.overwrite=true", "train.resume=auto"):  # the old run is replaced only once the new one built
        with pytest.raises(GRPOError, match="raised ZeroDivisionError"):
            trainer.train(cfg_for(random_model_dir, out, "train.steps=3", broken, how))
        assert files() == before, how
    trainer.train(cfg_for(random_model_dir, out, "train.steps=1", "train.overwrite=true"))
    assert [r["step"] for r in rows(out)] == [0, 1] and not (out / "checkpoints").exists()
