"""The Python entry points (grpo.train, GRPOTrainer): the config in each of its forms, objects in (a loaded model,
data sets in memory), TRL's data conventions (conversational prompts, every column under its own name), and two
short runs on the bundled tiny model: TRL's quickstart, ported, and a conversational run from a model object."""
import json
from dataclasses import replace

import pytest
import yaml

datasets = pytest.importorskip("datasets")

import grpo  # noqa: E402
from grpo.api import as_config, sort_rewards  # noqa: E402
from grpo.config import Config, ModelConfig  # noqa: E402
from grpo.errors import ConfigError, DataError  # noqa: E402
from grpo.evaluation import _correct  # noqa: E402
from grpo.rewards import example_fields, last_number, score  # noqa: E402
from grpo.tasks.base import Example  # noqa: E402
from grpo.tiny import TINY_MODEL_DIR  # noqa: E402

FAST = {"train.steps": 2, "train.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 6,
        "algo.dynamic_sampling": False, "eval.pass_k": 0, "log.progress": False, "log.trackers": [],
        "log.chart": False}
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


# ------------------------------------------------------------------------------------------------ the config

def test_config_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # shipped names resolve from any working directory
    job = as_config(None)
    assert job == grpo.load_config("tiny") and job.train.output_dir == "runs/tiny" and job.algo.dynamic_sampling
    assert grpo.load_config("presets/dapo").algo.preset == "dapo"
    # a dict: settings over the default job, dotted or nested, Python values (a dict value stays whole)
    cfg = as_config({"train.steps": 20, "rollout": {"group_size": 4},
                     "model.chat_template_kwargs": {"enable_thinking": False}})
    assert (cfg.train.steps, cfg.rollout.group_size, cfg.train.output_dir) == (20, 4, "runs/tiny")
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False}
    own = tmp_path / "mine.yaml"
    own.write_text("train:\n  steps: 7\n")
    assert as_config(str(own)).train.steps == 7 and as_config(own).rollout.group_size == Config().rollout.group_size
    assert as_config(cfg) is cfg
    with pytest.raises(ConfigError, match=r"config file 'nope' does not exist, and no shipped config .*tiny"):
        as_config("nope")
    with pytest.raises(ConfigError, match=r"unknown key 'train.learnin_rate'"):
        as_config({"train.learnin_rate": 1e-6})

    class GRPOConfig:  # TRL's, by its name
        pass
    with pytest.raises(ConfigError, match="config is a TRL GRPOConfig; give grpo's config"):
        as_config(GRPOConfig())


def test_a_model_object_in_the_config_is_refused_by_name():
    import torch
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"model.path must be a str .*got a Linear object; pass objects to "
                                          r"grpo.train\(model=..."):
        as_config({"model.path": model})
    with pytest.raises(ConfigError, match=r"model.path must be a path or a name \(a str\), got a Linear object; "
                                          r"pass .* grpo.train\(model=...\)"):
        grpo.train(Config(model=ModelConfig(path=model)))
    with pytest.raises(ConfigError, match=r"model.chat_template_kwargs must be a mapping"):
        as_config({"model.chat_template_kwargs": ["enable_thinking"]})


def test_paths_given_as_objects_go_into_the_config():
    from grpo.trainer import Given, _given
    cfg, given = _given(Config(), Given(model="my-models/x", train_dataset="train.jsonl", eval_dataset="test.jsonl"))
    assert (cfg.model.path, cfg.data.path, cfg.data.eval_path) == ("my-models/x", "train.jsonl", "test.jsonl")
    assert given == Given()
    rows = [{"prompt": "q"}]
    cfg, given = _given(Config(), Given(train_dataset=rows))
    assert cfg.data.given == ["train_dataset"] and given.train_dataset is rows  # marked in the run's config
    assert replace(cfg, data=replace(cfg.data, given=[])) == Config()
    # a config so marked (a run's config.yaml) needs the data given again, or files in its place
    with pytest.raises(ConfigError, match=r"data.given: this config's run was given train_dataset as an object to "
                                          r"grpo.train.*give it again \(grpo.train\(train_dataset=...\)\), or set "
                                          r"data.path"):
        _given(cfg, Given())
    assert _given(replace(cfg, data=replace(cfg.data, path="t.jsonl")), Given())[0].data.given == []
    with pytest.raises(ConfigError, match="eval_dataset is given without training data"):
        _given(Config(), Given(eval_dataset=rows))
    with pytest.raises(ConfigError, match="eval_dataset is given, and so is data.eval_split or data.eval_fraction"):
        _given(as_config({"data.eval_fraction": 0.1}), Given(train_dataset=rows, eval_dataset=rows))


