"""Config loading: types, ranges, enums, unknown keys, presets, overrides, shipped files."""
import dataclasses
import typing

import pytest

from grpo.algo import PRESETS
from grpo.cli import CONFIG_DIR, shipped_configs
from grpo.config import Config, describe_options, load_config
from grpo.errors import ConfigError


def test_defaults_are_the_grpo_preset():
    cfg = load_config()
    assert cfg.algo.preset == "grpo" and cfg.algo.beta == 0.04 and cfg.algo.aggregation == "seq_mean"
    assert cfg.model.path == "tiny" and cfg.rewards == ["last_number"] and cfg.eval.reward == "last_number"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_fills_algo_fields(name):
    cfg = load_config(None, [f"algo.preset={name}"])
    p = PRESETS[name].values
    assert (cfg.algo.scale, cfg.algo.beta, cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.ratio_level,
            cfg.algo.aggregation) == (p["scale"], p["beta"], p["clip_low"], p["clip_high"], p["ratio_level"],
                                      p["aggregation"])


def test_explicit_keys_win_over_the_preset(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  preset: dapo\n  clip_high: 0.3\ntrain:\n  steps: 7\n")
    cfg = load_config(f, ["train.steps=9", "algo.beta=0.01"])
    assert cfg.algo.aggregation == "token_mean" and cfg.algo.clip_high == 0.3 and cfg.algo.beta == 0.01
    assert cfg.train.steps == 9


def test_override_values_are_yaml():
    cfg = load_config(None, ["rewards=[exact_match, exact_match]", "reward_weights=[1, 0.5]", "train.lr=1e-3",
                             "algo.mask_truncated=true", "eval.size=10"])
    assert cfg.reward_weights == [1.0, 0.5] and cfg.train.lr == 1e-3 and cfg.algo.mask_truncated is True


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "unknown key 'train.stepz'; did you mean 'train.steps'?"),
    ("trian.steps=3", "unknown key 'trian'; did you mean 'train'?"),
    ("train.steps=abc", "train.steps must be an int, got 'abc' (str)"),
    ("train.steps=2.5", "train.steps must be an int, got 2.5"),
    ("train.steps=0", "train.steps=0 is out of range; it must be >= 1"),
    ("train.lr=-1", "train.lr=-1.0 is out of range; it must be > 0"),
    ("algo.clip_low=1.5", "algo.clip_low=1.5 is out of range; it must be >= 0 and <= 1"),
    ("algo.dual_clip=0.5", "algo.dual_clip=0.5 must be more than 1"),

    ("rollout.top_p=1.5", "rollout.top_p=1.5 is out of range; it must be > 0 and <= 1"),
    ("rollout.group_size=1", "rollout.group_size=1 is out of range; it must be >= 2"),
    ("algo.aggregation=sum", "algo.aggregation='sum' is not allowed; choose one of 'seq_mean', 'token_mean', 'constant'"),
    ("algo.preset=ppo", "algo.preset='ppo' is not allowed; choose one of 'grpo', 'dr_grpo', 'dapo', 'gspo'"),
    ("data.task=chess", "data.task='chess' is not allowed"),
    ("log.progress=maybe", "log.progress must be a bool"),
    ("log.tensorboard=false", "unknown key 'log.tensorboard'; it is now log.trackers, a list (log.trackers=[] "),
    ("log.trackers=wandb", "log.trackers must be a list of one of 'tensorboard', 'wandb', 'trackio', got 'wandb'"),
    ("log.trackers=[mlflow]", "log.trackers[0]='mlflow' is not allowed; choose one of 'tensorboard', 'wandb', "
                              "'trackio'"),
    ("log.trackers=[wandb,wandb]", "log.trackers=['wandb', 'wandb'] names a tracker twice"),
    ("rewards=exact_match", "rewards must be a list of str"),
    ("rewards=[nope]", "rewards: unknown reward 'nope'; built-in rewards are exact_match"),
    ("rewards=[os:nope_fn]", "rewards: cannot import reward 'os:nope_fn'"),
    ("eval.reward=nope", "eval.reward: unknown reward 'nope'"),
    ("reward_weights=[1, 2]", "reward_weights has 2 values but rewards names 1 functions"),
    ("rollout.min_new_tokens=33", "rollout.min_new_tokens=33 is more than rollout.max_new_tokens=32"),
    ("rollout.backend=vllmm", "rollout.backend='vllmm' is not a rollout backend; choose one of 'hf'"),
    ("rollout.environment=chess", "rollout.environment='chess' is not an environment; choose one of 'single_turn'"),
    ("train.micro_batch_size=8", "unknown key 'train.micro_batch_size'; it is now 'compute.micro_batch_size'"),
    ("train.warmup_steps=8", "unknown key 'train.warmup_steps'; it is now 'optim.warmup_steps'"),
    ("optim.warmup_steps=100", "optim.warmup_steps=100 must be less than train.steps=100"),
    ("algo.max_sampling_rounds=0", "algo.max_sampling_rounds=0 is out of range; it must be >= 1"),
    ("model=3", "model must be a mapping of keys, got int"),
    ("noequals", "override 'noequals' is not of the form dotted.key=value"),
    ("train.steps=[1", "override 'train.steps=[1': the value is not valid YAML"),
])
def test_errors_name_the_field_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=4", "compute.sharding=fsdp"], "lora.rank > 0 with compute.sharding=fsdp is not supported"),
    (["algo.surrogate=sapo", "algo.dual_clip=3"], "algo.dual_clip=3 bounds PPO.s clipped surrogate; algo.surrogate=sapo has none"),
    (["algo.multi_objective_aggregation=normalize_then_sum", "algo.scale=maxrl"], "algo.scale=maxrl does not apply with algo.multi_objective_aggregation=normalize_then_sum .GDPO standardises each reward within its group, then the sum over the batch.: leave algo.scale=group, or use sum_then_normalize"),
    (["algo.surrogate=dppo_kl", "algo.ratio_level=sequence"], "algo.surrogate=dppo_kl masks tokens by their own probabilities, and algo.ratio_level=sequence gives one ratio per sequence: set algo.ratio_level=token"),
    (["lora.rank=4", "lora.dropout=0.05"], "lora.dropout=0.05 is not supported: GRPO.s ratio compares"),
    (["rewards=[overlong]", "overlong_buffer=33"], "overlong_buffer=33 is larger than rollout.max_new_tokens=32"),
    (["rollout.environment=tools"], "rollout.environment=tools renders episodes with the chat template"),
    (["rollout.environment=tools", "model.chat_template=true", "tools.names=[]"], "tools.names is empty"),
    (["rollout.environment=tools", "model.chat_template=true", "tools.parser=xml"],
     "tools.parser='xml' is not a tool-call parser; choose one of 'qwen', 'pythonic'"),
    (["rollout.environment=tools", "model.chat_template=true", "tools.names=[nope]"], "unknown tool 'nope'"),
    (["rollout.environment=tools", "model.chat_template=true", "tools.names=[python]", "tools.timeout_s=5"],
     "sandbox.timeout_s=5 must be less than tools.timeout_s=5"),
    (["rollout.environment=tools", "model.chat_template=true", "rewards=[final_number, overlong]"],
     "the overlong reward counts one completion's tokens"),
    (["rollout.environment=nope"], "rollout.environment='nope' is not an environment; choose one of 'single_turn', "
                                   "'tools'"),
    (["train.overwrite=true", "train.resume=auto"], "train.overwrite=true would delete the run that "
                                                    "train.resume='auto' continues; give one of them"),
])
def test_cross_field_rules_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_prompts_per_step_must_split_over_the_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # what torchrun sets before `grpo train` loads the config
    with pytest.raises(ConfigError, match=r"train.prompts_per_step=16 must be a multiple of the number of "
                                          r"processes \(3\)"):
        load_config()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert load_config().train.prompts_per_step == 16
    assert load_config(None, ["train.steps_per_generation=4"]).train.steps_per_generation == 4
    with pytest.raises(ConfigError, match=r"train.steps_per_generation=3 must divide the groups each process trains: "
                                          r"train.prompts_per_step=16 over 4 process\(es\) is 4 a process"):
        load_config(None, ["train.steps_per_generation=3"])


