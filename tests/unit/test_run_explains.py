"""A run that explains itself: its config.yaml loads back without warnings, the steps samples are written and
printed at, the model card, eval's progress bar, and what `grpo eval --help`, `grpo sample --help` and
`grpo --version` print. The end-to-end side (a run directory given to eval and sample) is in
tests/integration/test_cli.py."""
import warnings

import pytest
import yaml

from grpo.config import Config, load_config, to_yaml


@pytest.mark.parametrize("name", ["tiny", "tiny_tools", "presets/dapo", "smollm2_code"])
def test_a_resolved_config_loads_back_without_warnings(tmp_path, name):
    from grpo.cli import resolve_config

    cfg = load_config(resolve_config(name))
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every algo.* key is written out: none of them was set on purpose
        again = load_config(tmp_path / "config.yaml")
    assert again.to_dict() == cfg.to_dict()


def test_a_key_set_on_purpose_still_warns_from_a_resolved_config(tmp_path):
    with pytest.warns(UserWarning, match="algo.clip_high set"):
        cfg = load_config(None, ["algo.clip_high=0.3"])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    with pytest.warns(UserWarning, match="algo.clip_high set") as seen:  # 0.3 is not the preset's 0.2
        load_config(tmp_path / "config.yaml")
    assert "algo.clip_low" not in str(seen[0].message)
    with pytest.warns(UserWarning, match="algo.clip_low set"):  # an override on top is set on purpose
        load_config(tmp_path / "config.yaml", ["algo.clip_low=0.2"])


def test_samples_are_written_at_the_first_and_last_step_and_every_samples_every():
    from grpo.runlog import samples_due

    assert [s for s in range(1, 4) if samples_due(s, 10, 3)] == [1, 3]
    assert [s for s in range(1, 8) if samples_due(s, 3, 7)] == [1, 3, 6, 7]
    assert [s for s in range(1, 8) if samples_due(s, 0, 7)] == []


def test_a_run_resumed_to_more_steps_keeps_only_the_samples_the_uninterrupted_run_writes(tmp_path):
    """A run of 2 steps wrote samples at its last step; resumed to 4 steps, samples.jsonl holds what the 4-step run
    writes (steps 1 and 4 with samples_every 10), so the resumed run's file equals the uninterrupted one's."""
    import json

    from grpo.config import LogConfig
    from grpo.runlog import RunLogger

    (tmp_path / "samples.jsonl").write_text("".join(json.dumps({"step": s, "completion": str(s)}) + "\n"
                                                    for s in (1, 2)))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    log = RunLogger(tmp_path, LogConfig(samples_every=10, trackers=[], progress=False), 4, resume_step=2)
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_printed_samples_take_one_completion_of_each_prompt_first():
    from grpo.runlog import format_samples

    rows = [{"prompt": p, "answer": a, "completion": f" {c}", "reward": r, "reward/last_number": r}
            for p, a, cs in (("Calculate 1 + 1 =", "2", [(2, 1.0), (3, 0.0)]), ("Calculate 2 * 3 =", "6", [(6, 1.0)]))
            for c, r in cs]
    text = format_samples(4, rows, 2)
    rows_text = text.splitlines()[1:]
    assert text.splitlines() == ["step 4: 2 of its sampled completions (reward: prompt -> completion)",
                                 "   1.000: 'Calculate 1 + 1 =' -> ' 2'  (answer '2')",
                                 "   1.000: 'Calculate 2 * 3 =' -> ' 6'  (answer '6')"]
    assert format_samples(4, rows, 3).splitlines()[-1] == "   0.000: 'Calculate 1 + 1 =' -> ' 3'  (answer '2')"
    rows[0].update({"reward/format": 0.5, "reward": None})  # two functions: each one's figure; a None reward
    assert format_samples(1, rows, 1).splitlines()[1].endswith("(answer '2'; last_number 1.000; format 0.500)")
    assert format_samples(1, rows, 1).splitlines()[1].startswith("    none: ")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 2 * 3 ="}]
    assert format_samples(1, [{**rows[2], "prompt": chat}], 1).splitlines()[1] == rows_text[1]
    long = format_samples(1, [{**rows[1], "completion": "x" * 500}], 1, width=40)
    assert "x" * 19 + " ... " + "x" * 18 in long and "x" * 41 not in long


def _card(cfg: Config, **kw) -> tuple[dict, str]:
    from grpo.model_card import front_matter, model_card

    before = {"eval/accuracy": 0.25, "eval/pass@8": 0.5}
    after = {"eval/accuracy": 0.75, "eval/pass@8": 0.875}
    text = model_card(cfg, initial_eval=before, final_eval=after, history=[
        {"step": 0, **before}, {"step": 1, "reward/mean": 0.125}, {"step": 20, "reward/mean": 0.5, **after}],
        steps=20, **kw)
    assert text.startswith("---\n")
    return front_matter(text), text


