"""A user's environments, rollout backends and tools: named in the config by 'module:Name' or given to
`build_environment` as objects (the Python API's `tools=` and `environment=`), checked at load with one line
naming the field; `Rollout.from_tokens`; the environment contract as every caller calls it (evaluation
included); and the example environment of docs/examples, episode by episode."""
import sys
from pathlib import Path

import pytest
import torch
import transformers

from grpo.config import Config, load_config
from grpo.envs import SingleTurn, build_environment, environment_name, resolve_environment, tool_names
from grpo.envs.tools import ToolEnvironment
from grpo.errors import ConfigError
from grpo.evaluation import evaluate
from grpo.imports import call_builder
from grpo.rewards import resolve_reward
from grpo.rollout import HFGenerator, Rollout, Sampling, build_generator, resolve_backend
from grpo.tasks import Example
from grpo.tiny import build_char_tokenizer, build_tool_tokenizer, tiny_model_config

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))
from guess_env import GuessNumber  # noqa: E402  (docs/examples/guess_env.py, the file the docs show)

CHAR = build_char_tokenizer()
TOOL_TOK = build_tool_tokenizer()
HERE = "test_custom_env"


# ---------------------------------------------------------------------------------------------------------
# things a config names (module:Name), importable from this module

class Echo:
    """An environment written as the docs say: rollout's four arguments, `seeds` without a default."""

    calls: list = []

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def rollout(self, generator, examples, sampling, seeds):
        Echo.calls.append((sampling.temperature, list(seeds)))
        return generator.generate([e.prompt for e in examples], sampling, seeds)


class ToolUser:
    def __init__(self, tools, cfg):
        self.tools, self.cfg = tools, cfg

    def rollout(self, generator, examples, sampling, seeds):
        raise NotImplementedError


def make_echo(tokenizer, **kw):
    return Echo(tokenizer)


ECHO = Echo(CHAR)  # an Environment object


def not_an_env():
    return 42


class NoRollout:
    pass


NUMBER = 3


