"""Reward models as rewards (`rm:<path>`): one label, their own tokenizer and chat template, batched, never
trained; the scores are the head's logits, equal to the model's own forward pass; bad models are one line."""
import pytest
import torch
import transformers

from grpo.config import RewardModelConfig
from grpo.errors import ConfigError
from grpo.rewards import build_rewards, recorded_name, resolve_reward, score
from grpo.rewards.model import RewardModel
from grpo.tiny import build_char_tokenizer, tiny_model_config

PROMPTS = ["Calculate 2 + 2 * 6 =", "Calculate 1 + 1 =", "Solve y = 2x + 1 for x = 2, y =", "Calculate 9 - 3 ="]
COMPLETIONS = [" 2 * 6 = 12, 2 + 12 = 14", " 2", " 2 * 2 = 4, 4 + 1 = 5", ""]  # within the model's 64 positions


def _save(path, num_labels=1, template=None):
    tok = build_char_tokenizer()
    if template:
        tok.chat_template = template
    cfg = tiny_model_config(tok, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)
    cfg.num_labels = num_labels
    torch.manual_seed(0)
    model = transformers.Qwen2ForSequenceClassification(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("rm") / "my-rm")


def test_scores_are_the_heads_logit_of_prompt_and_completion_in_any_batch(rm_dir):
    rm = resolve_reward(f"rm:{rm_dir}", reward_model=RewardModelConfig(batch_size=3))
    got = rm(prompts=PROMPTS, completions=COMPLETIONS, answer=["14", "2", "5", "6"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(rm_dir)
    with torch.no_grad():  # one text at a time, no padding at all
        want = [model(**tok(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(PROMPTS, COMPLETIONS)]
    assert got == pytest.approx(want, abs=1e-5)
    one_batch = RewardModel(str(rm_dir), RewardModelConfig(batch_size=64))(prompts=PROMPTS, completions=COMPLETIONS)
    assert one_batch == pytest.approx(got, abs=1e-5) and len(set(got)) == 4


def test_it_is_never_trained_and_is_named_by_its_directory(rm_dir):
    ((name, rm),) = build_rewards([f"rm:{rm_dir}"])  # loaded as the trainer builds it
    assert name == "my-rm" and rm.model is not None and not rm.model.training
    assert not any(p.requires_grad for p in rm.model.parameters())
    assert recorded_name(rm) == f"rm:{rm_dir}"  # what the run's config.yaml says
    s = score([(name, rm)], None, PROMPTS, COMPLETIONS, {})
    assert list(s.per_fn) == ["my-rm"] and torch.isfinite(s.total).all()


def test_its_own_chat_template_renders_the_prompt_and_the_episode(tmp_path):
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}")
    rm = RewardModel(str(_save(tmp_path / "chat", template=template))).load()
    assert rm.texts(["2 + 2 ="], [" 4"]) == ["<|user|>2 + 2 =<|endoftext|><|assistant|> 4<|endoftext|>"]
    episode = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "t"}, {"role": "assistant", "content": "b"}]]
    assert rm.texts(["q"], ["ab"], messages=episode) == [
        "<|user|>q<|endoftext|><|assistant|>a<|endoftext|><|tool|>t<|endoftext|><|assistant|>b<|endoftext|>"]
    assert len(rm(prompts=["q"], completions=["ab"], messages=episode)) == 1


def test_a_long_input_keeps_its_end(rm_dir):
    rm = resolve_reward(f"rm:{rm_dir}", reward_model=RewardModelConfig(max_length=8)).load()
    text = PROMPTS[0] + COMPLETIONS[0]
    with torch.no_grad():
        last8 = rm.model(**rm.tokenizer(text[-8:], return_tensors="pt")).logits[0, 0].item()
    assert rm(prompts=PROMPTS[:1], completions=COMPLETIONS[:1]) == pytest.approx([last8], abs=1e-5)


def test_bf16_and_options(rm_dir):
    rm = resolve_reward(f"rm:{rm_dir}", reward_model=RewardModelConfig(bf16=True, max_length=8)).load()
    assert next(rm.model.parameters()).dtype == torch.bfloat16
    assert all(isinstance(v, float) for v in rm(prompts=PROMPTS, completions=COMPLETIONS))


@pytest.mark.parametrize("kind, says", [
    ("labels", "has 2 labels; a reward model has one"),
    ("pad", "its tokenizer has no padding token"),
    ("missing", "does not exist"),
])
def test_a_model_that_cannot_score_is_one_line(tmp_path, kind, says, monkeypatch):
    path = {"labels": lambda: _save(tmp_path / "two", num_labels=2), "pad": lambda: _save(tmp_path / "nopad"),
            "missing": lambda: tmp_path / "no" / "such" / "rm"}[kind]()
    if kind == "pad":  # this tokenizer backend fills a default pad token in: one without, as loaded
        load = transformers.AutoTokenizer.from_pretrained

        def without_pad(*a, **kw):
            tok = load(*a, **kw)
            tok.pad_token = None
            return tok

        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", without_pad)
    with pytest.raises(ConfigError, match=says) as e:
        build_rewards([f"rm:{path}"])
    assert str(e.value).startswith(f"rewards: rm:{path}") and "\n" not in str(e.value)


def test_a_reward_model_cannot_decide_correctness_and_needs_a_path():
    with pytest.raises(ConfigError, match="eval.reward: 'rm:x' is a reward model"):
        resolve_reward("rm:x", field="eval.reward")
    with pytest.raises(ConfigError, match="names no reward model"):
        resolve_reward("rm:")


def test_grpo_eval_reports_a_reward_models_mean_score(rm_dir, random_model_dir, grpo_cli):
    import json
    r = grpo_cli("eval", f"model.path={random_model_dir}", "eval.size=4", "eval.pass_k=0", "rollout.max_new_tokens=4",
                 f"eval.rewards=[rm:{rm_dir}]")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["examples"] == 4 and isinstance(got["eval/reward/my-rm"], float)


@pytest.mark.parametrize("device, says", [("gpu", "is not a device"), ("cuda:1", "PyTorch sees no CUDA device")])
def test_a_reward_model_device_that_cannot_be_is_one_line(device, says):
    from grpo.config import load_config
    if torch.cuda.is_available() and device == "cuda:1":
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=says):
        load_config(None, ["rewards=[rm:x]", f"reward_model.device={device}"])


def test_a_failed_build_stops_what_a_reward_started(random_model_dir, tmp_path, monkeypatch):
    import grpo.trainer as trainer
    from grpo.config import load_config

    class Holder:
        """A reward holding a process of its own (as a launched judge does)."""
        __name__ = "holder"
        closed = 0

        def __call__(self, prompts, completions, **_):
            return [0.0] * len(completions)

        def close(self):
            Holder.closed += 1

    def broken(*a, **kw):
        raise DataError("the engine could not start")

    from grpo.errors import DataError
    monkeypatch.setattr(trainer, "build_generator", broken)  # after the rewards are built and probed
    cfg = load_config(None, [f"model.path={random_model_dir}", f"train.output_dir={tmp_path / 'r'}", "train.steps=1"])
    with pytest.raises(DataError, match="the engine could not start"):
        trainer.train(cfg, rewards=[Holder()])
    assert Holder.closed == 1
