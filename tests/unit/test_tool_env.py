"""The multi-turn tool environment (grpo/envs/tools.py): the tokens and masks of an episode, gradients only on the
model's tokens, the limits and their stop reasons, determinism, and bad input (tools that raise, hang or return
no string; templates without tool support; episodes past the context)."""
import copy
import time

import pytest
import torch
import transformers

from grpo.algo import policy_loss
from grpo.envs.tool_calls import Tool, load_tools
from grpo.envs.tools import ToolEnvironment, check_tool_template
from grpo.errors import DataError
from grpo.rollout import HFGenerator, Rollout, Sampling
from grpo.tasks import Example, load_builtin_task
from grpo.tiny import build_char_tokenizer, build_tool_tokenizer, tiny_model_config

from algo_specs import loss_spec

TOK = build_tool_tokenizer()
EOS = TOK.eos_token_id


class ScriptedTurns:
    """A generator that writes turn k of every episode from `script[k]` (each a text, ended by EOS unless it is
    longer than max_new_tokens): the environment's bookkeeping, without a model's randomness."""

    def __init__(self, script: list[str], tok=None):
        self.script = script
        self.tok = tok or TOK
        self.calls = 0
        self.prompts: list = []
        self.limits: list = []

    def generate(self, prompts, sampling, seeds=None, limits=None) -> Rollout:
        text = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        self.prompts.append(prompts)
        self.limits.append(limits)
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        cuts = [ids[:min(sampling.max_new_tokens, k)] for k in (limits or [sampling.max_new_tokens] * len(prompts))
                for _ in range(sampling.n)]
        width = max(len(c) for c in cuts)
        completion = torch.tensor([c + [self.tok.pad_token_id] * (width - len(c)) for c in cuts])
        mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in cuts])
        rows = len(cuts)
        return Rollout(torch.ones(rows, 1, dtype=torch.long), torch.ones(rows, 1, dtype=torch.long), completion,
                       mask, torch.tensor([len(c) < len(ids) for c in cuts]),
                       [self.tok.decode(c, skip_special_tokens=True) for c in cuts])

    def sync_weights(self, model) -> None: ...

    def close(self) -> None: ...


def env(max_turns=4, max_tokens=0, context=128, tools=("calculator",)) -> ToolEnvironment:
    return ToolEnvironment(TOK, load_tools(list(tools)), "pythonic", pad_id=TOK.pad_token_id,
                           context=context, max_turns=max_turns, max_tokens=max_tokens)


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


CALL1, CALL2, ANSWER = '[calculator(expression="2 * 3")]', '[calculator(expression="6 + 1")]', "7"
EXAMPLE = Example("Calculate 2 * 3 + 1", "7")