def test_2026_options_refuse_what_cannot_act():
    with pytest.raises(ConfigError, match="algo.unbiased_kl=prox corrects the KL term, and algo.beta=0 has none"):
        load_config(None, ["algo.unbiased_kl=prox", "algo.beta=0"])
    with pytest.raises(ConfigError, match="algo.entropy_coef_min=0.5 must be at most algo.entropy_coef_max=0.1"):
        load_config(None, ["algo.entropy_coef_min=0.5", "algo.entropy_coef_max=0.1"])
    with pytest.warns(UserWarning, match="OPSM's statistic is 0 and it never drops a sequence"):
        load_config(None, ["algo.off_policy_mask_threshold=0.5"])


def test_dapo_preset_turns_dynamic_sampling_on():
    assert load_config(None, ["algo.preset=dapo"]).algo.dynamic_sampling is True
    assert load_config(None, ["algo.preset=grpo"]).algo.dynamic_sampling is False
    assert load_config(None, ["algo.preset=dapo", "algo.dynamic_sampling=false"]).algo.dynamic_sampling is False


def test_every_field_is_documented_once():
    text = describe_options()
    hints = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[section.name]):
            for f in dataclasses.fields(hints[section.name]):
                assert f.metadata["help"], f.name
                assert text.count(f"  {section.name}.{f.name} (") == 1
        else:
            assert section.metadata["help"] and text.count(f"  {section.name} (") == 1
    for key in ["model.path", "data.task", "rollout.group_size", "rollout.max_new_tokens", "rollout.temperature",
                "train.prompts_per_step", "train.steps", "train.lr", "train.seed", "train.output_dir",
                "algo.preset", "algo.beta", "algo.clip_low", "algo.clip_high", "algo.num_iterations",
                "eval.every"]:
        assert f"  {key} (" in text, key


