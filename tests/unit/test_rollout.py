"""Rollouts: masks from positions (SPEC 12), truncation, grouping, seeding, and agreement with HF generate."""
from types import SimpleNamespace

import pytest
import torch
import transformers

from grpo.rollout import HFGenerator, Sampling, sample_next
from grpo.tiny import build_char_tokenizer


class _Cache:
    def __init__(self, rows):
        self.rows = rows  # [script, position] per sequence

    def batch_repeat_interleave(self, n):
        self.rows = [list(r) for r in self.rows for _ in range(n)]

    def batch_select_indices(self, indices):  # the generator drops finished rows
        self.rows = [self.rows[i] for i in indices.tolist()]


class ScriptedLM:
    """A stand-in causal LM that emits a fixed token script per prompt, whatever the sampling settings."""

    def __init__(self, tokenizer, scripts):
        self.tok = tokenizer
        self.scripts = scripts
        self.device = torch.device("cpu")
        self.generation_config = transformers.GenerationConfig(eos_token_id=tokenizer.eos_token_id)

    def __call__(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True,
                 logits_to_keep=None):
        if past_key_values is None:
            prompts = [self.tok.decode(ids[m.bool()]) for ids, m in zip(input_ids, attention_mask)]
            cache = _Cache([[self.scripts[p], 0] for p in prompts])
        else:
            cache = past_key_values
            for r in cache.rows:
                r[1] += 1
        logits = torch.full((len(cache.rows), 1, len(self.tok)), -1e4)
        for i, (script, k) in enumerate(cache.rows):
            logits[i, 0, script[min(k, len(script) - 1)]] = 1e4
        return SimpleNamespace(logits=logits, past_key_values=cache)


@pytest.fixture
def tok():
    return build_char_tokenizer()


def scripted(tok, pad_is_eos=False):
    eos = tok.eos_token_id
    scripts = {"a": tok.encode(" 12") + [eos], "bb": [eos], "c": tok.encode("x" * 20)}
    if pad_is_eos:
        tok.pad_token = tok.eos_token
    return HFGenerator(ScriptedLM(tok, scripts), tok)


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_masks_come_from_positions(tok, pad_is_eos):
    gen = scripted(tok, pad_is_eos)
    r = gen.generate(["a", "bb", "c"], Sampling(n=2, max_new_tokens=6), seeds=[0, 1, 2])
    assert r.completion_ids.shape == (6, 6)
    expect_mask = [[1, 1, 1, 1, 0, 0]] * 2 + [[1, 0, 0, 0, 0, 0]] * 2 + [[1] * 6] * 2
    assert r.completion_mask.tolist() == expect_mask
    assert r.truncated.tolist() == [False, False, False, False, True, True]
    assert r.texts == [" 12", " 12", "", "", "xxxxxx", "xxxxxx"]
    assert r.lengths.tolist() == [4, 4, 1, 1, 6, 6]
    eos, pad = tok.eos_token_id, gen.pad_id
    assert r.completion_ids[0].tolist() == tok.encode(" 12") + [eos, pad, pad]
    # prompts: left-padded, repeated for each completion of the group
    assert r.prompt_mask.tolist() == [[0, 1]] * 2 + [[1, 1]] * 2 + [[0, 1]] * 2
    assert tok.decode(r.prompt_ids[2][r.prompt_mask[2].bool()]) == "bb"


def test_generation_stops_when_every_row_has_ended(tok):
    r = scripted(tok).generate(["a", "bb"], Sampling(n=1, max_new_tokens=50))
    assert r.completion_ids.shape == (2, 4) and not r.truncated.any()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_holds_eos_back(tok, temperature):
    # "bb" wants EOS at once; with min_new_tokens=3 it may end at the 4th token at the earliest
    r = scripted(tok).generate(["a", "bb"], Sampling(n=2, max_new_tokens=6, temperature=temperature,
                                                     min_new_tokens=3), seeds=[0, 1])
    assert r.lengths.tolist() == [4, 4, 4, 4] and not r.truncated.any()
    assert (r.completion_ids[2:, :3] != tok.eos_token_id).all()
    assert (r.completion_ids[2:, 3] == tok.eos_token_id).all()


def test_batches_of_prompts_are_joined(tok):
    gen = scripted(tok)
    gen.max_batch_prompts = 1
    r = gen.generate(["bb", "a", "c"], Sampling(n=2, max_new_tokens=5))
    assert r.completion_mask.sum(1).tolist() == [1, 1, 4, 4, 5, 5]
    assert r.prompt_ids.shape == (6, 2) and r.prompt_mask.tolist()[2] == [0, 1]


def test_rows_carry_the_weight_version_that_sampled_them(tok):
    gen = scripted(tok)
    gen.max_batch_prompts = 1  # joined batches keep it
    s = Sampling(n=2, max_new_tokens=5)
    assert gen.version == 0 and gen.generate(["a", "bb"], s).version.tolist() == [0] * 4
    gen.sync_weights(gen.model)  # one more per sync
    r = gen.generate(["a", "bb"], s)
    assert r.version.tolist() == [1] * 4 and r.version.dtype == torch.long
    gen.sync_weights(gen.model, version=9)  # a resume names the version it restores
    assert gen.generate(["a"], s).version.tolist() == [9, 9]