def test_the_model_card_has_hub_metadata_figures_config_and_citation():
    import grpo

    cfg = load_config(None, ["model.path=smollm2-135m-instruct", "data.path=openai/gsm8k", "data.config_name=main",
                             "rewards=[math,format]", "reward_weights=[1.0,0.5]", "train.output_dir=runs/gsm"])
    meta, text = _card(cfg)
    assert meta == {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "datasets": ["openai/gsm8k"],
                    "library_name": "transformers", "license": "apache-2.0", "pipeline_tag": "text-generation",
                    "tags": ["grpo", "reinforcement-learning"]}
    assert "| accuracy (greedy) | 0.250 | 0.750 |" in text
    assert "| pass@8 (8 samples, temperature 1) | 0.500 | 0.875 |" in text
    assert "Mean training reward: 0.125 at step 1, 0.500 at step 20." in text
    from grpo.model_card import model_card

    once = model_card(cfg, initial_eval={}, final_eval={}, history=[{"step": 2, "reward/mean": 0.25}], steps=2)
    assert "Mean training reward: 0.250 at step 2." in once  # one rewarded step (the others had no update): once
    assert "1 × `math` + 0.5 × `format`" in text and f"grpo {grpo.__version__}" in text
    assert "arXiv:2402.03300" in text and "@article{shao2024deepseekmath" in text
    config = text.split("```yaml\n", 1)[1].split("\n```", 1)[0]
    assert yaml.safe_load(config) == cfg.to_dict()  # the whole resolved config, as config.yaml has it


def test_a_packaged_models_cache_directory_is_known_by_its_hub_id(tmp_path, monkeypatch):
    """A model object of SmolLM2 loaded from grpo's cache has that directory as its name_or_path: the card still
    names the Hub model it was converted from."""
    from grpo.model_card import hub_base_model
    from grpo.packaged import PACKAGED

    monkeypatch.setenv("GRPO_CACHE", str(tmp_path))
    from grpo.packaged import cache_root

    converted = cache_root() / f"smollm2-135m-instruct-{PACKAGED['smollm2-135m-instruct'].version}"
    converted.mkdir(parents=True)
    assert hub_base_model(str(converted)) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    assert hub_base_model(str(tmp_path)) == (None, None)


def test_the_model_card_of_a_local_model_and_data_file_and_of_a_lora_adapter(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "README.md").write_text("---\nlicense: mit\n---\n# base\n")
    (tmp_path / "train.jsonl").write_text("{}\n")
    cfg = load_config(None, [f"model.path={tmp_path / 'base'}", f"data.path={tmp_path / 'train.jsonl'}",
                             "lora.rank=8"])
    meta, text = _card(cfg, adapter=True)
    assert meta == {"library_name": "peft", "license": "mit", "pipeline_tag": "text-generation",
                    "tags": ["grpo", "reinforcement-learning", "lora"]}
    assert "a LoRA adapter (rank 8)" in text and "AutoPeftModelForCausalLM" in text
    assert f"the data set `{tmp_path / 'train.jsonl'}`" in text
    meta, text = _card(load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct"]))
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct" and "built-in task `mixed`" in text


def test_eval_progress_gives_the_figures_of_one_call(random_model_dir):
    from grpo.envs import build_environment
    from grpo.evaluation import Progress
    from grpo.models import load_model
    from grpo.rollout import Sampling, build_generator
    from grpo.tasks import load_task

    cfg = load_config(None, [f"model.path={random_model_dir}", "rollout.max_new_tokens=6"])
    model, tokenizer = load_model(cfg.model)
    generator, environment = build_generator(model, tokenizer, cfg), build_environment(model, tokenizer, cfg)
    examples = load_task(cfg.data, 0).eval[:7]

    class Bar:
        n = 0

        def update(self, k):
            self.n += k

    bar = Bar()
    chunked = Progress(environment, bar, chunk=3, pad_id=generator.pad_id)
    for sampling, seeds in ((Sampling(1, 6, temperature=0.0), None), (Sampling(2, 6), list(range(7)))):
        whole = environment.rollout(generator, examples, sampling, seeds)
        parts = chunked.rollout(generator, examples, sampling, seeds)
        assert parts.texts == whole.texts and parts.lengths.tolist() == whole.lengths.tolist()
    assert bar.n == 7 + 14


def test_version_and_the_options_eval_and_sample_list(grpo_cli):
    import grpo

    r = grpo_cli("--version")
    assert (r.returncode, r.stdout) == (0, f"grpo {grpo.__version__}\n")
    keys = {}
    for command in ("train", "eval", "sample"):
        r = grpo_cli(command, "--help")
        assert r.returncode == 0
        keys[command] = {line.split()[0] for line in r.stdout.splitlines()
                         if line.startswith("  ") and line[2] not in " -" and " (" in line}
    assert {"algo.beta", "train.lr", "optim.lr_schedule", "rollout.group_size", "log.samples_every"} <= keys["train"]
    assert {"model.path", "data.task", "rollout.max_new_tokens", "tools.names", "eval.pass_k", "eval.reward",
            "train.seed"} <= keys["eval"]
    assert not keys["eval"] & {"algo.beta", "train.lr", "train.steps", "optim.lr_schedule", "rollout.group_size",
                               "log.samples_every", "lora.rank", "rewards"}
    assert "eval.pass_k" not in keys["sample"] and {"model.path", "rollout.temperature"} <= keys["sample"]
    assert keys["sample"] < keys["eval"] < keys["train"]


def test_what_eval_and_sample_load(tmp_path, monkeypatch):
    import grpo.checkpoint
    from grpo.cli import DEFAULT_JOB, run_source
    from grpo.errors import GRPOError

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  task: arithmetic\n")
    (run / "model" / "model.safetensors").write_bytes(b"")
    s = run_source([str(run), "eval.size=5"])
    assert (s.config, s.overrides[-2:], s.checkpoint) == (run / "config.yaml", [f"model.path={run / 'model'}",
                                                                                 "eval.size=5"], None)
    assert s.note == f"run {run}: its config.yaml and its final model {run / 'model'}"
    assert load_config(s.config, s.overrides).data.task == "arithmetic"
    s = run_source([f"model.path={run / 'model'}"])  # a model inside a run: the run's config
    assert s.config == run / "config.yaml" and s.note.startswith(f"model.path={run / 'model'} is in run {run}")
    assert run_source(["tiny", f"model.path={run / 'model'}"]).note is None  # a CONFIG given: that one
    monkeypatch.chdir(run)  # a config.yaml beside a model.path that is not a directory here does not count
    assert (run_source(["model.path=tiny"]).config, run_source(["model.path=tiny"]).note) == (DEFAULT_JOB, None)
    (run / "model" / "model.safetensors").unlink()
    monkeypatch.setattr(grpo.checkpoint, "find_checkpoint", lambda spec, d: d / "checkpoints" / "step-00000002")
    s = run_source([str(run)])
    assert s.checkpoint == run / "checkpoints" / "step-00000002" and "no final model yet" in s.note
    assert not any(o.startswith("model.path=") for o in s.overrides)  # the run's base model, the checkpoint's weights
    monkeypatch.setattr(grpo.checkpoint, "find_checkpoint", lambda spec, d: None)
    with pytest.raises(GRPOError, match="has no final model .* and no complete checkpoint yet"):
        run_source([str(run)])
    with pytest.raises(GRPOError, match="is a directory without a config.yaml, not a run directory"):
        run_source([str(run / "model")])


def test_the_summary_lists_samples_jsonl_only_when_it_has_samples(tmp_path):
    from grpo.runlog import summary_lines

    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "samples.jsonl").write_text("")  # log.samples_every=0
    assert summary_lines([], tmp_path)[-1].startswith(f"outputs in {tmp_path}: metrics.jsonl; ")
    (tmp_path / "samples.jsonl").write_text('{"step": 1}\n')
    assert summary_lines([], tmp_path)[-1].startswith(f"outputs in {tmp_path}: metrics.jsonl, samples.jsonl; ")