def test_shipped_configs_load_and_validate():
    names = shipped_configs()
    assert {"tiny", "presets/grpo", "presets/dr_grpo", "presets/dapo", "presets/gspo", "presets/cispo",
            "presets/sapo", "presets/dppo", "presets/icepop", "qwen2_math_1p5b"} <= set(names)
    for name in names:
        load_config(CONFIG_DIR / f"{name}.yaml")
    for preset in PRESETS:
        assert load_config(CONFIG_DIR / "presets" / f"{preset}.yaml").algo.preset == preset


def test_no_arguments_is_the_shipped_default_job():
    # `grpo train` with no CONFIG runs tiny.yaml; the library's defaults are the same job with the grpo preset
    # alone, without the dynamic sampling the default job adds (SPEC 13.8: off in the grpo preset)
    from grpo.cli import _split_args

    assert _split_args(["train.steps=3"]) == (CONFIG_DIR / "tiny.yaml", ["train.steps=3"])
    job, library = load_config(CONFIG_DIR / "tiny.yaml").to_dict(), load_config().to_dict()
    assert job["algo"].pop("dynamic_sampling") is True and library["algo"].pop("dynamic_sampling") is False
    assert job == library
    assert load_config(CONFIG_DIR / "presets" / "grpo.yaml").algo.dynamic_sampling is False


@pytest.mark.parametrize("overrides, warning", [
    (["algo.preset=gspo", "algo.aggregation=token_mean"], "algo.ratio_level=sequence (GSPO) with algo.aggregation"),
    (["algo.clip_high=0.3"], "algo.clip_high set: with algo.num_iterations=1 and the in-process sampler"),
    (["algo.clip_low=0.1", "algo.clip_high=0.3"], "algo.clip_high and algo.clip_low set: "),
    (["algo.dual_clip=3"], "algo.dual_clip=3: with algo.num_iterations=1"),
    (["algo.sampler_correction=token_mis"], "algo.sampler_correction set: the in-process sampler's log-probs"),
    (["rollout.top_p=0.9", "algo.num_iterations=2"], "rollout.top_p=0.9: the loss's ratio is to the policy "
                                                     "renormalised over the kept set"),
    (["rollout.top_k=5", "train.steps_per_generation=2"], "replay the kept set at their own weights"),
    (["rollout.top_k=5", "rollout.backend=vllm"], "samples from the engine's own logits"),
])
def test_known_traps_warn_once_at_load(overrides, warning):
    with pytest.warns(UserWarning) as caught:
        load_config(None, overrides)
    assert [str(w.message) for w in caught if warning in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("overrides", [[], ["algo.preset=dapo"], ["algo.preset=gspo"], ["algo.preset=cispo"],
                                       ["algo.clip_high=0.3", "algo.num_iterations=2"],
                                       ["algo.dual_clip=3", "algo.num_iterations=4"],
                                       # truncated sampling: the loss replays the kept set (SPEC 14.12)
                                       ["rollout.top_p=0.9"], ["rollout.top_k=20"]])
def test_sound_settings_do_not_warn(overrides):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, overrides)