class Fixed:
    """A rollout backend of one's own: every completion is `text` and EOS."""

    def __init__(self, tokenizer, cfg, text: str = "7"):
        self.tokenizer, self.text, self.cfg = tokenizer, text, cfg
        self.synced = 0

    def generate(self, prompts, sampling, seeds=None, limits=None):
        ids = [p if not isinstance(p, str) else self.tokenizer(p, add_special_tokens=False)["input_ids"]
               for p in prompts]
        done = self.tokenizer(self.text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        rows = [p for p in ids for _ in range(sampling.n)]
        return Rollout.from_tokens(rows, [done] * len(rows), pad_id=self.tokenizer.pad_token_id,
                                   tokenizer=self.tokenizer, version=self.version)

    def sync_weights(self, model, version=None):
        self.synced += 1

    def close(self):
        pass


class HalfBackend:
    def generate(self, prompts, sampling, seeds=None, limits=None): ...


def lookup(key: str) -> str:
    """Look a word up.

    Args:
        key: The word.
    """
    return key.upper()


def model(tok=CHAR, positions=64):
    cfg = tiny_model_config(tok, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=positions)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny():
    return model()


# ---------------------------------------------------------------------------------------------------------
# the config: module:Name, checked at load

def test_module_names_load_and_build(tiny):
    cfg = load_config(None, [f"rollout.environment={HERE}:Echo", f"rollout.backend={HERE}:Fixed"])
    env = build_environment(tiny, CHAR, cfg)
    assert isinstance(env, Echo) and env.tokenizer is CHAR
    gen = build_generator(tiny, CHAR, cfg)
    assert isinstance(gen, Fixed) and gen.cfg is cfg and gen.version == 0  # version set where the class has none
    r = env.rollout(gen, [Example("1+2=", "3")], Sampling(2, 8), [5])
    assert r.texts == ["7", "7"] and r.completion_ids.shape == (2, 2)
    # a factory and a module-level object work too; the object is used as it is
    assert isinstance(build_environment(tiny, CHAR, load_config(None, [f"rollout.environment={HERE}:make_echo"])), Echo)
    assert build_environment(tiny, CHAR, load_config(None, [f"rollout.environment={HERE}:ECHO"])) is ECHO


@pytest.mark.parametrize("key, value, message", [
    ("rollout.environment", "nope", "rollout.environment='nope' is not an environment; choose one of 'single_turn', "
                                    "'tools', or give an importable 'module:Name'"),
    ("rollout.environment", "no_such_module_x:Env", "rollout.environment: cannot import environment "
                                                   "'no_such_module_x:Env': ModuleNotFoundError"),
    ("rollout.environment", f"{HERE}:Missing", f"rollout.environment: cannot import environment '{HERE}:Missing': "
                                               f"{HERE} has no 'Missing'"),
    ("rollout.environment", f"{HERE}:NoRollout", "is a class without a rollout method"),
    ("rollout.environment", f"{HERE}:NUMBER", "is a int, not an environment"),
    ("rollout.environment", f"'{HERE}:'", "is not of the form 'module:Name'"),
    ("rollout.backend", "sglang", "rollout.backend='sglang' is not a rollout backend; choose one of 'hf', 'vllm', "
                                  "'vllm_server', or give an importable 'module:Name'"),
    ("rollout.backend", f"{HERE}:HalfBackend", f"rollout.backend: '{HERE}:HalfBackend' is a class without "
                                               "sync_weights, close"),
    ("rollout.backend", f"{HERE}:NUMBER", "is a int, not a Generator class"),
    ("rollout.backend", "no_such_module_x:G", "rollout.backend: cannot import rollout backend"),
])
def test_bad_names_are_one_line_naming_the_field(key, value, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_module_that_raises_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_env_mod.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"rollout.environment: cannot import environment "
                                          r"'broken_env_mod:Env': RuntimeError: boom"):
        load_config(None, ["rollout.environment=broken_env_mod:Env"])


def test_what_a_factory_returns_and_takes_is_checked(tiny):
    with pytest.raises(ConfigError, match=r"rollout.environment: .*not_an_env returned a int, which has no rollout"):
        build_environment(tiny, CHAR, load_config(None, [f"rollout.environment={HERE}:not_an_env"]))

    def needs(tokenizer, secret):
        return Echo(tokenizer)
    with pytest.raises(ConfigError, match=r"environment: the environment .*needs takes 'secret', which grpo does not "
                                          r"give; it may take any of model, tokenizer, cfg, all_finished"):
        build_environment(tiny, CHAR, Config(), environment=needs)
    with pytest.raises(ConfigError, match="made a HalfBackend without sync_weights, close"):
        cfg = Config()
        cfg.rollout.backend = f"{HERE}:make_half"
        build_generator(tiny, CHAR, cfg)


def make_half():
    return HalfBackend()


def test_call_builder_gives_only_what_is_named():
    seen = {}

    def f(a, c=0, *, d):
        seen.update(a=a, c=c, d=d)
    call_builder(f, {"a": 1, "b": 2, "c": 3, "d": 4}, field="x", what="y")
    assert seen == {"a": 1, "c": 3, "d": 4}
    assert call_builder(lambda **kw: sorted(kw), {"a": 1, "b": 2}, field="x", what="y") == ["a", "b"]


def test_the_import_helper_is_the_rewards_one():
    assert resolve_reward(f"{HERE}:lookup", field="rewards") is lookup
    with pytest.raises(ConfigError, match="rewards: cannot import reward 'os:nope_fn'"):
        resolve_reward("os:nope_fn", field="rewards")
    assert resolve_environment("tools") == "tools" and resolve_backend("hf") == "hf"


# ---------------------------------------------------------------------------------------------------------
# the Python API: build_environment(..., tools=, environment=)

def test_environment_object_class_or_factory(tiny):
    cfg = Config()
    assert build_environment(tiny, CHAR, cfg, environment=ECHO) is ECHO
    assert cfg == Config()  # the caller's config is never changed: grpo.train records what ran in the run's
    assert environment_name(ECHO, ECHO) == f"{HERE}:Echo"
    env = build_environment(tiny, CHAR, Config(), environment=Echo)
    assert isinstance(env, Echo) and env is not ECHO
    env = build_environment(tiny, CHAR, cfg, environment=make_echo)
    assert isinstance(env, Echo) and environment_name(make_echo, env) == f"{HERE}:make_echo"
    make = lambda tokenizer: Echo(tokenizer)  # noqa: E731
    env = build_environment(tiny, CHAR, cfg, environment=make)
    assert environment_name(make, env) == f"{HERE}:Echo"  # a lambda has no name: what it made
    assert cfg == Config()
    with pytest.raises(ConfigError, match="environment: .*NoRollout is a class without a rollout method"):
        build_environment(tiny, CHAR, Config(), environment=NoRollout)
    with pytest.raises(ConfigError, match="environment='nope' is not an environment"):
        build_environment(tiny, CHAR, Config(), environment="nope")


def test_tools_make_a_tool_calling_run():
    """TRL's tools= means multi-turn tool calling: with the default single_turn the environment is `tools`, and
    the given tools (functions and names) replace tools.names; the config records them."""
    m = model(TOOL_TOK, 256)
    cfg = load_config(None, ["model.chat_template=true"])
    env = build_environment(m, TOOL_TOK, cfg, tools=[lookup, "calculator"])
    assert isinstance(env, ToolEnvironment) and list(env.tools) == ["lookup", "calculator"]
    assert env.tools["lookup"]({"key": "ab"}).content == "AB"
    assert cfg.rollout.environment == "single_turn"  # not changed: grpo.train records them (`_given`)
    names = tool_names([lookup, "calculator"])
    assert names == [f"{HERE}:lookup", "calculator"]
    # what the config records loads back and builds the same tools
    again = build_environment(m, TOOL_TOK, load_config(None, [f"{k}={v}" for k, v in {
        "model.chat_template": "true", "rollout.environment": "tools", "tools.names": names}.items()]))
    assert list(again.tools) == ["lookup", "calculator"]
    with pytest.raises(ConfigError, match="tools are given: tool calling renders episodes with the chat template"):
        build_environment(m, TOOL_TOK, Config(), tools=[lookup])
    with pytest.raises(ConfigError, match="tools: 'nope' is not a tool|tools: unknown tool 'nope'"):
        build_environment(m, TOOL_TOK, load_config(None, ["model.chat_template=true"]), tools=["nope"])
    with pytest.raises(ConfigError, match="tools: 3 is not a tool"):
        build_environment(m, TOOL_TOK, load_config(None, ["model.chat_template=true"]), tools=[3])


def test_tools_reach_a_custom_environment_that_takes_them(tiny):
    env = build_environment(tiny, CHAR, Config(), tools=[lookup], environment=ToolUser)
    assert list(env.tools) == ["lookup"] and isinstance(env.cfg, Config)
    env = build_environment(tiny, CHAR, load_config(None, [f"rollout.environment={HERE}:ToolUser"]))
    assert list(env.tools) == ["calculator"]  # tools.names's, when the API gives none
    with pytest.raises(ConfigError, match="tools are given, and the environment .*Echo takes no tools parameter"):
        build_environment(tiny, CHAR, Config(), tools=[lookup], environment=Echo)
    with pytest.raises(ConfigError, match="tools are given with an environment object"):
        build_environment(tiny, CHAR, Config(), tools=[lookup], environment=ECHO)


def test_no_arguments_keep_the_configured_environment(tiny):
    cfg = Config()
    assert isinstance(build_environment(tiny, CHAR, cfg), SingleTurn)
    assert cfg.rollout.environment == "single_turn" and cfg.tools.names == ["calculator"]


# ---------------------------------------------------------------------------------------------------------
# Rollout.from_tokens

def test_from_tokens_pads_like_the_built_in_generator(tiny):
    prompts = [[5, 6, 7], [8]]
    completions = [[9, 10, 1], [11, 12, 13, 14]]
    r = Rollout.from_tokens(prompts, completions, pad_id=0, truncated=[False, True], tokenizer=CHAR,
                            loss_masks=[[1, 1, 1], [1, 0, 0, 1]], logprobs=[[-1.0, -2.0, -3.0], [-.5, 0, 0, -.25]],
                            version=4)
    assert r.prompt_ids.tolist() == [[5, 6, 7], [0, 0, 8]] and r.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert r.completion_ids.tolist() == [[9, 10, 1, 0], [11, 12, 13, 14]]
    assert r.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert r.loss_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 1]]
    assert r.sampler_logp.tolist() == [[-1.0, -2.0, -3.0, 0.0], [-.5, 0, 0, -.25]]
    assert r.lengths.tolist() == [3, 4] and r.truncated.tolist() == [False, True] and r.version.tolist() == [4, 4]
    # texts: the tokens before the EOS of an episode that ended, all of a truncated one
    assert r.texts == [CHAR.decode([9, 10]), CHAR.decode([11, 12, 13, 14])]
    # the same dtypes as the in-process generator's rollout, and it concatenates with it
    h = HFGenerator(tiny, CHAR).generate(["1+2="], Sampling(2, 4, temperature=0.0))
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated", "loss_mask"):
        assert getattr(r, name).dtype == getattr(h, name).dtype, name
    completions = [row[:k].tolist() for row, k in zip(h.completion_ids, h.lengths.tolist())]
    again = Rollout.from_tokens(h.prompt_ids[:, -4:].tolist(), completions, pad_id=CHAR.pad_token_id,
                                truncated=h.truncated.tolist(), tokenizer=CHAR)
    assert again.texts == h.texts and torch.equal(again.completion_mask, h.completion_mask)
    assert torch.equal(again.loss_mask, h.loss_mask) and again.loss_mask.dtype == h.loss_mask.dtype
    # defaults: no loss mask given is every token the model's; no logprobs, episodes or versions
    d = Rollout.from_tokens(prompts, completions, pad_id=0, texts=["a", "b"])
    assert torch.equal(d.loss_mask, d.completion_mask) and d.sampler_logp is None and d.version is None
    assert d.truncated.tolist() == [False, False]