def test_a_yaml_config_may_name_a_python_reward_in_eval_reward(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("eval:\n  reward: accuracy_reward\nrollout:\n  min_new_tokens: 64\n  max_new_tokens: 8\n")

    def accuracy_reward(completions, **kwargs):
        return [0.0] * len(completions)
    assert as_config(job).eval.reward == "accuracy_reward"  # validated by train, which knows the function
    for run in (lambda: grpo.train(str(job), rewards=[accuracy_reward]),
                lambda: grpo.GRPOTrainer("tiny", accuracy_reward, args=str(job)).train()):
        with pytest.raises(ConfigError, match="rollout.min_new_tokens=64 is more than"):  # past eval.reward
            run()


def test_old_keyword_single_tool_and_a_model_object_whose_directory_is_gone():
    with pytest.raises(ConfigError, match="model.path './my-models/gone' does not exist"):
        grpo.train(cfg={"model.path": "./my-models/gone"})  # train(cfg=...) as before it took objects
    with pytest.raises(ConfigError, match="give config .*not both"):
        grpo.train("tiny", cfg="tiny")
    from grpo.trainer import Given
    from grpo.validate import validate

    cfg = as_config({"model.path": "./my-models/gone"})  # a loaded model's name_or_path: a directory since removed
    validate(cfg, given=Given(model=object()))
    with pytest.raises(ConfigError, match="does not exist"):
        validate(cfg)


def test_a_trap_is_warned_of_once_when_train_copies_the_config(recwarn):
    import warnings

    from grpo.trainer import Given, _given
    from grpo.validate import carry_validation, validate_once

    with pytest.warns(UserWarning, match="rollout.repetition_penalty"):
        cfg = grpo.load_config("tiny", ["rollout.repetition_penalty=1.1"])
    new, _ = _given(cfg, Given(train_dataset=[{"prompt": "q"}]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate_once(carry_validation(cfg, new))
    assert [str(w.message) for w in caught] == []
    with pytest.warns(UserWarning, match="rollout.repetition_penalty"):
        validate_once(_given(cfg, Given(train_dataset=[{"prompt": "q"}]))[0])  # not carried: warned again


def test_a_peft_config_sets_the_lora_section():
    peft = pytest.importorskip("peft")
    trainer = grpo.GRPOTrainer("tiny", peft_config=peft.LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0,
                                                                    target_modules=["q_proj", "v_proj"]))
    lora = trainer.config.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 32.0, 0.0, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="peft_config must be a peft LoraConfig"):
        grpo.GRPOTrainer("tiny", peft_config=object())


def test_rewards_names_and_functions():
    cfg = Config()
    assert sort_rewards(cfg, ["math", "format"]) == (Config(rewards=["math", "format"]), None)

    def mine(completions, **kw):
        return [0.0] * len(completions)
    assert sort_rewards(cfg, mine) == (cfg, [mine])                      # one function alone, as TRL's reward_funcs
    assert sort_rewards(cfg, ["last_number", mine])[1] == [last_number, mine]
    with pytest.raises(ConfigError, match=r"'judge' beside Python functions"):
        sort_rewards(cfg, ["judge", mine])
    with pytest.raises(ConfigError, match="rewards must be functions or reward names, got a int"):
        sort_rewards(cfg, [3])


# ------------------------------------------------------------------------------------------ TRL's data conventions

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 4?"}]


def test_conversational_prompts_reach_your_rewards_as_trl_gives_them():
    examples = [Example("3 + 4?", "7", {"solution": "7"}, CHAT)]  # data.answer_column=solution
    seen = {}

    def accuracy_reward(prompts, completions, solution, **kwargs):  # TRL's shape
        seen.update(prompts=prompts, completions=completions)
        return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]

    fields = example_fields(examples, 2)
    scores = score([accuracy_reward, last_number], None, ["3 + 4?"] * 2, [" 7", " 8"], fields)
    assert seen == {"prompts": [CHAT, CHAT], "completions": [[{"role": "assistant", "content": " 7"}],
                                                             [{"role": "assistant", "content": " 8"}]]}
    assert scores.per_fn["accuracy_reward"].tolist() == [1.0, 0.0]
    assert scores.per_fn["last_number"].tolist() == [1.0, 0.0]            # grpo's own rewards take the text
    # last_number needs an answer, which examples without an answer column lack: one clear line
    bare = [Example("3 + 4?", None, {"solution": "7"}, CHAT)]
    with pytest.raises(DataError, match=r"reward function 'last_number' needs 'answer', which the examples lack "
                                        r"\(the data has no answer column: data.answer_column names it.*solution"):
        score([last_number], None, ["3 + 4?"], [" 7"], example_fields(bare))