def test_a_preset_given_over_a_file_that_sets_its_fields_says_which_keys_win():
    import warnings

    with pytest.warns(UserWarning) as caught:
        cfg = load_config(CONFIG_DIR / "tiny.yaml", ["algo.preset=gspo"])
    assert cfg.algo.dynamic_sampling is True and cfg.algo.ratio_level == "sequence"  # the file's key wins
    assert [str(w.message) for w in caught] == [
        "algo.preset=gspo is given, but tiny.yaml sets algo.dynamic_sampling=true, which wins over the preset's "
        "false; add algo.dynamic_sampling=false for the preset as its paper has it"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(CONFIG_DIR / "tiny.yaml", ["algo.preset=dapo"])                 # the same value: nothing to say
        load_config(CONFIG_DIR / "tiny.yaml", ["algo.preset=gspo", "algo.dynamic_sampling=false"])
        load_config(CONFIG_DIR / "presets" / "grpo.yaml", ["algo.preset=gspo"])    # the file sets no preset field


def test_a_preset_applies_however_the_config_is_built():
    from grpo.algo.presets import preset_values
    from grpo.config import AlgoConfig

    for name in PRESETS:
        built = Config(algo=AlgoConfig(preset=name))
        assert built.to_dict() == load_config(None, [f"algo.preset={name}"]).to_dict(), name
        assert {k: getattr(built.algo, k) for k in preset_values(name)} == preset_values(name), name
    assert Config().to_dict() == load_config().to_dict()
    # a key given wins over the preset, even one equal to the default preset's value
    given = AlgoConfig(preset="dapo", clip_high=0.3, beta=0.04)
    assert (given.clip_high, given.beta, given.aggregation, given.dynamic_sampling) == (0.3, 0.04, "token_mean", True)
    with pytest.raises(ConfigError, match="algo.preset='ppo' is not allowed; choose one of 'grpo', 'dr_grpo'"):
        AlgoConfig(preset="ppo")


def test_every_value_a_preset_sets_is_an_algo_option():
    from grpo.algo.presets import preset_values
    from grpo.config import AlgoConfig

    options = {f.name for f in dataclasses.fields(AlgoConfig)}
    for name in PRESETS:
        assert set(preset_values(name)) <= options, name


def test_traps_flag_only_what_was_set_on_purpose_however_the_config_is_built():
    from grpo.config import AlgoConfig
    from grpo.validate import traps

    assert traps(Config(algo=AlgoConfig(preset="dapo"))) == []  # dapo's clip-higher comes with the preset
    assert [m for m in traps(Config(algo=AlgoConfig(preset="dapo", clip_high=0.28))) if "algo.clip_high set" in m]
    assert [m for m in traps(load_config(None, ["algo.preset=dapo", "algo.clip_high=0.28"]))
            if "algo.clip_high set" in m]


def test_each_run_validates_its_config_once(monkeypatch):
    import warnings

    import grpo.cli
    import grpo.trainer
    import grpo.validate

    calls = []
    real = grpo.validate.validate
    monkeypatch.setattr(grpo.validate, "validate", lambda *a, **k: calls.append(1) or real(*a, **k))

    class Stop(ConfigError):
        pass

    def stop(*_):  # train() has validated (its first step) and goes on to build: stop it there
        raise Stop("stopped after validation")

    monkeypatch.setattr(grpo.trainer, "check_installed", stop)
    cfg = load_config()
    with pytest.raises(Stop):
        grpo.trainer.train(cfg)
    assert len(calls) == 1  # at load, not again in train()
    cfg.train.steps = 5     # changed since it was loaded, or built in Python: train() validates it
    with pytest.raises(Stop):
        grpo.trainer.train(cfg)
    with pytest.raises(Stop):
        grpo.trainer.train(Config())
    assert len(calls) == 3
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main() sets them: restored after
    monkeypatch.setattr(grpo.cli.threading, "excepthook", grpo.cli.threading.excepthook)
    for command in ("eval", "sample"):
        monkeypatch.setattr(grpo.cli, f"_{command}", lambda cfg, args: 0)
    for command, status in (("train", 2), ("eval", 0), ("sample", 0)):
        calls.clear()
        assert grpo.cli.main([command, "train.steps=3"]) == status
        assert len(calls) == 1, command


def test_help_and_docs_list_the_names_registered(monkeypatch, capsys):
    import runpy

    import grpo.cli
    import grpo.validate
    from grpo.config import options

    for key, _, f in options():  # every option that takes a registry's names shows them
        if "names" in f.metadata:
            assert f.metadata["names"] in grpo.validate.registry_names() and "{names}" in f.metadata["help"], key
    monkeypatch.setitem(grpo.validate.BACKENDS, "my_engine", grpo.validate.BACKENDS["hf"])
    monkeypatch.setitem(grpo.validate.ENVIRONMENTS, "my_env", grpo.validate.ENVIRONMENTS["single_turn"])
    monkeypatch.setitem(grpo.validate.TOOL_PARSERS, "my_format", grpo.validate.TOOL_PARSERS["qwen"])
    monkeypatch.setitem(grpo.validate.TOOLS, "my_tool", grpo.validate.TOOLS["calculator"])
    monkeypatch.setitem(grpo.validate.REWARDS, "my_reward", grpo.validate.REWARDS["last_number"])
    with pytest.raises(SystemExit):
        grpo.cli.main(["train", "--help"])
    text = capsys.readouterr().out
    docs = runpy.run_path(str(CONFIG_DIR.parents[1] / "scripts" / "gen_config_docs.py"))["render"]()
    for shown in (text, docs):
        assert "a name in grpo.rollout.BACKENDS ('hf', 'vllm', 'vllm_server', 'my_engine')" in shown
        assert "('single_turn', 'tools', 'my_env')" in shown
        assert "('qwen', 'pythonic', 'my_format'; register_parser adds one)" in shown
        assert "built-in ('calculator', 'python', 'my_tool')" in shown
        assert "'final_number', 'code', 'my_reward') or 'module:function'" in shown
    assert "the rollout backends registered" in describe_options()  # without the registries: named, not listed


@pytest.mark.parametrize("path, reason", [
    ("./x", "it starts with './'"), ("../x", "it starts with '../'"), ("/no/such/model", "it starts with '/'"),
    ("~/no-such-model", "it starts with '~'"), ("x/", "it ends with '/'"),
    ("a/b/c", "it has more than one '/', which a Hub id (name or org/name) never has"),
    ("my-models/x", "its first part, 'my-models', is a directory here"),
])
def test_a_local_looking_model_path_that_does_not_exist_fails_at_load(path, reason, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-models").mkdir()
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.path={path}"])
    assert str(e.value) == (f"model.path {path!r} does not exist ({reason}, so it names a local directory, not a "
                            "Hugging Face Hub id)")


def test_hub_ids_and_existing_directories_pass_the_model_path_check(tmp_path, monkeypatch):
    from grpo.models import local_path_reason
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-models" / "x").mkdir(parents=True)
    for path in ["org/name", "gpt2", "tiny", "smollm2-135m-instruct", "my-models/x", "./my-models/x",
                 str(tmp_path / "my-models" / "x")]:
        assert load_config(None, [f"model.path={path}"]).model.path == path
    assert local_path_reason("org/name") is None and local_path_reason("gpt2") is None
    assert local_path_reason("my-models/y") is not None  # its first part exists here: a local path


def test_a_reward_models_local_looking_path_that_does_not_exist_fails_at_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rewards=[rm:./no-such-rm]"])
    assert str(e.value) == ("rewards: 'rm:./no-such-rm' does not exist (it starts with './', so it names a local "
                            "directory, not a Hugging Face Hub id)")
    with pytest.raises(ConfigError, match="^eval.rewards: 'rm:a/b/c' does not exist"):
        load_config(None, ["eval.rewards=[rm:a/b/c]"])
