"""Generation settings (issue 36): rollout.min_p, rollout.repetition_penalty, rollout.stop on the in-process
sampler and in vLLM's SamplingParams, their load warnings and refusals, and greedy `grpo sample`."""
import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers

from grpo.algo.logprobs import sampling_keep_mask, token_logprobs
from grpo.config import RolloutConfig, load_config
from grpo.errors import ConfigError
from grpo.rollout import HFGenerator, Sampling, rollout_sampling, sample_next
from grpo.rollout.base import stop_cut
from grpo.rollout.hf import repetition_penalty
from grpo.rollout.vllm_common import rows_from_outputs, sampling_fields


# ---------------------------------------------------------------------------------------------------------
# a tokenizer whose tokens are several characters long, and a model that emits a fixed script per prompt

class WordTokenizer:
    """Token i is VOCAB[i]; 0 pads, 1 is EOS (special, left out of decoded text)."""

    VOCAB = ["<pad>", "<eos>", "a", "b", "c", " 12", "\n", "\n\nQ", "</answer>", "END", "x", "<answer>"]
    eos_token_id, pad_token_id = 1, 0

    def __len__(self):
        return len(self.VOCAB)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [self.VOCAB.index(c) for c in text]}  # prompts: one-character tokens

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i < 2))

    def batch_decode(self, rows, skip_special_tokens=False):
        return [self.decode(r, skip_special_tokens) for r in rows]


class _Cache:
    def __init__(self, rows):
        self.rows = rows

    def batch_repeat_interleave(self, n):
        self.rows = [list(r) for r in self.rows for _ in range(n)]

    def batch_select_indices(self, indices):  # the generator drops finished rows
        self.rows = [self.rows[i] for i in indices.tolist()]


