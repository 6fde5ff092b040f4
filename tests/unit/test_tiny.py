"""The bundled tiny model and its character-level tokenizer."""
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
import transformers

from grpo.tiny import TINY_MODEL_DIR, build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Calculate 2 + 2 * 6 =", " 2 * 6 = 12, 2 + 12 = 14", "Solve y = 2x + 1 for x = 2, y =", "  two  spaces ",
         "tabs\tand\nnewlines", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"]


def test_character_tokenizer_round_trips_through_save_pretrained(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert len(ids) == len(text)  # one token per character, no BOS
        assert again.encode(text) == ids and again.decode(ids) == text
    assert again.pad_token_id != again.eos_token_id and again.eos_token == "<|endoftext|>"


@pytest.mark.skipif(not (TINY_MODEL_DIR / "model.safetensors").exists(), reason="not built")
def test_bundled_model_and_report():
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert all(tok.decode(tok.encode(t)) == t and tok.encode(t) == build_char_tokenizer().encode(t) for t in TEXTS)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert (TINY_MODEL_DIR / "model.safetensors").stat().st_size < 5 * 2**20
    held = json.loads((TINY_MODEL_DIR / "warmstart.json").read_text())["held_out"]
    assert 0.15 <= held["eval/accuracy"] <= 0.60                  # low greedy accuracy ...
    assert held["eval/pass@8"] >= held["eval/accuracy"] + 0.3      # ... but the right answer is often sampled


def run_script(monkeypatch, name: str, *argv: str) -> None:
    """scripts/<name> in this process, as `python scripts/<name> argv...` runs it, its thread count put back."""
    monkeypatch.setattr(sys, "argv", [name, *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))
    threads = torch.get_num_threads()
    try:
        runpy.run_path(str(ROOT / "scripts" / name), run_name="__main__")
    finally:
        torch.set_num_threads(threads)


def test_build_script_runs(tmp_path, monkeypatch):
    # small batches: the warm start's work is not what is tested here
    run_script(monkeypatch, "build_tiny_model.py", "--out", str(tmp_path), "--steps", "3", "--eval-size", "4",
               "--batch-size", "8")
    report = json.loads((tmp_path / "warmstart.json").read_text())
    assert report["parameters"] > 0 and "eval/pass@8" in report["held_out"]
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path) is not None


def test_bundled_reward_model_and_its_report():
    from grpo.tiny import TINY_RM_DIR
    model = transformers.AutoModelForSequenceClassification.from_pretrained(TINY_RM_DIR)
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1
    assert (TINY_RM_DIR / "model.safetensors").stat().st_size < 5 * 2**20
    report = json.loads((TINY_RM_DIR / "rm.json").read_text())
    # on completions the policy samples for held-out problems: mostly right about them, and it ranks a right
    # completion above a wrong one of the same problem far more often than its untrained head did
    assert report["held_out"]["accuracy"] >= 0.75 and report["held_out"]["pairwise"] >= 0.85
    assert report["held_out_before"]["pairwise"] < 0.6
    assert report["held_out_written"]["completions"] > 0  # and on written workings (the exploits it learnt from)


def test_reward_model_build_script_runs(tmp_path, monkeypatch):
    run_script(monkeypatch, "build_tiny_rm.py", "--out", str(tmp_path), "--prompts", "16", "--samples", "4",
               "--eval-prompts", "8", "--steps", "3", "--batch-size", "8")
    report = json.loads((tmp_path / "rm.json").read_text())
    assert report["held_out"]["completions"] == 32 and 0 <= report["held_out"]["accuracy"] <= 1
    assert transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).config.num_labels == 1