def test_from_tokens_refuses_what_does_not_line_up():
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        Rollout.from_tokens([[1], [2]], [[3]], pad_id=0, texts=["x"])
    with pytest.raises(ValueError, match="loss_masks must have one entry per completion token"):
        Rollout.from_tokens([[1]], [[3, 4]], pad_id=0, texts=["x"], loss_masks=[[1]])
    with pytest.raises(ValueError, match="loss_masks hold 0"):
        Rollout.from_tokens([[1]], [[3, 4]], pad_id=0, texts=["x"], loss_masks=[[1, 2]])
    with pytest.raises(ValueError, match="give texts, or a tokenizer"):
        Rollout.from_tokens([[1]], [[3]], pad_id=0)
    with pytest.raises(ValueError, match="a prompt has no tokens"):
        Rollout.from_tokens([[]], [[3]], pad_id=0, texts=["x"])


# ---------------------------------------------------------------------------------------------------------
# the contract as evaluation calls it

def test_evaluation_calls_the_documented_signature():
    """`rollout(generator, examples, sampling, seeds)` with no default for seeds: evaluation's greedy pass and
    pass@k both give one seed per example (it used to call the greedy pass without)."""
    Echo.calls.clear()
    examples = [Example("1+2=", "7"), Example("3+3=", "6")]
    gen = Fixed(CHAR, None)
    gen.version = 0
    metrics = evaluate(Echo(CHAR), gen, examples, resolve_reward("last_number", field="eval.reward"),
                       max_new_tokens=8, pass_k=2, seed=3)
    assert metrics["eval/accuracy"] == 0.5 and metrics["eval/pass@2"] == 0.5
    (t0, greedy), (t1, sampled) = Echo.calls
    assert t0 == 0.0 and t1 == 1.0 and len(greedy) == 2 and greedy == sampled  # one seed per example, each pass


