"""End to end on the bundled tiny model: a short GRPO run raises the held-out reward, on 1 and 2 processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import load_config
from grpo.tiny import TINY_MODEL_DIR
from grpo.trainer import train

pytestmark = pytest.mark.skipif(not (TINY_MODEL_DIR / "model.safetensors").exists(),
                                reason="the bundled tiny model is not built")

# A shortened default job: the same model, task, algorithm and learning rate, fewer steps, a smaller
# held-out sample.
SHORT = ["train.steps=STEPS", "eval.size=EVAL", "eval.every=0", "eval.pass_k=0", "log.progress=false",
         "log.trackers=[]", "log.chart=false"]


def short(steps, eval_size):
    return [o.replace("STEPS", str(steps)).replace("EVAL", str(eval_size)) for o in SHORT]


# the default job shortened to 20 steps and 200 held-out examples on one thread: run once for this module, in this
# process; the two-process test compares its torchrun run with this one
ONE_PROCESS = ["grpo/configs/tiny.yaml", *short(20, 200), "compute.threads=1"]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("one-process")
    result = train(load_config(ONE_PROCESS[0], [*ONE_PROCESS[1:], f"train.output_dir={out}"]))
    return result, out


@pytest.mark.slow  # 20 steps of a bundled model: about a minute on 2 cores
def test_short_run_raises_held_out_accuracy(one_process_run):
    result, out = one_process_run
    before, after = result.initial_eval["eval/accuracy"], result.final_eval["eval/accuracy"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[1:11], rows[-10:]
    # the policy's reward rises: of every completion drawn (the default job samples dynamically, and the groups it
    # trains on are the informative ones, whose reward stays nearer the middle)
    assert sum(r["sampling/reward_mean"] for r in last) > sum(r["sampling/reward_mean"] for r in first)
    assert after >= before + 0.10, (before, after)                                    # and held-out accuracy


@pytest.mark.slow  # 20 steps of a bundled model: about a minute on 2 cores
def test_process_reward_raises_held_out_accuracy(tmp_path):
    # the shipped process-supervision job, shortened: each worked step is rewarded, accuracy is the last number's
    result = train(load_config("grpo/configs/tiny_process.yaml", [f"train.output_dir={tmp_path}", *short(20, 400)]))
    before, after = result.initial_eval["eval/accuracy"], result.final_eval["eval/accuracy"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "reward/arithmetic_steps" in rows[1]
    assert sum(r["sampling/reward_mean"] for r in rows[-10:]) > sum(r["sampling/reward_mean"] for r in rows[1:11])
    assert after >= before + 0.15, (before, after)


@pytest.mark.slow  # 20 steps of a bundled model, scored by the bundled reward model
def test_a_reward_model_alone_raises_held_out_accuracy(tmp_path):
    # the shipped tiny_rm job, shortened: the policy never reads an answer, only the tiny reward model's score;
    # held-out accuracy is still judged against the answers
    result = train(load_config("grpo/configs/tiny_rm.yaml", [f"train.output_dir={tmp_path}", *short(20, 400)]))
    before, after = result.initial_eval["eval/accuracy"], result.final_eval["eval/accuracy"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "reward/tiny-rm" in rows[1] and "reward/last_number" not in rows[1]
    assert sum(r["sampling/reward_mean"] for r in rows[-10:]) > sum(r["sampling/reward_mean"] for r in rows[1:11])
    assert after >= before + 0.10, (before, after)  # the shipped job: +17.6 points on 760 problems


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_learn_as_one(tmp_path, one_process_run):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = {1: one_process_run[1], 2: tmp_path / "p2"}  # one process: this module's run
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "grpo", "train", *ONE_PROCESS, f"train.output_dir={out[2]}"], capture_output=True,
                       text=True, env=env, timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {n: [json.loads(x) for x in (out[n] / "metrics.jsonl").read_text().splitlines()] for n in out}
    acc = {n: (rows[n][0]["eval/accuracy"], rows[n][-1]["eval/accuracy"]) for n in rows}
    assert acc[1][1] > acc[1][0] and acc[2][1] > acc[2][0]        # both learn
    assert abs(acc[1][1] - acc[2][1]) <= 0.02, acc                   # and end in the same place
    for a, b in zip(rows[1][1:], rows[2][1:]):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=0.02)
