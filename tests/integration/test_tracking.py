"""Trackers (log.trackers): TensorBoard, W&B (offline) and Trackio (a local store) each get every step's metrics,
the config and the sample tables, read back here from what each wrote; a resumed run continues the same
tracked run, and with two processes only the main one reports."""
import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import load_config
from grpo.trainer import train

FAST = ["rollout.group_size=4", "train.prompts_per_step=2", "rollout.max_new_tokens=5", "eval.size=4",
        "eval.pass_k=0", "eval.every=2", "log.progress=false", "log.chart=false", "log.samples_every=1",
        "log.samples_per_step=1", "compute.threads=2", "train.lr=1e-3"]


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory):
    """One Trackio store for the session: trackio reads TRACKIO_DIR once, when it is imported."""
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(tmp_path_factory.mktemp("trackio"))
    utils = pytest.importorskip("trackio.utils", reason="the trackio extra is not installed (make test installs it)")
    return utils.TRACKIO_DIR


@pytest.fixture
def project(tmp_path, monkeypatch, trackio_dir):
    """W&B without a network; a Trackio project of the test's own. Returns the project's name."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed (make test installs it)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))  # for the processes a test starts
    monkeypatch.delenv("TRACKIO_SPACE_ID", raising=False)
    return f"grpo-test-{tmp_path.name}"


def run(model_dir, out, project, *extra):
    return train(load_config(None, [f"model.path={model_dir}", f"train.output_dir={out}", *FAST,
                                    f"log.project={project}", *extra]))


def jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def finite(row):
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and v == v
            and abs(v) != float("inf")}


# ---------------------------------------------------------------------------------------------------------
# reading back what each tracker wrote

def wandb_records(run_dir):
    """The records of an offline W&B run's transaction log (a LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(Path(run_dir) / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, part = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            pos += left - 7
            continue
        part += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            yield record


def wandb_history(out):
    """{step: {key: value}} over every offline W&B run directory under out/wandb, and their run ids."""
    steps, ids, config = {}, set(), {}
    for run_dir in sorted(glob.glob(str(Path(out) / "wandb" / "offline-run-*"))):
        for r in wandb_records(run_dir):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.add(r.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "history":
                item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                step = item["_step"]
                assert step not in steps, f"step {step} logged twice"
                steps[step] = item
    return steps, ids, config


def trackio_logs(project, name):
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, name), SQLiteStorage.get_run_config(project, name)


def tensorboard(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(out) / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def assert_metrics_match(rows, by_step, skip=("perf/",)):
    for row in rows:
        got = by_step[row["step"]]
        for k, v in finite(row).items():
            if not k.startswith(skip):
                assert got[k] == pytest.approx(v, rel=1e-6), (row["step"], k)


# ---------------------------------------------------------------------------------------------------------

def test_three_trackers_get_every_metric_the_config_and_samples(tmp_path, random_model_dir, project):
    out = tmp_path / "run"
    run(random_model_dir, out, project, "train.steps=3", "log.trackers=[tensorboard,wandb,trackio]", "log.run_name=first")
    rows = jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["perf/elapsed_seconds"] > 0 for r in rows)
    assert [r["perf/elapsed_seconds"] for r in rows] == sorted(r["perf/elapsed_seconds"] for r in rows)

    # W&B: every finite value of every step, the config, a samples table at each step
    steps, ids, config = wandb_history(out)
    assert sorted(steps) == [0, 1, 2, 3] and len(ids) == 1
    assert ids == {json.loads((out / "tracking.json").read_text())["wandb_id"]}
    assert_metrics_match(rows, {s: {k: v for k, v in item.items()} for s, item in steps.items()}, skip=())
    assert config["algo"]["beta"] == 0.04 and config["train"]["steps"] == 3
    for s in (1, 2, 3):
        assert steps[s]["samples/_type"] == "table-file" and steps[s]["samples/nrows"] == 4
    (files,) = (out / "wandb").glob("offline-run-*/files")
    table = json.loads((files / steps[1]["samples/path"]).read_text())
    sample = jsonl(out / "samples.jsonl")[0]
    assert table["columns"][:3] == ["prompt", "answer", "completion"]
    assert table["data"][0][:3] == [sample["prompt"], sample["answer"], sample["completion"]]

    # Trackio: the same, in its local store
    logs, tconfig = trackio_logs(project, "first")
    metric_rows = {r["step"]: r for r in logs if "samples" not in r}
    assert sorted(metric_rows) == [0, 1, 2, 3]
    assert_metrics_match(rows, metric_rows, skip=())
    assert tconfig["algo"]["beta"] == 0.04
    tables = [r for r in logs if "samples" in r]
    assert [r["step"] for r in tables] == [1, 2, 3]
    assert tables[0]["samples"]["_value"][0]["completion"] == sample["completion"]

    # TensorBoard: scalars, the config as text, the samples as a text table
    board = tensorboard(out)
    assert [(e.step, round(e.value, 5)) for e in board.Scalars("reward/mean")] == \
        [(r["step"], round(r["reward/mean"], 5)) for r in rows if "reward/mean" in r]
    assert {"config", "samples"} <= {t.split("/")[0] for t in board.Tags()["tensors"]}