def test_a_run_given_data_or_script_objects_names_the_overrides_to_give(tmp_path):
    from grpo.cli import run_source
    from grpo.errors import GRPOError

    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "model.safetensors").write_bytes(b"")
    (run / "config.yaml").write_text("# train_dataset: a list of 6 rows given to grpo.train(train_dataset=...)\n"
                                     "data:\n  path: ''\n  given: [train_dataset, eval_dataset]\n")
    with pytest.raises(GRPOError, match=r"trained on data given to grpo.train as objects \(train_dataset, "
                                        r"eval_dataset\).*give them as files, data.path=FILE data.eval_path=FILE"):
        run_source([str(run)])
    with pytest.raises(GRPOError, match="data.eval_path=FILE"):
        run_source([str(run), "data.path=t.jsonl"])
    s = run_source([str(run), "data.path=t.jsonl", "data.eval_path=e.jsonl"])
    assert s.overrides[-2:] == ["data.path=t.jsonl", "data.eval_path=e.jsonl"]
    assert run_source([str(run)], needs_data=False).config == run / "config.yaml"  # grpo sample --prompt
    (run / "config.yaml").write_text("model:\n  chat_template: true\nrollout:\n  environment: tools\n"
                                     "tools:\n  names: [__main__:add, calculator]\n"
                                     "eval:\n  reward: tests.x:test_y.<locals>.solved\n")
    with pytest.raises(GRPOError, match=r"names what its training script defined, which cannot be imported here "
                                        r"\(tools.names: __main__:add; eval.reward: tests.x:test_y.<locals>.solved\): "
                                        r"give them from an importable module, tools.names=\[my_module:add\] "
                                        r"eval.reward=my_module:accuracy_reward"):
        run_source([str(run)])
    s = run_source([str(run), "tools.names=[calculator]", "eval.reward=last_number"])
    assert load_config(s.config, s.overrides).tools.names == ["calculator"]


def test_the_model_card_names_the_threshold_and_data_given_as_objects():
    _, text = _card(load_config(None, ["eval.threshold=0.5", "data.given=[train_dataset]"]))
    assert "Scored by the reward `last_number` (correct when at least 0.5)" in text
    assert "a data set given to `grpo.train` in Python (not recorded: `train_dataset` given as objects)" in text
