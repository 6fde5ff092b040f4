"""Trainer equivalences on a small random model: micro-batches change nothing, same seed gives the same run."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from grpo.config import ModelConfig, load_config
from grpo.models import load_model
from grpo.trainer import train
from tests.unit.test_metrics import events

FAST = ["train.steps=2", "rollout.group_size=4", "train.prompts_per_step=3", "rollout.max_new_tokens=5",
        "eval.size=8", "eval.pass_k=2", "log.progress=false", "log.trackers=[]", "log.chart=false",
        "train.lr=1e-3"]


def run(tmp_path, model_dir, name, *extra):
    cfg = load_config(None, [f"model.path={model_dir}", f"train.output_dir={tmp_path / name}", *FAST, *extra])
    result = train(cfg)
    weights = load_file(tmp_path / name / "model" / "model.safetensors")
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result, weights, rows


def strip_perf(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.mark.parametrize("extra", [
    ["algo.preset=grpo"], ["algo.preset=dapo"], ["algo.preset=dr_grpo"], ["algo.preset=gspo"],
    # μ = 2 replays the 3 mini-batches (one group each) of train.steps_per_generation=3: 6 updates a step, under a
    # reward with a signal in most groups (without one, an update's gradient is rounding noise, which AdamW's
    # first steps blow up to ±lr)
    ["algo.preset=grpo", "algo.num_iterations=2", "train.steps_per_generation=3",
     "rewards=[tests.integration.rewards:odd_length]"],
    ["algo.scale=rloo", "algo.mask_truncated=true"],
])
def test_micro_batch_size_changes_nothing(tmp_path, random_model_dir, extra):
    assert_same_run(run(tmp_path, random_model_dir, "whole", "compute.micro_batch_size=64", *extra),
                    run(tmp_path, random_model_dir, "micro", "compute.micro_batch_size=5", *extra))


def assert_same_run(a, b):
    """Weights within 1e-6 and every logged figure within 1e-5, timings aside."""
    (_, w_a, rows_a), (_, w_b, rows_b) = a, b
    for k in w_a:
        assert torch.allclose(w_a[k], w_b[k], atol=1e-6), k
    for ra, rb in zip(strip_perf(rows_a), strip_perf(rows_b)):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], abs=1e-5, nan_ok=True), k  # NaN: a step with no loss token


@pytest.mark.parametrize("extra", [["algo.preset=grpo"], ["algo.preset=gspo", "algo.num_iterations=2"]])
def test_token_budget_and_prompt_sharing_change_nothing(tmp_path, random_model_dir, extra):
    whole = run(tmp_path, random_model_dir, "whole", "compute.share_prompt=false", *extra)
    # 9-token budget: one to three rows per pass; groups of 4 split across micro-batches, prompts shared
    assert_same_run(whole, run(tmp_path, random_model_dir, "budget", "compute.micro_batch_tokens=9", *extra))


def test_same_seed_same_run_and_another_seed_another(tmp_path, random_model_dir):
    _, w1, rows1 = run(tmp_path, random_model_dir, "a")
    _, w2, rows2 = run(tmp_path, random_model_dir, "b")
    _, w3, rows3 = run(tmp_path, random_model_dir, "c", "train.seed=1")
    assert strip_perf(rows1) == strip_perf(rows2)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert strip_perf(rows1) != strip_perf(rows3)


def test_metrics_rows_and_outputs(tmp_path, random_model_dir):
    result, _, rows = run(tmp_path, random_model_dir, "out", "log.samples_every=1", "log.chart=true",
                          "log.trackers=[tensorboard]", "eval.every=1")
    out = tmp_path / "out"
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "reward/mean" not in rows[0]  # the evaluation before any update
    required = ["reward/mean", "reward/last_number", "loss", "kl", "clip/frac", "completion/mean_length",
                "perf/step_seconds", "perf/completion_tokens", "eval/accuracy", "eval/pass@2", "lr", "grad_norm"]
    for r in rows[1:]:
        assert all(k in r for k in required), [k for k in required if k not in r]
    assert result.final_eval["eval/accuracy"] == rows[-1]["eval/accuracy"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2} and len(samples) == 2 * 2 * 4  # 2 groups of G = 4 per step
    assert {"prompt", "answer", "completion", "reward", "advantage", "reward/last_number"} <= samples[0].keys()
    assert (out / "chart.png").stat().st_size > 1000
    board = events(out / "tensorboard")
    for tag in ("reward/mean", "loss", "eval/accuracy"):
        got = [(e.step, e.value) for e in board.Scalars(tag)]
        want = [(r["step"], r[tag]) for r in rows if tag in r]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        assert all(abs(a[1] - b[1]) <= 1e-6 * max(1.0, abs(b[1])) for a, b in zip(got, want)), tag
    assert (out / "config.yaml").exists() and (out / "model" / "model.safetensors").exists()
    assert (out / "model" / "tokenizer.json").exists()
    assert load_config(out / "config.yaml").train.steps == 2  # the resolved config reloads


def test_reference_model_only_when_beta_positive(tmp_path, random_model_dir, monkeypatch):
    import grpo.trainer as trainer

    copies = []
    real = trainer.frozen_copy
    monkeypatch.setattr(trainer, "frozen_copy", lambda m: copies.append(1) or real(m))
    run(tmp_path, random_model_dir, "nokl", "algo.beta=0")
    assert copies == []
    run(tmp_path, random_model_dir, "kl", "algo.beta=0.04")
    assert copies == [1]


def test_python_reward_callables(tmp_path, random_model_dir):
    seen = {}

    def always_one(prompts, completions, answer, task, **kw):
        seen["n"] = len(completions)
        seen["task"] = set(task)
        return [1.0] * len(completions)

    cfg = load_config(None, [f"model.path={random_model_dir}", f"train.output_dir={tmp_path / 'r'}", *FAST])
    train(cfg, rewards=[always_one])
    # weights fit the functions given, not the names in the config
    cfg.reward_weights = [1.0, 2.0]
    cfg.train.output_dir = str(tmp_path / "two")
    train(cfg, rewards=[always_one, always_one])
    assert [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()][1]["reward/mean"] == 3.0
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert seen["n"] == 12 and seen["task"] <= {"arithmetic", "linear"}
    assert rows[1]["reward/always_one"] == 1.0 and rows[1]["adv/std_zero_frac"] == 1.0


def test_an_async_reward_from_the_config_trains_as_its_plain_twin(tmp_path, random_model_dir):
    plain = run(tmp_path, random_model_dir, "plain", "rewards=[tests.integration.rewards:odd_length]")
    later = run(tmp_path, random_model_dir, "async", "rewards=[tests.integration.rewards:odd_length_async]")
    renamed = [{k.replace("odd_length_async", "odd_length"): v for k, v in r.items()} for r in later[2]]
    assert_same_run(plain, (later[0], later[1], renamed))
    assert later[2][1]["reward/tests.integration.rewards:odd_length_async"] > 0
    assert later[2][1]["adv/std_zero_frac"] < 1


def test_a_reward_model_rewards_a_run_and_is_never_trained(tmp_path, random_model_dir):
    import yaml

    from grpo.rewards.model import RewardModel
    from tests.unit.test_reward_model import _save
    rm = _save(tmp_path / "my-rm")
    _, _, rows = run(tmp_path, random_model_dir, "r", f"rewards=[rm:{rm},last_number]", "reward_weights=[1.0,0.0]",
                     "log.samples_every=1", f"eval.rewards=[rm:{rm}]")
    # eval.rewards: its mean score of the held-out greedy completions, before and after
    assert all(math.isfinite(rows[i]["eval/reward/my-rm"]) for i in (0, -1))
    assert rows[1]["reward/my-rm"] == pytest.approx(rows[1]["reward/mean"]) and rows[2]["adv/std_zero_frac"] < 1
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["rewards"] == [f"rm:{rm}", "last_number"]
    # the last step's samples score as a fresh copy of the reward model scores them: it did not move in training
    last = [json.loads(x) for x in (tmp_path / "r" / "samples.jsonl").read_text().splitlines()]
    last = [x for x in last if x["step"] == 2]
    fresh = RewardModel(str(rm))(prompts=[x["prompt"] for x in last], completions=[x["completion"] for x in last])
    assert [x["reward/my-rm"] for x in last] == pytest.approx(fresh, abs=1e-5) and len(last) == 8


def test_a_run_config_names_its_python_rewards_and_a_resume_refuses_others(tmp_path, random_model_dir):
    import yaml

    from grpo.errors import ConfigError
    from tests.integration.rewards import odd_length, starts_below_digits

    out = tmp_path / "r"
    cfg = load_config(None, [f"model.path={random_model_dir}", f"train.output_dir={out}", *FAST, "train.steps=1",
                             "train.save_every=1"])
    train(cfg, rewards=[odd_length])
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["rewards"] == ["tests.integration.rewards:odd_length"]  # not the config's default last_number
    assert load_config(out / "config.yaml").rewards == saved["rewards"]  # it loads back, naming the same function
    cfg.train.steps, cfg.train.resume = 2, "auto"
    with pytest.raises(ConfigError) as e:
        train(cfg, rewards=[starts_below_digits])
    assert ("rewards: ['tests.integration.rewards:odd_length'] -> ['tests.integration.rewards:starts_below_digits']"
            in str(e.value)) and "\n" not in str(e.value)
    assert train(cfg, rewards=[odd_length]).steps_done == 2  # the same function continues the run


def test_dynamic_sampling_replaces_zero_variance_groups_in_training(tmp_path, random_model_dir):
    from tests.integration.rewards import starts_below_digits

    def flat_for_linear(prompts, completions, task, **kw):  # every linear group has all-equal rewards
        varied = starts_below_digits(prompts, completions)
        return [0.5 if t == "linear" else v for t, v in zip(task, varied)]

    cfg = load_config(None, [f"model.path={random_model_dir}", f"train.output_dir={tmp_path / 'd'}", *FAST,
                             "train.steps=3", "algo.preset=dapo", "log.samples_every=1", "log.samples_per_step=3"])
    train(cfg, rewards=[flat_for_linear])
    rows = [json.loads(x) for x in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()][1:]
    samples = [json.loads(x) for x in (tmp_path / "d" / "samples.jsonl").read_text().splitlines()]
    assert sum(r["sampling/groups_dropped"] for r in rows) > 0
    for r in rows:
        prompts = {s["prompt"] for s in samples if s["step"] == r["step"]}
        # the step has train.prompts_per_step groups, or at the round cap the informative ones it found
        assert len(prompts) == r["sampling/groups_trained"] and r["sampling/groups_trained"] <= 3
        assert not [p for p in prompts if p.startswith("Solve")], (r, prompts)  # a linear group never trains
        if prompts:
            assert r["adv/std_zero_frac"] == 0.0  # every group trained on has a signal, at the cap too


def test_a_dynamic_step_without_informative_groups_makes_no_update(tmp_path, random_model_dir, capsys):
    def flat(prompts, completions, **kw):  # every group's rewards are equal
        return [1.0] * len(completions)

    cfg = load_config(None, [f"model.path={random_model_dir}", f"train.output_dir={tmp_path / 'f'}", *FAST,
                             "train.steps=2", "algo.preset=dapo", "algo.max_sampling_rounds=2", "algo.beta=0.04"])
    train(cfg, rewards=[flat])
    assert "step 1: dynamic sampling found 0 informative groups in 2 rounds, too few for 1 process(es): no update" \
        in capsys.readouterr().out
    rows = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["sampling/groups_trained"] for r in rows] == [0, 0] and all("loss" not in r for r in rows)
    # nothing trained: no reward or completion figures (not nulls); what was drawn is in sampling/*
    assert not any(k.startswith(("reward/", "completion/", "adv/")) for r in rows for k in r)
    assert [r["sampling/reward_mean"] for r in rows] == [1.0, 1.0]
    initial, _ = load_model(ModelConfig(path=str(random_model_dir)))
    final = load_file(tmp_path / "f" / "model" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in initial.state_dict().items() if k in final)  # not moved


def test_a_step_without_any_reward_says_so(tmp_path, random_model_dir, capsys):
    _, _, rows = run(tmp_path, random_model_dir, "none", "rewards=[tests.integration.rewards:never_applies]",
                     "train.steps=1")
    out = capsys.readouterr().out
    assert "step 1: no reward function applied to any of the 12 completions (every reward was None): the step has " \
           "no policy gradient" in out
    assert rows[1]["reward/mean"] is None and rows[1]["grad_norm"] == 0  # strict JSON: null, not NaN