def test_a_resumed_run_continues_the_same_tracked_runs(tmp_path, random_model_dir, project):
    out = tmp_path / "run"
    # 4 steps, with a checkpoint at step 2 kept; then resume from step 2 to step 6, adding TensorBoard and
    # trackio on the way: steps 3-4 are recomputed; W&B already has them; the other two get steps 0-2 replayed
    run(random_model_dir, out, project, "train.steps=4", "train.save_every=2", "train.keep_last=2",
        "log.trackers=[wandb]")
    first = jsonl(out / "metrics.jsonl")
    run(random_model_dir, out, project, "train.steps=6", "train.save_every=2", "train.keep_last=2",
        f"train.resume={out / 'checkpoints' / 'step-00000002'}", "log.trackers=[tensorboard,wandb,trackio]")
    rows = jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(7))
    for a, b in zip(first, rows[:5]):  # an exact resume: the recomputed steps have the values logged before
        assert {k: v for k, v in finite(a).items() if not k.startswith("perf/")} == \
            pytest.approx({k: v for k, v in finite(b).items() if not k.startswith("perf/")}, rel=1e-6)

    steps, ids, _ = wandb_history(out)  # two offline directories of one W&B run, each step once
    assert sorted(steps) == list(range(7)) and len(ids) == 1
    assert len(glob.glob(str(out / "wandb" / "offline-run-*"))) == 2
    assert_metrics_match(rows, steps)

    logs, _ = trackio_logs(project, "run")
    metric_rows = [r for r in logs if "samples" not in r]
    assert [r["step"] for r in metric_rows] == list(range(7))
    assert_metrics_match(rows, {r["step"]: r for r in metric_rows})
    assert [r["step"] for r in logs if "samples" in r] == list(range(1, 7))

    board = tensorboard(out)
    assert [e.step for e in board.Scalars("loss")] == list(range(1, 7))
    assert [e.step for e in board.Tensors("config/text_summary")] == [0]
    assert [e.step for e in board.Tensors("samples/text_summary")] == list(range(1, 7))
    # elapsed time goes on from where the run was at its checkpoint
    assert rows[3]["perf/elapsed_seconds"] > rows[2]["perf/elapsed_seconds"]


@pytest.mark.distributed
def test_only_the_main_process_reports(tmp_path, random_model_dir, project):
    out = tmp_path / "two"
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "grpo", "train",
            f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST, "train.steps=1",
            "compute.threads=1", "log.trackers=[tensorboard,trackio]", f"log.project={project}"]
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    from trackio.sqlite_storage import SQLiteStorage
    assert SQLiteStorage.get_runs(project) == ["two"]
    logs, _ = trackio_logs(project, "two")
    assert [x["step"] for x in logs if "samples" not in x] == [0, 1]
    assert len(list((out / "tensorboard").glob("events.*"))) == 1


def test_wandb_without_a_key_is_one_clear_error(tmp_path, random_model_dir, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed (make test installs it)")
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no stored login
    monkeypatch.setenv("HOME", str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "grpo", "train", f"model.path={random_model_dir}",
                        f"train.output_dir={tmp_path / 'run'}", *FAST, "train.steps=1", "log.trackers=[wandb]"],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "grpo: error: wandb could not start its run" in r.stderr and "WANDB_MODE=offline" in r.stderr
    assert list((tmp_path / "run").iterdir()) == []  # no half-written run: a retry is not refused
