"""RunLogger: metrics.jsonl and TensorBoard events agree, and a resumed run replaces what came after its checkpoint."""
import json

import pytest

from grpo.config import LogConfig
from grpo.runlog import RunLogger


def events(path):
    """The TensorBoard events under `path`, read back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(path))
    accumulator.Reload()
    return accumulator


def scalars(path, tag):
    return [(e.step, round(e.value, 5)) for e in events(path).Scalars(tag)]


@pytest.mark.parametrize("older_run", [False, True])
def test_tensorboard_events_match_the_jsonl_and_resume_purges(tmp_path, older_run):
    cfg = LogConfig(progress=False, trackers=["tensorboard"], chart=False)
    first = RunLogger(tmp_path, cfg, total_steps=4)
    for step in range(1, 5):
        first.log(step, {"loss": 0.5 * step, "kl": float("nan"), "eval/accuracy": step / 10})
    first.close()
    if older_run:  # written before tracking.json existed: taken to have reported to TensorBoard already
        (tmp_path / "tracking.json").unlink()
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            del r["perf/elapsed_seconds"]
            r["perf/step_seconds"] = 1.5
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert scalars(tmp_path / "tensorboard", "loss") == [(1, 0.5), (2, 1.0), (3, 1.5), (4, 2.0)]
    assert scalars(tmp_path / "tensorboard", "eval/accuracy") == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    # a non-finite value goes to the JSONL file as null (strict JSON) but is not a TensorBoard point
    strict = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
              for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl"] for r in strict] == [None] * 4
    assert "kl" not in events(tmp_path / "tensorboard").Tags()["scalars"]

    # resumed from a checkpoint at step 2: steps 3-4 are logged anew, the old ones are dropped
    resumed = RunLogger(tmp_path, cfg, total_steps=4, resume_step=2)
    for step in (3, 4):
        resumed.log(step, {"loss": -1.0 * step, "eval/accuracy": 0.9})
    resumed.close()
    assert scalars(tmp_path / "tensorboard", "loss") == [(1, 0.5), (2, 1.0), (3, -3.0), (4, -4.0)]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 0.5), (2, 1.0), (3, -3.0), (4, -4.0)]
    # wall time goes on from the checkpoint's (for an older run, the sum of its step times)
    assert rows[2]["perf/elapsed_seconds"] > (3.0 if older_run else rows[1]["perf/elapsed_seconds"])


def test_samples_are_strict_json(tmp_path):
    logger = RunLogger(tmp_path, LogConfig(progress=False, trackers=[], chart=False), total_steps=1)
    logger.samples(1, [{"prompt": "p", "completion": "c", "reward": float("nan"), "advantage": float("inf"),
                        "args": {1, 2}}])
    logger.log(1, {"loss": float("-inf")})
    logger.close()
    line = (tmp_path / "samples.jsonl").read_text()
    assert json.loads(line) == {"step": 1, "prompt": "p", "completion": "c", "reward": None, "advantage": None,
                                "args": "{1, 2}"}
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] is None