class ScriptedLM:
    """Emits a fixed token script per prompt (then EOS forever), whatever the sampling settings."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts = tok, scripts
        self.device = torch.device("cpu")
        self.generation_config = transformers.GenerationConfig(eos_token_id=tok.eos_token_id)

    def __call__(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True,
                 logits_to_keep=None):
        if past_key_values is None:
            prompts = [self.tok.decode(ids[m.bool()].tolist()) for ids, m in zip(input_ids, attention_mask)]
            cache = _Cache([[self.scripts[p], 0] for p in prompts])
        else:
            cache = past_key_values
            for r in cache.rows:
                r[1] += 1
        logits = torch.full((len(cache.rows), 1, len(self.tok)), -1e4)
        for i, (script, k) in enumerate(cache.rows):
            logits[i, 0, script[k] if k < len(script) else 1] = 1e4
        return SimpleNamespace(logits=logits, past_key_values=cache)


W = WordTokenizer()
ids = W.VOCAB.index


def scripted(scripts):
    return HFGenerator(ScriptedLM(W, {p: [ids(t) for t in s] for p, s in scripts.items()}), W, lean=False)


# ---------------------------------------------------------------------------------------------------------
# stop strings

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_completion_ends_with_the_token_that_completes_a_stop_string(temperature):
    gen = scripted({"a": ["<answer>", " 12", "</answer>", "x", "x"],   # the string is one token
                    "b": [" 12", "\n", "\n\nQ", "x"],                 # "\n\n" inside "\n\nQ": the text is cut
                    "c": ["x", "x", "x"]})                             # none: EOS, as without stop strings
    s = Sampling(n=2, max_new_tokens=8, temperature=temperature, stop=("</answer>", "\n\n"))
    r = gen.generate(["a", "b", "c"], s, seeds=[1, 2, 3])
    assert r.lengths.tolist() == [3, 3, 3, 3, 4, 4]
    assert r.truncated.tolist() == [False] * 6  # it ended, as at EOS: not cut off
    assert r.texts == ["<answer> 12</answer>"] * 2 + [" 12\n\n"] * 2 + ["xxx"] * 2
    # the stop string's token is the completion's last: in the mask (and the loss mask), nothing after it
    assert r.completion_ids[0].tolist()[:3] == [ids("<answer>"), ids(" 12"), ids("</answer>")]
    assert r.completion_ids[2].tolist()[:3] == [ids(" 12"), ids("\n"), ids("\n\nQ")]  # completes "\n\n"
    assert torch.equal(r.loss_mask, r.completion_mask)
    assert r.completion_mask.tolist()[0] == [1, 1, 1, 0]


def test_the_text_is_cut_after_the_stop_string_within_the_last_token():
    gen = scripted({"a": [" 12", "\n\nQ", "x"]})
    r = gen.generate(["a"], Sampling(n=1, max_new_tokens=5, stop=("\n\n",)), seeds=[0])
    assert r.lengths.tolist() == [2] and r.texts == [" 12\n\n"]  # "\n\nQ" trained, its "Q" not in the text


def test_the_earliest_ending_stop_string_wins_and_min_new_tokens_comes_first():
    gen = scripted({"a": ["END", "a", "b", "END", "c", "x"]})
    s = Sampling(n=1, max_new_tokens=6, stop=("b", "END"))
    assert gen.generate(["a"], s, seeds=[0]).texts == ["END"]
    # within min_new_tokens a string is not looked for (vLLM's min_tokens): "END" at 1 and "b" at 3 pass
    r = gen.generate(["a"], Sampling(n=1, max_new_tokens=6, min_new_tokens=3, stop=("b", "END")), seeds=[0])
    assert r.lengths.tolist() == [4] and r.texts == ["ENDabEND"]


def test_a_stop_string_over_several_tokens_and_the_length_limit():
    gen = scripted({"a": ["a", "b", "c", "x"]})
    r = gen.generate(["a"], Sampling(n=1, max_new_tokens=6, stop=("bc",)), seeds=[0])
    assert r.lengths.tolist() == [3] and r.texts == ["abc"] and not r.truncated.any()
    # the limit comes first: truncated, no stop
    r = gen.generate(["a"], Sampling(n=1, max_new_tokens=2, stop=("bc",)), seeds=[0])
    assert r.lengths.tolist() == [2] and r.texts == ["ab"] and r.truncated.all()


def test_stop_cut():
    assert stop_cut("ab</answer>cd", ["</answer>"]) == "ab</answer>"
    assert stop_cut("x\n\nQ", ["\n\n", "Q"], since=1) == "x\n\n"  # both end in the last token: the earliest
    assert stop_cut("END..END", ["END"], since=5) == "END..END"   # ends after `since`: the first one is not it
    assert stop_cut("abc", ["z"]) is None


# ---------------------------------------------------------------------------------------------------------
# min_p: part of the kept set the sampler draws from and the loss replays

def test_min_p_never_draws_a_token_below_min_p_times_the_top_probability():
    torch.manual_seed(0)
    logits = torch.randn(8, 50) * 3
    rows = logits.repeat(500, 1)
    min_p, temperature = 0.1, 0.7
    probs = torch.softmax(logits / temperature, -1)
    allowed = probs >= min_p * probs.max(-1, keepdim=True).values
    drawn = torch.zeros(8, 50, dtype=torch.bool)
    for seed in range(4):
        u = torch.rand(len(rows), generator=torch.Generator().manual_seed(seed))
        d = sample_next(rows, Sampling(1, 1, temperature=temperature, min_p=min_p), u).view(500, 8)
        drawn |= torch.zeros(8, 50, dtype=torch.bool).scatter_(1, d.T, True)
    assert not (drawn & ~allowed).any()  # never below the threshold
    assert torch.equal(drawn, allowed)    # and every kept token is drawn in 2000 tries (all have p >= 0.1·max)
    assert allowed.sum() < allowed.numel() / 2  # the filter did act


def test_min_p_kept_set_and_its_log_probs():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    # 0.2 × 0.5 = 0.1: the last token goes
    assert sampling_keep_mask(z, None, 0, 1.0, 0.2).tolist() == [[True, True, True, False]]
    # min-p, then top-p over what it keeps (vLLM's order): 0.5/0.92 < 0.6 <= 0.8/0.92 → {0, 1}
    assert sampling_keep_mask(z, None, 0, 0.6, 0.2).tolist() == [[True, True, False, False]]
    target = torch.tensor([[1]])
    full, kept = token_logprobs(z.unsqueeze(0), target, truncation=(0, 1.0, 0.2))
    assert kept.item() == pytest.approx(torch.log(torch.tensor(0.3 / 0.92)).item(), abs=1e-6)
    assert full.item() == pytest.approx(torch.log(torch.tensor(0.3)).item(), abs=1e-6)
    # the chunked kernel agrees, value and gradient
    x = torch.randn(2, 5, 30, requires_grad=True)
    t = torch.randint(0, 30, (2, 5))
    plain = token_logprobs(x, t, temperature=0.8, truncation=(0, 1.0, 0.05))[1]
    chunked = token_logprobs(x, t, temperature=0.8, chunk_size=3, truncation=(0, 1.0, 0.05))[1]
    assert torch.allclose(plain, chunked, atol=1e-6)
    g1, = torch.autograd.grad(plain.sum(), x)
    g2, = torch.autograd.grad(chunked.sum(), x)
    assert torch.allclose(g1, g2, atol=1e-6)
    assert Sampling(1, 1, min_p=0.05).truncation == (0, 1.0, 0.05)
    with pytest.raises(ValueError, match="min_p must be in"):
        token_logprobs(x, t, truncation=(0, 1.0, 1.0))


# ---------------------------------------------------------------------------------------------------------
# repetition penalty

def test_repetition_penalty_is_transformers_processor():
    torch.manual_seed(1)
    logits = torch.randn(3, 20) * 2
    seen = torch.tensor([[1, 2, 2, 5], [0, 19, 3, 3], [7, 7, 7, 7]])
    for penalty in (1.3, 0.8):
        expect = transformers.RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
        assert torch.equal(repetition_penalty(logits, seen, penalty), expect)


@pytest.fixture(scope="module")
def model_and_tok(random_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(random_model_dir)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(random_model_dir)


PROMPTS = ["Calculate 1 + 2 * 3 =", "Hi", "Solve y = 2x + 1 for x = 2, y ="]


@pytest.mark.parametrize("lean", [True, False])
def test_greedy_with_a_repetition_penalty_matches_transformers_generate(model_and_tok, lean):
    model, tok = model_and_tok
    r = HFGenerator(model, tok, lean=lean).generate(
        PROMPTS, Sampling(n=1, max_new_tokens=12, temperature=0.0, repetition_penalty=1.5))
    plain = HFGenerator(model, tok, lean=lean).generate(PROMPTS, Sampling(n=1, max_new_tokens=12, temperature=0.0))
    for i, p in enumerate(PROMPTS):  # one prompt at a time: transformers would penalise the left padding too
        enc = tok([p], return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=12, do_sample=False, repetition_penalty=1.5,
                             pad_token_id=tok.pad_token_id)[0, enc["input_ids"].shape[1]:]
        n = int(r.lengths[i])
        assert r.completion_ids[i, :n].tolist() == ref[:n].tolist()
    assert not torch.equal(r.completion_ids, plain.completion_ids)  # the penalty changed something


def test_sampling_with_the_new_settings_is_seeded(model_and_tok):
    model, tok = model_and_tok
    gen = HFGenerator(model, tok)
    s = Sampling(n=4, max_new_tokens=10, min_p=0.05, repetition_penalty=1.2, stop=("=",))
    a, b = gen.generate(PROMPTS, s, [1, 2, 3]), gen.generate(PROMPTS, s, [1, 2, 3])
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    alone = gen.generate(PROMPTS[1:2], s, [2])  # a prompt's completions depend on its seed only
    assert alone.texts == a.texts[4:8]
    # every sampled token was in the min-p set of the policy (the model's own logits, after the penalty)
    for row in range(len(a)):
        k = int(a.lengths[row])
        prompt = a.prompt_ids[row][a.prompt_mask[row].bool()]
        full = torch.cat([prompt, a.completion_ids[row, :k]])
        with torch.no_grad():
            logits = model(full.unsqueeze(0)).logits[0, len(prompt) - 1:-1].float()
        for t in range(k):
            z = repetition_penalty(logits[t:t + 1], full[:len(prompt) + t].unsqueeze(0), 1.2)
            p = torch.softmax(z, -1)[0]
            assert p[full[len(prompt) + t]] >= 0.05 * p.max() - 1e-7
        if not a.truncated[row] and full[-1] != tok.eos_token_id:  # ended by the stop string
            assert a.texts[row].endswith("=") and a.texts[row].count("=") == 1


def test_the_defaults_change_nothing(model_and_tok):
    model, tok = model_and_tok
    s = rollout_sampling(RolloutConfig(), 4)
    assert (s.min_p, s.repetition_penalty, s.stop, s.truncation) == (0.0, 1.0, (), None)
    gen = HFGenerator(model, tok)
    base = Sampling(n=4, max_new_tokens=8)
    a = gen.generate(PROMPTS, base, [1, 2, 3])
    # settings that cannot act: the same tokens and texts, bit for bit
    b = gen.generate(PROMPTS, Sampling(n=4, max_new_tokens=8, stop=("never in a completion",)), [1, 2, 3])
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert torch.equal(a.truncated, b.truncated)


# ---------------------------------------------------------------------------------------------------------
# vLLM: the SamplingParams built from the config, and its outputs read back

def test_vllm_sampling_fields():
    """(tests/integration/test_vllm.py runs them in a real engine)"""
    with pytest.warns(UserWarning, match="rollout.repetition_penalty=1.1"):
        cfg = load_config(None, ["rollout.min_p=0.05", "rollout.repetition_penalty=1.1", "rollout.stop=[</answer>]",
                                 "rollout.top_k=20"])
    f = sampling_fields(rollout_sampling(cfg.rollout, 8), 123, 32, [2])
    assert f["min_p"] == 0.05 and f["repetition_penalty"] == 1.1 and f["top_k"] == 20
    assert f["stop"] == ["</answer>"] and f["include_stop_str_in_output"] and f["detokenize"]
    assert f["stop_token_ids"] == [2] and f["logprobs"] == 0 and f["n"] == 8
    d = sampling_fields(rollout_sampling(RolloutConfig(), 8), 123, 32, [2])  # the defaults: as before
    assert (d["min_p"], d["repetition_penalty"], d["stop"], d["detokenize"]) == (0.0, 1.0, [], False)
    assert sampling_fields(Sampling(8, 32, temperature=0.0, stop=("x",)), 1, 32, [2])["n"] == 1  # greedy: once


def test_vllm_outputs_ended_by_a_stop_string_keep_their_last_token_in_the_text():
    def c(tokens, finish, stop_reason, index=0):
        return SimpleNamespace(index=index, token_ids=[ids(t) for t in tokens], finish_reason=finish,
                               stop_reason=stop_reason, logprobs=None)
    outs = [SimpleNamespace(outputs=[c([" 12", "\n\nQ"], "stop", "\n\n", 0), c([" 12", "<eos>"], "stop", None, 1)]),
            SimpleNamespace(outputs=[c(["x", "x"], "length", None, 0), c(["<answer>", "</answer>"], "stop",
                                                                          "</answer>", 1)])]
    r = rows_from_outputs(outs, [[ids("a")], [ids("b")]], 2, with_logp=False, tokenizer=W, pad_id=0, device="cpu",
                          version=0, stop=("\n\n", "</answer>"))
    assert r.texts == [" 12\n\n", " 12", "xx", "<answer></answer>"]
    assert r.truncated.tolist() == [False, False, True, False] and r.lengths.tolist() == [2, 2, 2, 2]
    # a server's answer (JSON) carries stop_reason too
    from grpo.rollout.vllm_server import _request_output
    out = _request_output({"choices": [{"index": 0, "token_ids": [ids(" 12"), ids("\n\nQ")], "finish_reason": "stop",
                                        "stop_reason": "\n\n"}]}, "http://s", 0)
    r = rows_from_outputs([out], [[ids("a")]], 1, with_logp=False, tokenizer=W, pad_id=0, device="cpu", version=0,
                          stop=("\n\n",))
    assert r.texts == [" 12\n\n"] and not r.truncated.any()


# ---------------------------------------------------------------------------------------------------------
# load: warnings and refusals

def test_repetition_penalty_warns_at_load():
    with pytest.warns(UserWarning, match=r"rollout.repetition_penalty=1.2: .* ratio and KL are those of the "
                                         "unpenalised policy"):
        load_config(None, ["rollout.repetition_penalty=1.2"])
    with pytest.warns(UserWarning, match="engine's log-probs are of the penalised distribution"):
        load_config(None, ["rollout.repetition_penalty=1.2", "rollout.backend=vllm"])


def test_min_p_warns_only_where_the_replayed_kept_set_is_approximate():
    with pytest.warns(UserWarning, match="rollout.min_p=0.1: the loss's ratio is to the policy renormalised"):
        load_config(None, ["rollout.min_p=0.1", "rollout.backend=vllm"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in-process, one update a batch: exact, as top_p
        cfg = load_config(None, ["rollout.min_p=0.1", "rollout.stop=[\"\\n\\n\"]"])  # stop strings: exact too
    assert cfg.rollout.stop == ["\n\n"]


@pytest.mark.parametrize("overrides,message", [
    (["rollout.min_p=1"], "rollout.min_p=1.0 is out of range; it must be >= 0 and < 1"),
    (["rollout.repetition_penalty=0"], "rollout.repetition_penalty=0.0 is out of range; it must be > 0"),
    (["rollout.stop=[a, '']"], "rollout.stop holds an empty string"),
    (["rollout.stop=x"], "rollout.stop must be a"),
    (["rollout.stop=[x]", "rollout.environment=tools", "model.chat_template=true"],
     "rollout.stop ends a model turn at a stop string, and rollout.environment=tools needs"),
])
def test_bad_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, overrides)


# ---------------------------------------------------------------------------------------------------------
# grpo sample: greedy

def test_grpo_sample_greedy_is_the_same_twice(random_model_dir, grpo_cli):
    args = ["sample", f"model.path={random_model_dir}", "--prompt", "Calculate 1 + 1 =", "--prompt", "Hi"]
    first, second = grpo_cli(*args, "--greedy"), grpo_cli(*args, "--temperature", "0")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.count("    -> ") == 2  # one completion a prompt
    sampled = grpo_cli(*args, "-n", "3", "--temperature", "1.5")
    assert sampled.returncode == 0 and sampled.stdout.count("    -> ") == 6
    bad = grpo_cli(*args, "--greedy", "-n", "3")
    assert bad.returncode == 2 and "greedy decoding gives one completion per prompt" in bad.stderr
    assert grpo_cli(*args, "--temperature", "-1").returncode == 2