def test_eval_accuracy_from_a_reward_and_its_threshold():
    examples = [Example("q", "7", {"solution": "7"})]

    def partial(completions, solution, **kwargs):  # 0.5 for a near miss
        return [1.0 if c.strip() == s else 0.5 for c, s in zip(completions, solution)]
    assert _correct(partial, examples, [" 8", " 7"], 2).tolist() == [[False, True]]
    assert _correct(partial, examples, [" 8", " 7"], 2, threshold=0.5).tolist() == [[True, True]]

    def needs(completions, gold, **kwargs):
        return [1.0] * len(completions)
    with pytest.raises(DataError, match=r"eval.reward reward function 'needs' needs 'gold'.*; set eval.reward to a "):
        _correct(needs, examples, [" 7"], 1)


def test_chat_template_and_its_kwargs_render_a_conversation():
    from transformers import AutoTokenizer

    from grpo.envs import prompt_formatter
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tok.chat_template = None
    with pytest.raises(DataError, match=r"the prompts are conversations .* this tokenizer has none"):
        prompt_formatter(tok, ModelConfig())(CHAT)
    tok.chat_template = TEMPLATE
    plain = prompt_formatter(tok, ModelConfig(system_prompt="ignored: the conversation has one"))
    assert plain(CHAT) == "system: Be brief.\nuser: 3 + 4?\nassistant:"
    assert plain("3 + 4?") == "3 + 4?"                               # a text prompt: as is, chat_template off
    quiet = prompt_formatter(tok, ModelConfig(chat_template=True, chat_template_kwargs={"enable_thinking": False}))
    assert quiet(CHAT) == "system: Be brief.\nuser: 3 + 4?\n/no_think\nassistant:"
    assert quiet("3 + 4?") == "user: 3 + 4?\n/no_think\nassistant:"


def test_a_conversation_ending_with_an_assistant_message_gets_a_new_assistant_turn():
    """As TRL 1.16's GRPOTrainer renders its prompts (`_tokenize_prompts`: add_generation_prompt=True whatever the
    last role): the assistant message is closed and the model answers in a turn of its own, not continuing it."""
    from transformers import AutoTokenizer

    from grpo.envs import prompt_formatter
    from grpo.tiny import TINY_TOOLS_DIR
    tok = AutoTokenizer.from_pretrained(TINY_TOOLS_DIR)
    chat = [{"role": "user", "content": "3 + 4?"}, {"role": "assistant", "content": "Let me think."}]
    assert prompt_formatter(tok, ModelConfig())(chat) == \
        "<|user|>3 + 4?<|endoftext|><|assistant|>Let me think.<|endoftext|><|assistant|>"


def test_the_tools_environment_passes_chat_template_kwargs(monkeypatch):
    from transformers import AutoTokenizer

    from grpo.envs.tool_calls import load_tools
    from grpo.envs.tools import ToolEnvironment
    from grpo.tiny import TINY_TOOLS_DIR
    tok = AutoTokenizer.from_pretrained(TINY_TOOLS_DIR)
    env = ToolEnvironment(tok, load_tools(["calculator"]), "qwen", pad_id=tok.pad_token_id, context=128,
                          chat_template_kwargs={"enable_thinking": False})
    seen, real = [], tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: seen.append(k) or real(*a, **k))
    assert "hi" in env._render([{"role": "user", "content": "hi"}], True)
    assert seen[-1]["enable_thinking"] is False and seen[-1]["add_generation_prompt"] is True


# ------------------------------------------------------------------------------------------------ short runs

def test_trl_quickstart_ported(tmp_path):
    """docs/from-trl.md, "The quickstart, ported", on the bundled model and a local dataset (a few steps)."""
    from datasets import Dataset

    dataset = Dataset.from_list([{"prompt": f"Calculate {a} + {b} =", "solution": str(a + b)}
                                 for a in range(10) for b in range(10)])

    def accuracy_reward(completions, solution, **kwargs):
        return [1.0 if c.split()[:1] == [s] else 0.0 for c, s in zip(completions, solution)]

    trainer = grpo.GRPOTrainer(model="tiny", reward_funcs=accuracy_reward, train_dataset=dataset,
                               args={**FAST, "train.output_dir": str(tmp_path / "run")})
    result = trainer.train()
    assert result.steps_done == 2 and len([h for h in result.history if "reward/mean" in h]) == 2
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()
    assert 0.0 <= result.history[-1]["reward/accuracy_reward"] <= 1.0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    (recorded,) = saved["rewards"]  # 'module:qualname'
    assert recorded.endswith("test_api:test_trl_quickstart_ported.<locals>.accuracy_reward")
    assert saved["data"]["prompt_column"] == "prompt"


