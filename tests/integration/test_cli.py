"""The command line: train/eval/sample run; bad configs and data give one line and a non-zero exit.

Most cases call grpo.cli.main in this process (the `grpo_cli` fixture, tests/conftest.py); a fresh process is
started where the process itself is under test: its exit status and a stderr of one line without a traceback,
and the `grpo` command's import path."""
import json
import subprocess
import sys

import pytest

FAST = ["train.steps=1", "rollout.group_size=2", "train.prompts_per_step=2", "rollout.max_new_tokens=4",
        "eval.size=4", "eval.pass_k=2", "log.trackers=[]"]


def grpo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "grpo", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_train_eval_sample(tmp_path, random_model_dir, grpo_cli):
    out = tmp_path / "run"
    r = grpo_cli("train", f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST)
    assert r.returncode == 0, r.stderr
    assert (out / "metrics.jsonl").exists()
    summary = r.stdout.strip().splitlines()[-3:]  # the end-of-run summary
    assert summary[0].startswith("held-out accuracy ") and ", best " in summary[0] and "; pass@2 " in summary[0]
    assert summary[1].startswith("1 steps in ") and "completion tokens/s, peak memory " in summary[1]
    # samples.jsonl only if the step had samples: dynamic sampling may find no informative group on a random model
    samples = "samples.jsonl, " if (out / "samples.jsonl").stat().st_size else ""
    assert summary[2].startswith(f"outputs in {out}: model/, metrics.jsonl, {samples}chart.png")
    assert "grpo" in r.stderr  # the progress bar
    # model.autocast_bf16=auto decided, the run's first line: off for a model under 1.5 M parameters on any device
    assert r.stdout.splitlines()[0].startswith("bfloat16 autocast: off (model.autocast_bf16=auto: ")
    assert "autocast_bf16: auto" in (out / "config.yaml").read_text()  # the run records the setting, not the choice
    r = grpo_cli("eval", f"model.path={out / 'model'}", "eval.size=6", "eval.pass_k=2")
    assert r.returncode == 0, r.stderr
    assert "bfloat16 autocast: off (model.autocast_bf16=auto: " in r.stderr  # stdout is the JSON report
    report = json.loads(r.stdout)
    assert report["examples"] == 6 and 0 <= report["eval/accuracy"] <= 1 and "eval/pass@2" in report
    r = grpo_cli("sample", f"model.path={out / 'model'}", "--prompt", "Calculate 1 + 1 =", "-n", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "Calculate 1 + 1 =" and r.stdout.count("    -> ") == 3


def test_shipped_config_by_name(tmp_path, random_model_dir, grpo_cli):
    r = grpo_cli("train", "presets/dapo", f"model.path={random_model_dir}", f"train.output_dir={tmp_path}", *FAST,
                 "log.progress=false")
    assert r.returncode == 0, r.stderr
    assert "preset: dapo" in (tmp_path / "config.yaml").read_text()


BAD_INPUT = [
    (["train", "train.stepz=3"], "unknown key 'train.stepz'; did you mean 'train.steps'?"),
    (["train", "algo.aggregation=sum"], "algo.aggregation='sum' is not allowed"),
    (["train", "missing.yaml"], "config 'missing.yaml' is neither a file nor a shipped config"),
    (["train", "model.path=/nonexistent/model"], "model.path '/nonexistent/model' does not exist"),
    (["eval", "rewards=[nope]"], "rewards: unknown reward 'nope'"),
    (["train", "data.path=/nonexistent/train.jsonl"], "/nonexistent/train.jsonl"),
]


def assert_one_line(r, message):
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"grpo: error: {r.stderr.strip()[len('grpo: error: '):]}"]
    assert message in r.stderr


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_input_is_one_line_and_nonzero(args, message, grpo_cli):
    assert_one_line(grpo_cli(*args), message)