def test_evaluation_samples_with_the_runs_settings():
    """Given the run's sampler settings, the greedy pass keeps the repetition penalty and the stop strings, and
    pass@k every setting but the temperature (eval.temperature); min_new_tokens is training's alone."""
    seen = []

    class Recording(Echo):
        def rollout(self, generator, examples, sampling, seeds):
            seen.append(sampling)
            return super().rollout(generator, examples, sampling, seeds)

    gen = Fixed(CHAR, None)
    gen.version = 0
    run = Sampling(1, 8, temperature=0.7, top_p=0.9, top_k=5, min_new_tokens=2, min_p=0.1, repetition_penalty=1.3,
                   stop=("\n",))
    evaluate(Recording(CHAR), gen, [Example("1+2=", "3")], resolve_reward("last_number", field="eval.reward"),
             max_new_tokens=99, pass_k=3, temperature=1.1, sampling=run)
    greedy, sampled = seen
    assert greedy == Sampling(1, 8, temperature=0.0, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.3,
                              stop=("\n",))
    assert sampled == Sampling(3, 8, temperature=1.1, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.3,
                               stop=("\n",))
    seen.clear()  # without them: max_new_tokens and top_p alone, as before
    evaluate(Recording(CHAR), gen, [Example("1+2=", "3")], resolve_reward("last_number", field="eval.reward"),
             max_new_tokens=6, pass_k=2, temperature=1.1, top_p=0.8)
    assert seen == [Sampling(1, 6, temperature=0.0, top_p=0.8), Sampling(2, 6, temperature=1.1, top_p=0.8)]