@pytest.fixture(scope="module")
def model_and_tok(random_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(random_model_dir)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(random_model_dir)


PROMPTS = ["Calculate 1 + 2 * 3 =", "Solve y = 2x + 1 for x = 2, y =", "Hi"]


def test_greedy_matches_transformers_generate(model_and_tok):
    model, tok = model_and_tok
    r = HFGenerator(model, tok).generate(PROMPTS, Sampling(n=1, max_new_tokens=7, temperature=0.0))
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    ref = model.generate(**enc, max_new_tokens=7, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = ref[:, enc["input_ids"].shape[1]:]
    for i in range(len(PROMPTS)):
        n = int(r.lengths[i])
        assert r.completion_ids[i, :n].tolist() == ref[i, :n].tolist()


def test_seeded_sampling_is_reproducible_and_grouped(model_and_tok):
    model, tok = model_and_tok
    gen = HFGenerator(model, tok)
    s = Sampling(n=4, max_new_tokens=6, temperature=1.0)
    a = gen.generate(PROMPTS, s, [1, 2, 3])
    b = gen.generate(PROMPTS, s, [1, 2, 3])
    c = gen.generate(PROMPTS, s, [4, 5, 6])
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert len(a) == 12 and a.completion_ids.shape[1] <= 6
    g = gen.generate(PROMPTS, Sampling(n=3, max_new_tokens=6, temperature=0.0))
    assert g.texts[0] == g.texts[1] == g.texts[2] and g.texts[3] == g.texts[5]
    assert torch.equal(gen.generate(PROMPTS, Sampling(n=1, max_new_tokens=6, top_k=1), [7, 8, 9]).completion_ids,
                       g.completion_ids[::3])
    # a prompt's completions depend on its seed only, not on the other prompts of the batch
    alone = gen.generate(PROMPTS[1:2], s, [2])
    width = alone.completion_ids.shape[1]
    assert alone.texts == a.texts[4:8] and torch.equal(alone.completion_ids, a.completion_ids[4:8, :width])
    gen.max_batch_prompts = 1
    assert gen.generate(PROMPTS, s, [1, 2, 3]).texts == a.texts


def test_token_prompts_and_per_prompt_limits(model_and_tok):
    """Token-id prompts sample as their texts do; a limit cuts a prompt's completions to a prefix of the unlimited
    ones, marked truncated where no EOS came by then."""
    model, tok = model_and_tok
    gen = HFGenerator(model, tok)
    s = Sampling(n=3, max_new_tokens=8, temperature=1.0)
    full = gen.generate(PROMPTS, s, [1, 2, 3])
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert gen.generate(ids, s, [1, 2, 3]).texts == full.texts
    cut = gen.generate(ids, s, [1, 2, 3], limits=[2, 8, 5])
    for row in range(9):
        k = int(cut.lengths[row])
        assert k <= [2, 8, 5][row // 3] and cut.completion_ids[row, :k].tolist() == full.completion_ids[row, :k].tolist()
        assert bool(cut.truncated[row]) == (k < int(full.lengths[row]) or bool(full.truncated[row]))
    with pytest.raises(ValueError, match="limits must hold 3 values in 1..8"):
        gen.generate(ids, s, [1, 2, 3], limits=[2, 9, 5])


def test_sample_next_top_p_and_top_k():
    two = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]))
    logits = two.repeat(400, 1)  # 400 draws from each row in one call
    rng = torch.Generator().manual_seed(0)

    def drawn(sampling):
        d = sample_next(logits, sampling, torch.rand(len(logits), generator=rng)).view(400, 2)
        return set(d[:, 0].tolist()), set(d[:, 1].tolist())

    # nucleus = the smallest set of most likely tokens whose probability reaches top_p
    assert drawn(Sampling(1, 1, top_p=0.55)) == ({0}, {1, 2})
    assert drawn(Sampling(1, 1, top_p=0.85)) == ({0, 1}, {0, 1, 2})
    assert drawn(Sampling(1, 1, top_k=2)) == ({0, 1}, {1, 2})
    assert drawn(Sampling(1, 1)) == ({0, 1, 2}, {0, 1, 2})
    assert sample_next(two, Sampling(1, 1, temperature=0.0), None).tolist() == [0, 1]


def test_draws_follow_softmax_of_logits_over_temperature():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).repeat(40000, 1)
    rng = torch.Generator().manual_seed(0)
    for temperature in (1.0, 0.5):
        d = sample_next(logits, Sampling(1, 1, temperature=temperature), torch.rand(len(logits), generator=rng))
        expect = torch.softmax(torch.log(probs) / temperature, -1)
        freq = torch.bincount(d, minlength=4).float() / len(d)
        assert torch.allclose(freq, expect, atol=0.01), (temperature, freq, expect)
        assert freq[3] == 0


def test_inverse_transform_edges():
    logits = torch.log(torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]))
    at = lambda u: sample_next(logits, Sampling(1, 1), torch.tensor([u])).item()  # noqa: E731
    # zero-probability tokens are never drawn, at either end of the unit interval or at the boundary
    assert [at(0.0), at(0.49), at(0.5), at(0.99), at(1.0 - 2**-24)] == [1, 1, 3, 3, 3]
