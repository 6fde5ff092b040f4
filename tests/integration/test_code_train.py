"""The shipped coding job (`grpo train smollm2_code`) from one command, shortened and on the bundled tiny model
instead of SmolLM2 (whose run is in docs/smollm2.md#code): the `code` reward scores every completion in the
sandbox, and the config's `sandbox.*` limits reach every one of its executions: in training, in the pre-flight
call, in the evaluations during training and in `grpo eval`; and those of the `python` tool of a tool job."""
import json

import pytest

import grpo.rewards.code as code_reward

LIMITS = ["sandbox.timeout_s=3.5", "sandbox.cpu_s=3", "sandbox.memory_mb=384", "sandbox.file_mb=2",
          "sandbox.output_chars=500"]
TINY = ["model.path=tiny", "model.chat_template=false", "model.autocast_bf16=false",
        "data.truncate_prompts=left",  # the tiny model has 64 positions: the prompts keep their last characters
        "rollout.max_new_tokens=12", "eval.size=3", "compute.threads=2"]


@pytest.fixture
def executions(monkeypatch):
    """(limits, execution) of every execution the code reward starts, each run as it would be anyway."""
    seen = []
    real = code_reward.run_python

    def recording(program, *, stdin="", limits):
        execution = real(program, stdin=stdin, limits=limits)
        seen.append((limits, execution))
        return execution

    monkeypatch.setattr(code_reward, "run_python", recording)
    return seen


def assert_config_limits(seen):
    assert seen
    for limits, _ in seen:
        assert (limits.timeout_s, limits.cpu_s, limits.memory_mb, limits.file_mb) == (3.5, 3, 384, 2)
        assert limits.output_chars >= code_reward._RESULT_CHARS  # the values' channel, above sandbox.output_chars


def test_coding_job_runs_and_its_sandbox_limits_reach_every_execution(tmp_path, executions, grpo_cli):
    r = grpo_cli("train", "smollm2_code", *TINY, *LIMITS, "rollout.group_size=2", "train.prompts_per_step=2",
                 "train.steps=2", "eval.every=0", "log.progress=false", "log.trackers=[]", "log.chart=false",
                 f"train.output_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    # the pre-flight call (the first training example's reference solution), 2 steps x 2 prompts x 2
    # completions, and the greedy evaluations before and after training, 3 problems each
    assert len(executions) == 1 + 2 * 2 * 2 + 2 * 3
    assert_config_limits(executions)
    reference = executions[0][1]
    assert reference.ok and len(reference.stdout.splitlines()) == 3  # a value for each of its three tests
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward/code" in row]
    assert len(steps) == 2 and all(0.0 <= row["reward/code"] <= 1.0 for row in steps)
    assert "rewards:\n- code" in (tmp_path / "config.yaml").read_text()


def test_grpo_eval_runs_the_code_reward_under_the_config_limits(executions, grpo_cli):
    r = grpo_cli("eval", "smollm2_code", *TINY, *LIMITS, "eval.pass_k=0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["examples"] == 3
    assert len(executions) == 3
    assert_config_limits(executions)


def test_the_python_tool_of_a_config_runs_under_its_sandbox_limits(monkeypatch):
    """The other user of the sandbox: the tool job with `python` added, built as training builds it."""
    import grpo.sandbox
    from grpo.cli import CONFIG_DIR
    from grpo.config import load_config
    from grpo.envs import build_environment
    from grpo.models import load_model

    seen = []
    real = grpo.sandbox.run_python

    def recording(program, *, stdin="", limits):
        seen.append(limits)
        return real(program, stdin=stdin, limits=limits)

    monkeypatch.setattr(grpo.sandbox, "run_python", recording)
    cfg = load_config(CONFIG_DIR / "tiny_tools.yaml", ["tools.names=[calculator,python]", *LIMITS])
    model, tokenizer = load_model(cfg.model)
    environment = build_environment(model, tokenizer, cfg)
    assert environment.tools["python"].fn(code="print(6 * 7)") == "42"
    assert [(x.timeout_s, x.cpu_s, x.memory_mb, x.file_mb, x.output_chars) for x in seen] == [(3.5, 3, 384, 2, 500)]