# ---------------------------------------------------------------------------------------------------------
# the example environment of docs/examples, with a scripted generator

class Guesses:
    """A generator whose turn k of every episode is `script[k]` and EOS (cut at the limit, truncated)."""

    def __init__(self, script):
        self.script, self.turn, self.version = script, 0, 0

    def generate(self, prompts, sampling, seeds=None, limits=None):
        text = self.script[min(self.turn, len(self.script) - 1)]
        self.turn += 1
        ids = CHAR(text, add_special_tokens=False)["input_ids"] + [CHAR.eos_token_id]
        rows, cut = [], []
        for p, k in zip(prompts, limits or [sampling.max_new_tokens] * len(prompts)):
            p = p if not isinstance(p, str) else CHAR(p, add_special_tokens=False)["input_ids"]
            rows += [p] * sampling.n
            cut += [ids[:min(k, sampling.max_new_tokens)]] * sampling.n
        return Rollout.from_tokens(rows, cut, pad_id=CHAR.pad_token_id, truncated=[len(c) < len(ids) for c in cut],
                                   tokenizer=CHAR)


def guess_env(tiny, max_turns=3):
    return build_environment(tiny, CHAR, load_config(None, ["rollout.environment=guess_env:GuessNumber"])) \
        if max_turns == 3 else GuessNumber(tiny, CHAR, Config(), lambda done: done, max_turns=max_turns)