def test_a_model_object_with_conversational_data(tmp_path):
    """A loaded model, its tokenizer as processing_class (with a chat template), conversational rows as a list of
    dicts, evaluation accuracy from the Python reward: the reward sees TRL's forms, the run saves the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    tok.chat_template = TEMPLATE
    rows = [{"prompt": [{"role": "user", "content": f"Calculate {a} * 2 ="}], "solution": str(2 * a)}
            for a in range(12)]
    seen = []

    def solved(prompts, completions, solution, **kwargs):
        seen.append((prompts[0], completions[0]))
        return [1.0 if c[0]["content"].strip() == s else 0.0 for c, s in zip(completions, solution)]

    result = grpo.train({**FAST, "train.output_dir": str(tmp_path / "run"), "eval.reward": "solved"},
                        model=model, processing_class=tok, train_dataset=rows, eval_dataset=rows[:4],
                        rewards=[solved])
    prompt, completion = seen[-1]
    assert prompt[0]["role"] == "user" and prompt[0]["content"].startswith("Calculate")
    assert list(completion[0]) == ["role", "content"] and completion[0]["role"] == "assistant"
    assert set(result.final_eval) >= {"eval/accuracy", "eval/mean_length"} and result.steps_done == 2
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert text.startswith("# model: a Qwen2ForCausalLM object given to grpo.train(model=...)")
    assert "# train_dataset: a list of 12 rows" in text
    saved = yaml.safe_load(text)
    assert saved["model"]["path"] == str(TINY_MODEL_DIR)
    assert saved["model"]["chat_template"] is True  # conversations: grpo eval/sample RUN_DIR render them as trained
    assert saved["data"]["given"] == ["train_dataset", "eval_dataset"] and saved["data"]["path"] == ""
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "a data set given to `grpo.train` in Python" in card and "built-in task" not in card
    assert saved["eval"]["reward"].endswith("test_a_model_object_with_conversational_data.<locals>.solved")
    assert json.loads((tmp_path / "run" / "model" / "tokenizer_config.json").read_text())  # the tokenizer saved
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def test_an_eval_reward_the_data_cannot_feed_fails_before_the_first_step(tmp_path):
    rows = [{"prompt": f"Calculate {a} + 1 =", "solution": str(a + 1)} for a in range(6)]  # no answer column

    def zero(completions, **kwargs):
        return [0.0] * len(completions)
    with pytest.raises(DataError, match=r"eval.reward reward function 'last_number' needs 'answer', which the "
                                        r"examples lack .*fields are: solution; set eval.reward to"):
        grpo.train({**FAST, "train.output_dir": str(tmp_path / "run")}, model="tiny", train_dataset=rows,
                   eval_dataset=rows[:2], rewards=[zero])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match=r"train_dataset is given, and the config sets data.path=x.jsonl"):
        grpo.train({"data.path": "x.jsonl"}, train_dataset=rows, rewards=[zero])


EPISODES: list = []


def solved_episode(prompts, completions, messages, turn_ends, answer, **kwargs):
    """An eval.reward of a multi-turn environment: it reads the episodes' messages (as evaluation gives them)."""
    EPISODES.append((messages, turn_ends))
    return [1.0 if m[-1]["content"].strip().endswith(str(a)) else 0.0 for m, a in zip(messages, answer)]


def test_a_multi_turn_eval_reward_gets_the_episodes(tmp_path):
    """An eval.reward that takes the episodes' `messages` and `turn_ends` is not refused when the run is built:
    evaluation gives them (tool episodes on the bundled tiny-tools model, one step)."""
    from grpo.config import load_config
    EPISODES.clear()
    cfg = load_config("tiny_tools", ["train.steps=1", "train.prompts_per_step=2", "rollout.group_size=2",
                                     "eval.size=2", "eval.pass_k=0", "eval.every=0", "eval.reward=test_api:solved_episode",
                                     *[f"{k}={str(v).lower()}" for k, v in FAST.items() if k.startswith("log.")],
                                     f"train.output_dir={tmp_path / 'run'}"])
    result = grpo.train(cfg)
    assert result.steps_done == 1 and 0.0 <= result.final_eval["eval/accuracy"] <= 1.0
    messages, turn_ends = EPISODES[-1]
    assert len(messages) == len(turn_ends) == 2 and messages[0][-1]["role"] == "assistant"
    assert all(len(t) >= 1 for t in turn_ends)