def test_an_error_in_a_process_of_its_own_is_one_line_and_exit_status_2(tmp_path, random_model_dir):
    # the process, not main(): `python -m grpo` exits with 2 and nothing else reaches its stderr (no traceback, no
    # warning of a library imported on the way); the case that imports the most, up to loading the model
    import shutil

    model = tmp_path / "model"
    shutil.copytree(random_model_dir, model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    r = grpo("train", f"model.path={model}", f"train.output_dir={tmp_path / 'run'}")
    assert_one_line(r, f"grpo: error: cannot load model.path '{model}': its weights file is damaged or incomplete")


def test_model_dir_without_weights(tmp_path, grpo_cli):
    (tmp_path / "config.json").write_text("{}")
    r = grpo_cli("eval", f"model.path={tmp_path}")
    assert r.returncode == 2 and "is a directory without weights" in r.stderr and "Traceback" not in r.stderr


def test_bad_yaml_file(tmp_path, grpo_cli):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: [1\n")
    r = grpo_cli("train", f)
    assert r.returncode == 2 and "is not valid YAML" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_report_of_two_real_runs(tmp_path, random_model_dir, grpo_cli):
    """Two short runs that differ in the learning rate, compared: the legend names the difference."""
    from grpo.report import figure, load_runs

    for name, lr in (("slow", "1e-4"), ("fast", "1e-2")):
        r = grpo_cli("train", f"model.path={random_model_dir}", f"train.output_dir={tmp_path / name}", *FAST,
                     "train.steps=3", "eval.every=2", f"train.lr={lr}", "log.progress=false",
                     "algo.dynamic_sampling=false")  # a random model's groups are rarely informative: updates
        assert r.returncode == 0, r.stderr
    r = grpo_cli("report", tmp_path / "slow", tmp_path / "fast", "-o", tmp_path / "cmp")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cmp.png").stat().st_size > 10_000 and "<svg" in (tmp_path / "cmp.html").read_text()
    fig = figure(load_runs([tmp_path / "slow", tmp_path / "fast"]))
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["slow: train.lr=0.0001", "fast: train.lr=0.01"]
    accuracy = {line.get_gid(): list(line.get_xdata()) for line in fig.axes[2].get_lines() if line.get_gid()}
    assert accuracy["slow|eval/accuracy"] == [0, 2, 3] and accuracy["fast|eval/pass@2"] == [0, 2, 3]


def test_a_reward_module_in_the_current_directory(tmp_path, random_model_dir):
    """The `grpo` command (not `python -m`, which puts the directory on the path itself) finds ./my_rewards.py."""
    from pathlib import Path

    (tmp_path / "my_rewards.py").write_text("def brevity(prompts, completions, **_):\n"
                                            "    return [-len(c) / 10 for c in completions]\n")
    command = Path(sys.executable).parent / "grpo"
    r = subprocess.run([str(command), "train", f"model.path={random_model_dir}", f"train.output_dir={tmp_path / 'run'}",
                        *FAST, "log.progress=false", "rewards=[my_rewards:brevity]",
                        "algo.dynamic_sampling=false"], capture_output=True, text=True,  # a step whatever the rewards
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["reward/my_rewards:brevity"] < 0


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
@pytest.mark.parametrize("command", ["train", "eval", "sample"])
def test_damaged_weights_are_one_line(tmp_path, random_model_dir, command, damage, grpo_cli):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(random_model_dir, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if damage == "truncate" else b"not a safetensors file")
    r = grpo_cli(command, f"model.path={model}", f"train.output_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == (f"grpo: error: cannot load model.path '{model}': its weights file is damaged or "
                                f"incomplete ({r.stderr.split('incomplete (', 1)[1].split(');')[0]}); write or copy "
                                "it again")


def test_a_broken_reward_fails_before_the_first_evaluation_and_leaves_no_run(tmp_path, random_model_dir, grpo_cli):
    out = tmp_path / "run"
    r = grpo_cli("train", f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST, "eval.size=400",
                 "rewards=[tests.integration.rewards:raises]")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().startswith("grpo: error: reward function 'tests.integration.rewards:raises' raised "
                                       "ZeroDivisionError: float division by zero on prompt ")
    assert "held-out accuracy" not in r.stdout and list(out.iterdir()) == []


def test_grpo_warnings_are_one_line():
    import warnings

    from grpo import cli
    from grpo.cli import _format_warning

    line = _format_warning(UserWarning("resuming with x: 1 -> 2"), UserWarning, cli.__file__, 1)
    assert line == "grpo: warning: resuming with x: 1 -> 2\n"
    other = _format_warning(UserWarning("theirs"), UserWarning, warnings.__file__, 7, "src")
    assert other.startswith(warnings.__file__) and "UserWarning: theirs" in other


def test_a_full_disk_in_a_background_thread_prints_no_traceback(monkeypatch):
    import threading

    from grpo import cli

    passed_on = []
    monkeypatch.setattr(cli, "_python_thread_hook", lambda args: passed_on.append(args.exc_value))
    monkeypatch.setattr(threading, "excepthook", cli._thread_exception)
    for error in (OSError(28, "No space left on device"), Exception("File too large (os error 27)"),
                  ValueError("a real bug")):
        t = threading.Thread(target=lambda e=error: (_ for _ in ()).throw(e))
        t.start()
        t.join()
    assert [str(e) for e in passed_on] == ["a real bug"]  # only that one gets Python's traceback


def test_a_run_explains_itself(tmp_path, random_model_dir, grpo_cli):
    """A 3-step run on the arithmetic task (the default job's is mixed): samples.jsonl has its first and last step,
    the console its sampled completions, model/ its card, and eval and sample on the run take its config."""
    import warnings

    import yaml

    from grpo.config import load_config

    out = tmp_path / "run"
    r = grpo_cli("train", f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST, "train.steps=3",
                 "data.task=arithmetic", "log.print_samples=3", "log.progress=false", "algo.dynamic_sampling=false",
                 "train.save_every=3")
    assert r.returncode == 0, r.stderr
    assert sorted({json.loads(x)["step"] for x in (out / "samples.jsonl").read_text().splitlines()}) == [1, 3]
    printed = r.stdout.split("step 1: 3 of its sampled completions (reward: prompt -> completion)\n", 1)[1]
    assert [line[8:].startswith(": 'Calculate ") for line in printed.splitlines()[:4]] == [True, True, True, False]
    assert "step 3: 3 of its sampled completions" in r.stdout and "step 2: " not in r.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(out / "config.yaml").data.task == "arithmetic"
    card = (out / "model" / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["library_name"] == "transformers" and meta["tags"] == ["grpo", "reinforcement-learning"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert f"| accuracy (greedy) | {rows[0]['eval/accuracy']:.3f} | {rows[-1]['eval/accuracy']:.3f} |" in card

    r = grpo_cli("eval", out, "eval.size=5", "eval.pass_k=0")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == f"grpo eval: run {out}: its config.yaml and its final model {out / 'model'}"
    report = json.loads(r.stdout)
    assert (report["model"], report["examples"], "eval/pass@2" in report) == (str(out / "model"), 5, False)
    assert "eval/accuracy/linear" not in report  # the run's task, not the default job's mixed one
    r = grpo_cli("eval", f"model.path={out / 'model'}", "eval.size=5", "eval.pass_k=0")
    assert r.returncode == 0 and json.loads(r.stdout) == report
    assert r.stderr.startswith(f"grpo eval: model.path={out / 'model'} is in run {out}: its config.yaml")
    r = grpo_cli("sample", out, "-n", "1")
    assert r.returncode == 0, r.stderr
    prompts = [line for line in r.stdout.splitlines() if not line.startswith("    -> ")]
    assert len(prompts) == 4 and all(p.startswith("Calculate ") for p in prompts)
    (out / "model").rename(tmp_path / "final")  # a run without its final model yet: its newest checkpoint's weights
    r = grpo_cli("eval", out, "eval.size=5", "eval.pass_k=0")
    assert r.returncode == 0, r.stderr
    ckpt = out / "checkpoints" / "step-00000003"
    assert r.stderr.splitlines()[0] == (f"grpo eval: run {out} has no final model yet: its config.yaml and the "
                                        f"weights of its newest checkpoint {ckpt}")
    assert json.loads(r.stdout) == {**report, "model": str(ckpt)}  # step 3's weights are the final model's