def test_guess_env_turns_hints_and_loss_masks(tiny):
    env = guess_env(tiny)
    assert isinstance(env, GuessNumber)
    r = env.rollout(Guesses([" 5", " 9", " 7"]), [Example("Guess:", "7")], Sampling(2, 8), [1])
    ids = lambda s: CHAR(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [CHAR.eos_token_id]
    episode = ids(" 5") + eos + ids(" higher\n") + ids(" 9") + eos + ids(" lower\n") + ids(" 7") + eos
    mask = [1] * 3 + [0] * len(ids(" higher\n")) + [1] * 3 + [0] * len(ids(" lower\n")) + [1] * 3
    for i in range(2):
        k = int(r.lengths[i])
        assert r.completion_ids[i, :k].tolist() == episode and r.loss_mask[i, :k].tolist() == mask
        assert r.prompt_ids[i].tolist() == ids("Guess:")
        e = r.episodes[i]
        assert [m["role"] for m in e.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in e.messages[1:]] == [" 5", "higher", " 9", "lower", " 7"]
        assert e.stop == "done" and e.turns == 3
        text = r.texts[i]
        assert text == " 5 higher\n 9 lower\n 7"
        assert [text[:end] for end in e.turn_ends] == [" 5", " 5 higher\n 9", text]
    assert not r.truncated.any()


def test_guess_env_limits(tiny):
    r = guess_env(tiny, max_turns=2).rollout(Guesses([" 1", " 2", " 3"]), [Example("Guess:", "7")], Sampling(1, 8),
                                             [0])
    assert r.episodes[0].stop == "max_turns" and r.episodes[0].turns == 2 and not r.truncated[0]
    r = guess_env(tiny).rollout(Guesses([" 123456789"]), [Example("Guess:", "7")], Sampling(1, 4), [0])
    assert r.episodes[0].stop == "turn_length" and bool(r.truncated[0]) and r.lengths.tolist() == [4]
    assert r.loss_mask[0].tolist() == [1, 1, 1, 1]


def test_tools_names_are_checked_for_an_environment_that_takes_them():
    with pytest.raises(ConfigError, match="tools.names: unknown tool 'nope'"):
        load_config(None, [f"rollout.environment={HERE}:ToolUser", "tools.names=[nope]"])
    load_config(None, [f"rollout.environment={HERE}:Echo", "tools.names=[nope]"])  # unused: not checked


# ---------------------------------------------------------------------------------------------------------
# grpo.train(tools=, environment=): the config records them before it is validated, and the caller's is unchanged

def test_tools_given_to_train_are_validated_as_the_tools_environment(tmp_path):
    import grpo
    from grpo.trainer import Given, _given

    cfg = load_config(None, ["model.chat_template=true"])
    new, given = _given(cfg, Given(tools=lookup))  # one tool alone: a list of one
    assert given.tools == [lookup] and new.tools.names == [f"{HERE}:lookup"]
    assert new.rollout.environment == "tools"
    assert cfg.rollout.environment == "single_turn" and cfg.tools.names == ["calculator"]  # the caller's: unchanged
    new, given = _given(cfg, Given(environment="tools"))  # a name is rollout.environment
    assert new.rollout.environment == "tools" and given.environment is None
    rows = [{"prompt": "Look up ab"}]
    stops = load_config(None, ["model.chat_template=true", "rollout.stop=['\n\n']"])
    for kw in ({"tools": [lookup]}, {"tools": lookup}, {"environment": "tools"}):
        with pytest.raises(ConfigError, match="rollout.stop ends a model turn at a stop string, and "
                                              "rollout.environment=tools"):
            grpo.train(stops, train_dataset=rows, **kw)
    assert stops.rollout.environment == "single_turn"
    with pytest.raises(ConfigError, match="the overlong reward counts one completion's tokens"):
        grpo.train(load_config(None, ["model.chat_template=true"]), rewards=["overlong"], tools=[lookup],
                   train_dataset=rows)
    chat = [{"prompt": [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "ab?"}]}]
    with pytest.raises(ConfigError, match="the prompts are conversations .*rollout.environment=tools takes text"):
        grpo.train(load_config(None, ["model.chat_template=true", f"train.output_dir={tmp_path / 'run'}"]),
                   tools=[lookup], train_dataset=chat)