def test_three_turn_episode_tokens_and_loss_mask():
    r = env().rollout(ScriptedTurns([CALL1, CALL2, ANSWER]), [EXAMPLE], Sampling(2, 48), seeds=[5])
    model = [ids(CALL1) + [EOS], ids(CALL2) + [EOS], ids(ANSWER) + [EOS]]
    inserted = [ids("<|tool|>6<|endoftext|><|assistant|>"), ids("<|tool|>7<|endoftext|><|assistant|>")]
    tokens = model[0] + inserted[0] + model[1] + inserted[1] + model[2]
    mask = [1] * len(model[0]) + [0] * len(inserted[0]) + [1] * len(model[1]) + [0] * len(inserted[1]) \
        + [1] * len(model[2])
    assert r.completion_ids.shape == (2, len(tokens))
    for row in range(2):
        assert r.completion_ids[row].tolist() == tokens
        assert r.loss_mask[row].tolist() == mask
        assert r.completion_mask[row].tolist() == [1] * len(tokens)
    assert r.prompt_ids[0, r.prompt_mask[0].bool()].tolist() == ids(
        "<|system|>tools: calculator<|endoftext|><|user|>Calculate 2 * 3 + 1<|endoftext|><|assistant|>")
    assert not r.truncated.any() and r.sampler_logp is None
    text = CALL1 + "6" + CALL2 + "7" + ANSWER
    assert r.texts == [text, text]
    ep = r.episodes[0]
    assert (ep.turns, ep.tool_calls, ep.tool_errors, ep.stop) == (3, 2, 0, "done")
    assert ep.turn_ends == [len(CALL1), len(CALL1) + 1 + len(CALL2), len(text)]
    assert text[:ep.turn_ends[0]] == CALL1
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert ep.messages[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2 * 3"}}
    assert ep.messages[-1] == {"role": "assistant", "content": "7"}


def test_episodes_carry_the_weight_version_of_their_first_turn():
    class Versioned(ScriptedTurns):
        version = 3

        def generate(self, prompts, sampling, seeds=None, limits=None) -> Rollout:
            r = super().generate(prompts, sampling, seeds, limits)
            r = Rollout(**{**r.__dict__, "version": torch.full((len(r),), self.version)})
            self.version += 1  # a later turn sampled by newer weights
            return r

    r = env().rollout(Versioned([CALL1, CALL2, ANSWER]), [EXAMPLE, EXAMPLE], Sampling(2, 48), seeds=[5, 6])
    assert r.version.tolist() == [3, 3, 3, 3]


# a ChatML template in the Hermes/Qwen2.5 manner: tools listed in the system turn, a tool result as a user turn
# in <tool_response> tags, a newline after every <|im_end|> (the text the template writes after the model's EOS)
HERMES = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t.function | tojson }}"
          "{% endfor %}\n</tools><|im_end|>\n{% endif %}"
          "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
          "\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_qwen_style_calls_and_the_text_after_eos():
    tok = build_char_tokenizer(256)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # single tokens, not special: they stay in the text
    tok.eos_token = "<|im_end|>"
    tok.chat_template = HERMES
    e = ToolEnvironment(tok, load_tools(["calculator"]), "qwen", pad_id=tok.pad_token_id,
                        context=1024)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
    r = e.rollout(ScriptedTurns([call, "6"], tok), [EXAMPLE], Sampling(1, 200), seeds=[0])
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    inserted = enc("\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    first = enc(call) + [tok.eos_token_id]
    assert r.completion_ids[0].tolist() == first + inserted + enc("6") + [tok.eos_token_id]
    assert r.loss_mask[0].tolist() == [1] * len(first) + [0] * len(inserted) + [1] * 2
    ep = r.episodes[0]
    assert (ep.tool_calls, ep.tool_errors, ep.stop) == (1, 0, "done")
    assert ep.messages[2] == {"role": "tool", "name": "calculator", "content": "6"}
    assert r.texts[0] == call + "\nuser\n<tool_response>\n6\n</tool_response>\nassistant\n6"


def test_a_template_that_rewrites_assistant_turns_changes_nothing():
    """Templates that strip an assistant message's whitespace or give the last one an empty think block (as
    Llama's and Qwen3's do) render turns unlike what the model wrote; the inserted tokens are the same."""
    tok = build_tool_tokenizer()
    tok.chat_template = (
        "{%- if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|endoftext|>"
        "{% endif -%}{%- for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' and loop.last %}<think>"
        "</think>{% endif %}{{ m.content | trim }}<|endoftext|>{% endfor -%}"
        "{%- if add_generation_prompt %}<|assistant|>{% endif -%}")
    e = ToolEnvironment(tok, load_tools(["calculator"]), "pythonic", pad_id=tok.pad_token_id, context=256)
    r = e.rollout(ScriptedTurns(["  " + CALL1 + " ", ANSWER], tok), [EXAMPLE], Sampling(1, 48), seeds=[0])
    first = ids("  " + CALL1 + " ") + [EOS]
    inserted = ids("<|tool|>6<|endoftext|><|assistant|>")
    assert r.completion_ids[0].tolist() == first + inserted + ids(ANSWER) + [EOS]
    assert r.episodes[0].stop == "done"


def test_the_per_turn_reward_of_the_docs():
    """docs/tools.md's `failed_calls`: one step per model turn, ending at its turn, minus its failed calls."""
    def failed_calls(prompts, completions, messages, turn_ends, **_):
        out = []
        for msgs, ends in zip(messages, turn_ends):
            failed = []
            for m in msgs[1:]:
                if m["role"] == "assistant":
                    failed.append(0)
                elif m["role"] == "tool":
                    failed[-1] += m["content"].startswith("error:")
            out.append([(end, -float(bad)) for end, bad in zip(ends, failed)])
        return out

    from grpo.envs.base import episode_fields
    from grpo.rewards import score

    script = [CALL1, '[calculator(expression=3), calculator(expression="1 + 1")]', CALL2, ANSWER]
    r = env(max_turns=3, context=1024).rollout(ScriptedTurns(script), [EXAMPLE], Sampling(1, 64), seeds=[0])
    assert r.episodes[0].stop == "max_turns"  # the third turn's call was not run
    scores = score([failed_calls], None, [EXAMPLE.prompt], r.texts, {"answer": ["7"], **episode_fields(r)})
    ends = r.episodes[0].turn_ends
    assert scores.steps == [[(ends[0], 0.0), (ends[1], -1.0), (ends[2], 0.0)]]


def test_a_turn_continues_from_the_episodes_exact_tokens():
    gen = ScriptedTurns([CALL1, ANSWER])
    r = env().rollout(gen, [EXAMPLE], Sampling(1, 48), seeds=[0])
    prompt = r.prompt_ids[0, r.prompt_mask[0].bool()].tolist()
    first = ids(CALL1) + [EOS] + ids("<|tool|>6<|endoftext|><|assistant|>")
    assert gen.prompts[1] == [prompt + first]  # token ids, not text to re-tokenize


def test_environment_tokens_get_no_gradient(random_tool_model):
    """The log-probs of the tokens the environment inserted receive zero gradient from the policy term and the
    KL; the model's own tokens receive some."""
    from grpo.policy import LogprobModule

    r = env().rollout(ScriptedTurns([CALL1, CALL2, ANSWER]), [EXAMPLE], Sampling(2, 48), seeds=[5])
    module = LogprobModule(random_tool_model)
    logp = module(r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, temperature=1.0,
                  chunk_size=16).float()
    logp.retain_grad()
    adv = torch.tensor([[1.0], [-0.5]]).expand_as(logp).contiguous()
    ref = logp.detach() + 0.3 * torch.randn_like(logp)
    spec = loss_spec(80, beta=0.04, clip_low=0.2, clip_high=0.2, ratio_level="token", aggregation="seq_mean",
                     kl_kind="k3")
    loss, _ = policy_loss(logp, logp.detach(), adv, r.loss_mask, spec, ref_logp=ref, normalizer=2.0)
    loss.backward()
    inserted = (r.completion_mask == 1) & (r.loss_mask == 0)
    assert inserted.sum() > 0
    assert torch.all(logp.grad[inserted] == 0)
    assert torch.all(logp.grad[r.loss_mask == 1] != 0)
    # the loss mask holds the model's tokens alone: 3 turns' tokens and their EOS per episode
    n = len(ids(CALL1)) + len(ids(CALL2)) + len(ids(ANSWER)) + 3
    assert int(r.loss_mask[0].sum()) == n
    # and the normaliser the learner really uses counts them alone: one update at μ = 1, β = 0 with DAPO's token mean
    # gives −Σ_i Â_i·n / (2n) = −(1 − 0.5)/2 = −0.25 (with the episode's tokens, tool results included, as the count
    # it would be −0.25·n/(n + k) for k inserted tokens per episode; with them in the loss, −0.25·(n + k)/n)
    from grpo.distributed import Dist
    from grpo.experience import Experience
    from grpo.learn import Learner, learn

    exp = Experience.from_rollout(r, [EXAMPLE], adv, torch.zeros(2), {}, torch.zeros(2))
    model = copy.deepcopy(random_tool_model)
    learner = Learner(LogprobModule(model), None, torch.optim.SGD(model.parameters(), lr=0.1),
                      loss_spec(80, beta=0.0, aggregation="token_mean"), 1.0, 16, max_rows=8, max_tokens=0,
                      max_grad_norm=0.0)
    update = learn(learner, exp, Dist())[0]
    assert (r.completion_mask[0].sum() - n).item() > 0  # k
    assert update["tokens"] == 2 * n
    assert update["loss/policy"] == pytest.approx(-0.25, abs=1e-6)


def test_max_turns_ends_an_episode_that_still_calls():
    r = env(max_turns=2).rollout(ScriptedTurns([CALL1, CALL2, ANSWER]), [EXAMPLE], Sampling(1, 48), seeds=[0])
    ep = r.episodes[0]
    assert (ep.turns, ep.tool_calls, ep.stop) == (2, 1, "max_turns")
    assert not r.truncated[0] and r.completion_ids[0, r.lengths[0] - 1] == EOS  # ends on the model's EOS
    assert r.loss_mask[0, r.lengths[0] - 1] == 1


def test_turn_length_truncates():
    r = env().rollout(ScriptedTurns([CALL1]), [EXAMPLE], Sampling(1, 10), seeds=[0])
    ep = r.episodes[0]
    assert (ep.stop, ep.turns, ep.tool_calls) == ("turn_length", 1, 0) and r.truncated[0]
    assert r.texts[0] == CALL1[:10]


def test_max_tokens_cuts_the_episode_inside_a_turn_or_a_tool_result():
    first = len(ids(CALL1)) + 1
    # inside the second model turn
    r = env(max_tokens=first + 12).rollout(ScriptedTurns([CALL1, CALL2]), [EXAMPLE], Sampling(1, 48), seeds=[0])
    assert r.lengths[0] == first + 12 and r.truncated[0] and r.episodes[0].stop == "max_tokens"
    inserted = len(ids("<|tool|>6<|endoftext|><|assistant|>"))
    assert r.loss_mask[0, :first].all() and r.loss_mask[0, first:first + inserted].sum() == 0
    assert r.loss_mask[0, first + inserted:].all()
    # inside the inserted tool result: no room is left for a model turn
    r = env(max_tokens=first + 3).rollout(ScriptedTurns([CALL1, CALL2]), [EXAMPLE], Sampling(1, 48), seeds=[0])
    assert r.lengths[0] == first + 3 and r.truncated[0] and r.episodes[0].stop == "max_tokens"
    assert r.episodes[0].turns == 1 and r.loss_mask[0, first:].sum() == 0


def test_an_episode_longer_than_the_context_is_cut_and_recorded():
    prompt = len(env().rollout(ScriptedTurns([ANSWER]), [EXAMPLE], Sampling(1, 8), seeds=[0]).prompt_ids[0])
    r = env(context=prompt + 20).rollout(ScriptedTurns([CALL1, CALL2]), [EXAMPLE], Sampling(1, 48), seeds=[0])
    assert r.lengths[0] == 20 and r.truncated[0] and r.episodes[0].stop == "context"
    with pytest.raises(DataError, match="leaves no room in the model's context"):
        env(context=prompt).rollout(ScriptedTurns([ANSWER]), [EXAMPLE], Sampling(1, 8), seeds=[0])


def test_tool_errors_reach_the_model_as_results():
    script = ['[calculator(expression=3)]', '[calculator(expr="1")]', '[nope(a=1)]', '[calculator(', ANSWER]
    r = env(max_turns=6, context=1024).rollout(ScriptedTurns(script), [EXAMPLE], Sampling(1, 48), seeds=[0])
    ep = r.episodes[0]
    assert (ep.turns, ep.tool_calls, ep.tool_errors, ep.stop) == (5, 4, 4, "done")
    results = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert "must be of type string, not int" in results[0]
    assert "has no argument 'expr'" in results[1]
    assert "there is no tool 'nope'" in results[2]
    assert "not a list of calls" in results[3]


def raises(x: str) -> str:
    """Fail.

    Args:
        x: anything
    """
    raise RuntimeError("broken tool")


def hangs(x: str) -> str:
    """Sleep.

    Args:
        x: anything
    """
    time.sleep(30)
    return "late"


def not_text(x: str) -> str:
    """Return a number.

    Args:
        x: anything
    """
    return 42


def test_a_tool_that_raises_or_hangs_gives_an_error_result_and_one_that_returns_no_string_stops():
    tools = {"raises": Tool(raises), "hangs": Tool(hangs, timeout_s=0.5), "not_text": Tool(not_text)}
    e = ToolEnvironment(TOK, tools, "pythonic", pad_id=TOK.pad_token_id, context=128)
    r = e.rollout(ScriptedTurns(['[raises(x="a")]', '[hangs(x="a")]', ANSWER]), [EXAMPLE], Sampling(1, 48), [0])
    results = [m["content"] for m in r.episodes[0].messages if m["role"] == "tool"]
    assert results == ["error: RuntimeError: broken tool", "error: hangs did not finish within 0.5 s"]
    with pytest.raises(DataError, match="tool 'not_text' returned int, not a string"):
        e.rollout(ScriptedTurns(['[not_text(x="a")]', ANSWER]), [EXAMPLE], Sampling(1, 48), [0])


HOSTILE = ["while True: pass", "import os\nwhile True: os.fork()", "x = bytearray(10**10)",
           "open({canary!r}, 'w').write('gone')", "print(open({canary!r}).read())",
           "import socket; socket.create_connection(('127.0.0.1', 9))", "import os, signal; os.kill(os.getppid(), 9)"]


def test_hostile_python_calls_fail_and_the_episode_goes_on(tmp_path):
    """The model's python calls that loop, fork, allocate, write or read the run's files, open a socket or signal
    the trainer each come back as a failed execution; the episode continues and nothing here is touched."""
    from grpo.sandbox import Limits
    from grpo.envs.tool_calls import python_tool

    canary = tmp_path / "run-file.txt"
    canary.write_text("the run's data")
    tools = {"python": Tool(python_tool(Limits(timeout_s=2.0, cpu_s=2, memory_mb=256)), timeout_s=10.0)}
    calls = [f"[python(code={code.format(canary=str(canary))!r})]" for code in HOSTILE]
    e = ToolEnvironment(TOK, tools, "pythonic", pad_id=TOK.pad_token_id, context=4096,
                        max_turns=len(calls) + 1)
    r = e.rollout(ScriptedTurns(calls + [ANSWER]), [EXAMPLE], Sampling(1, 200), [0])
    ep = r.episodes[0]
    assert (ep.turns, ep.tool_calls, ep.stop) == (len(calls) + 1, len(calls), "done")
    results = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert all("[" in res and "]" in res for res in results), results  # each ends with why it failed
    assert "timed out" in results[0] and "memory limit" in results[2]
    assert all("[blocked: " in results[i] for i in (1, 3, 4, 5, 6)), results
    assert not any("the run's data" in res for res in results)
    assert canary.read_text() == "the run's data"


def test_a_chat_template_without_tool_support_is_refused_at_load():
    plain = build_char_tokenizer()
    with pytest.raises(DataError, match="needs a chat template"):
        check_tool_template(plain, [])
    plain.chat_template = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(DataError, match="does not render tool messages"):
        check_tool_template(plain, [])
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # renders tool turns, not tools=
    schemas = [t.schema for t in load_tools(["calculator"]).values()]
    with pytest.raises(DataError, match="does not show the tools"):
        check_tool_template(plain, schemas)
    check_tool_template(TOK, schemas)


def test_episodes_depend_on_their_seed_alone(random_tool_model):
    """Sampled with a real model: the same example and seed give the same episodes alone or in a batch."""
    gen = HFGenerator(random_tool_model, TOK, add_special_tokens=False)
    examples = load_builtin_task("products").eval[:3]
    e = env(max_turns=3, max_tokens=60)
    together = e.rollout(gen, examples, Sampling(4, 24), seeds=[11, 12, 13])
    alone = e.rollout(gen, examples[1:2], Sampling(4, 24), seeds=[12])
    assert together.texts[4:8] == alone.texts
    k = alone.completion_ids.shape[1]
    assert torch.equal(together.completion_ids[4:8, :k], alone.completion_ids)
    assert torch.equal(together.loss_mask[4:8, :k], alone.loss_mask)


@pytest.fixture(scope="module")
def random_tool_model():
    cfg = tiny_model_config(TOK, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()
