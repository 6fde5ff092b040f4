"""Decoding drops finished rows (grpo.rollout.hf.rows_to_keep, `keep` of both decoding states): the tokens are the
ones the generator sampled before it did (tests/data/decoding_reference.json), bit for bit, while the later steps
compute fewer rows."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from grpo.rollout import HFGenerator, Sampling, hf
from grpo.rollout.hf import _TransformersDecoding, rows_to_keep
from grpo.rollout.lean_decoding import LeanDecoding

_spec = importlib.util.spec_from_file_location("decoding_reference",
                                               Path(__file__).parents[1] / "data" / "decoding_reference.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)
RECORDED = json.loads(reference.PATH.read_text())


@pytest.fixture(scope="module")
def tiny():
    return {dtype: reference.load_tiny(dtype) for dtype in ("float32", "float64")}


@pytest.fixture
def rows_fed(monkeypatch):
    """The number of rows of every decoding step, on either path."""
    fed = []
    for cls in (LeanDecoding, _TransformersDecoding):
        def step(self, tokens, step=cls.step):
            fed.append(len(tokens))
            return step(self, tokens)
        monkeypatch.setattr(cls, "step", step)
    return fed


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}-threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_the_recorded_cases_cover_both_paths_and_the_settings():
    cases = [r["case"] for r in RECORDED.values()]
    assert RECORDED.keys() == reference.CASES.keys() and len(cases) == 15
    assert {c.get("lean", True) for c in cases} == {True, False} and {c.get("dtype") for c in cases} >= {"float64"}
    settings = [c["sampling"] for c in cases]
    for key in ("min_new_tokens", "repetition_penalty", "stop", "top_p", "min_p"):
        assert any(key in s for s in settings), key
    assert {s["temperature"] for s in settings} >= {0.0, 1.0} and any("limits" in c for c in cases)


@pytest.mark.parametrize("name", list(RECORDED))
def test_rollouts_are_the_recorded_ones_with_fewer_rows_at_the_end(name, tiny, rows_fed, threads):
    want = RECORDED[name]
    case = want["case"]
    got = reference.record(reference.run_case(case, *tiny[case.get("dtype", "float32")]))
    for key in ("completion_ids", "completion_mask", "truncated", "texts"):
        assert got[key] == want[key], key
    # the rows each step fed the model: all of them, then fewer as rows finish (rows_to_keep after every token)
    total, lengths = len(want["texts"]), [sum(m) for m in want["completion_mask"]]
    held, expected = torch.arange(total), []
    for t in range(max(lengths) - 1):  # a step after every token but the last
        keep = rows_to_keep(held, torch.tensor([k <= t + 1 for k in lengths]), total)
        held = held if keep is None else held[keep]
        expected.append(len(held))
    assert rows_fed == expected
    assert (rows_fed[-1] < total) == (name not in KEEP_ALL), rows_fed
    if name.startswith("limits"):  # 28 rows of lengths 4, 22, 9, 17, 1, 12, 2 (4 each): worked out by hand
        assert rows_fed == [28] * 3 + [16] * 8 + [8] * 10


# the cases whose rows are all computed to the end: 7 rows (fewer than 8), and 21 rows whose last 5 (21 mod 8) are
# among the longest
KEEP_ALL = {"greedy_penalty_stop", "min_new_tokens_penalty", "min_new_tokens_penalty_transformers"}


def test_rows_to_keep():
    def keep(live, total, held=None):
        """The positions in `held` (default: all `total` rows) to keep when only the rows `live` are unfinished."""
        finished = torch.ones(total, dtype=torch.bool)
        finished[list(live)] = False
        out = rows_to_keep(torch.arange(total) if held is None else torch.tensor(held), finished, total)
        return None if out is None else out.tolist()

    # 32 rows: 24 left is 3/4 of them, kept; 23 left are topped up with the first finished row to 24
    assert keep(range(8, 32), 32) == list(range(8, 32))
    assert keep(range(9, 32), 32) == [0] + list(range(9, 32))
    assert keep([8] + list(range(10, 32)), 32) == [0, 8] + list(range(10, 32))
    assert keep(range(6, 32), 32) is None  # 26 left would make 32: nothing to drop
    assert keep(range(24, 32), 32) == list(range(24, 32))
    assert keep(range(4, 10), 32) == [0, 1, 4, 5, 6, 7, 8, 9]  # 6 left, in 8 rows
    # never no rows: with every row finished the state stays (another process may still be decoding)
    assert keep([], 32) is None
    # 30 rows: while one of the last 6 (30 mod 8) is unfinished, every row is kept
    assert keep(range(20, 30), 30) is None and keep([29], 30) is None
    assert keep(range(20, 24), 30) == [0, 1, 2, 3, 20, 21, 22, 23]
    # a state compacted before holds 16 of 64 rows: positions in it
    held = [3] + list(range(40, 55))
    assert keep(range(47, 53), 64, held) == [0, 1] + list(range(8, 14))
    assert keep(range(41, 53), 64, held) is None  # 12 left would make 16


STATES = [("lean", "float32", "sdpa", False),    # the attention as batched matmuls, a key bias
          ("lean", "float64", "sdpa", False),    # the model's kernel, a boolean key mask
          ("lean", "float32", "eager", True),    # bfloat16 autocast
          ("transformers", "float32", "sdpa", False), ("transformers", "float32", "eager", False),
          ("transformers", "float64", "sdpa", False), ("transformers", "float32", "sdpa", True)]


@pytest.mark.parametrize("path,dtype,attn,bf16", STATES)
def test_kept_rows_get_the_logits_they_would_have_had(path, dtype, attn, bf16, tiny, threads):
    model, tok = tiny[dtype]
    model.set_attn_implementation(attn)
    try:
        _compare_kept_rows(path, model, tok, bf16, loose=path == "transformers" and attn == "sdpa" and
                           dtype == "float32" and not bf16 and threads > 1)
    finally:
        model.set_attn_implementation("sdpa")


def _compare_kept_rows(path, model, tok, bf16, loose):
    """Two states of the same batch fed the same tokens, one keeping 8 of its rows after two steps: their logits."""
    enc = tok(reference.PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    n, rows = 4, torch.tensor([1, 2, 5, 9, 10, 17, 20, 27])  # 8 of 28 rows, prompts of every length
    tokens = torch.randint(3, len(tok), (6, len(reference.PROMPTS) * n))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        def prefill():
            if path == "lean":
                return LeanDecoding.prefill(model, enc["input_ids"], enc["attention_mask"], n, 8)[0]
            return _TransformersDecoding.prefill(model, enc["input_ids"], enc["attention_mask"], n)[0]
        full, part = prefill(), prefill()
        for t in range(len(tokens)):
            if t == 2:
                part.keep(rows)
            want = full.step(tokens[t])
            got = part.step(tokens[t] if t < 2 else tokens[t, rows])
            want = want if t < 2 else want[rows]
            if loose:
                # PyTorch's CPU flash attention rounds the rows its worker threads compute otherwise than the
                # main thread's: a row that changes hands changes in the last bits, as in another batch
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            else:
                assert torch.equal(got, want), t


@pytest.mark.parametrize("lean", [True, False])
def test_bf16_autocast_rollouts_are_those_without_compaction(lean, tiny, monkeypatch, rows_fed):
    # bfloat16 matmuls round per CPU: compared with the same generator never dropping a row, not with a record
    model, tok = tiny["float32"]
    gen = HFGenerator(model, tok, lean=lean, autocast_bf16=True)
    s = Sampling(n=4, max_new_tokens=28, temperature=1.0, repetition_penalty=1.1, min_new_tokens=2)
    dropping = gen.generate(reference.PROMPTS, s, seeds=reference.SEEDS)
    assert min(rows_fed) < 28
    monkeypatch.setattr(hf, "_COMPACT_AT", 0.0)  # never
    rows_fed.clear()
    every = gen.generate(reference.PROMPTS, s, seeds=reference.SEEDS)
    assert set(rows_fed) == {28}
    assert torch.equal(dropping.completion_ids, every.completion_ids) and dropping.texts == every.texts
    assert torch.equal(dropping.completion_mask, every.completion_mask)


@pytest.mark.parametrize("lean", [True, False])
def test_a_process_done_first_keeps_stepping_its_compacted_rows(lean, tiny, rows_fed):
    """With several processes every one decodes until all are done (`all_finished` is a collective): one whose rows
    have all finished keeps stepping the rows it holds, never none."""
    model, tok = tiny["float32"]
    s = Sampling(n=4, max_new_tokens=28, temperature=1.0)
    alone = HFGenerator(model, tok, lean=lean).generate(reference.PROMPTS, s, seeds=reference.SEEDS)
    fed_alone = list(rows_fed)
    rows_fed.clear()
    decoding = []  # while this process decodes its batch, the others are never done; after it, all are
    waiting = HFGenerator(model, tok, lean=lean, all_finished=lambda done: done and not decoding)
    sample = waiting._sample

    def decode(*args):
        decoding.append(True)
        try:
            return sample(*args)
        finally:
            decoding.clear()

    waiting._sample = decode
    r = waiting.generate(reference.PROMPTS, s, seeds=reference.SEEDS)
    assert len(rows_fed) == 27 and rows_fed[:len(fed_alone)] == fed_alone
    assert rows_fed[-1] == fed_alone[-1] > 0  # no compaction once every row has finished
    width = alone.completion_ids.shape[1]
    assert torch.equal(r.completion_ids[:, :width], alone.completion_ids) and r.texts == alone.texts
    assert (r.completion_ids[:, width:] == waiting.pad_id).all() and torch.equal(r.lengths, alone.lengths)
