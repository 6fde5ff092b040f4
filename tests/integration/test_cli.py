"""The command line: train/eval/sample run; bad configs and data give one line and a non-zero exit."""
import json
import subprocess
import sys

import pytest

FAST = ["train.steps=1", "rollout.group_size=2", "train.prompts_per_step=2", "rollout.max_new_tokens=4",
        "eval.size=4", "eval.pass_k=2", "log.trackers=[]"]


def grpo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "grpo", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_train_eval_sample(tmp_path, random_model_dir):
    out = tmp_path / "run"
    r = grpo("train", f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST)
    assert r.returncode == 0, r.stderr
    assert "held-out accuracy" in r.stdout and (out / "metrics.jsonl").exists()
    assert "grpo" in r.stderr  # the progress bar
    r = grpo("eval", f"model.path={out / 'model'}", "eval.size=6", "eval.pass_k=2")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["examples"] == 6 and 0 <= report["eval/accuracy"] <= 1 and "eval/pass@2" in report
    r = grpo("sample", f"model.path={out / 'model'}", "--prompt", "Calculate 1 + 1 =", "-n", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "Calculate 1 + 1 =" and r.stdout.count("    -> ") == 3


def test_shipped_config_by_name(tmp_path, random_model_dir):
    r = grpo("train", "presets/dapo", f"model.path={random_model_dir}", f"train.output_dir={tmp_path}", *FAST,
             "log.progress=false")
    assert r.returncode == 0, r.stderr
    assert "preset: dapo" in (tmp_path / "config.yaml").read_text()


@pytest.mark.parametrize("args, message", [
    (["train", "train.stepz=3"], "unknown key 'train.stepz'; did you mean 'train.steps'?"),
    (["train", "algo.aggregation=sum"], "algo.aggregation='sum' is not allowed"),
    (["train", "missing.yaml"], "config 'missing.yaml' is neither a file nor a shipped config"),
    (["train", "model.path=/nonexistent/model"], "model.path '/nonexistent/model' does not exist"),
    (["eval", "rewards=[nope]"], "rewards: unknown reward 'nope'"),
    (["train", "data.path=/nonexistent/train.jsonl"], "/nonexistent/train.jsonl"),
])
def test_bad_input_is_one_line_and_nonzero(args, message):
    r = grpo(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"grpo: error: {r.stderr.strip()[len('grpo: error: '):]}"]
    assert message in r.stderr


def test_model_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = grpo("eval", f"model.path={tmp_path}")
    assert r.returncode == 2 and "is a directory without weights" in r.stderr and "Traceback" not in r.stderr


def test_bad_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: [1\n")
    r = grpo("train", f)
    assert r.returncode == 2 and "is not valid YAML" in r.stderr and len(r.stderr.strip().splitlines()) == 1
