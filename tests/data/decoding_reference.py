"""The reference rollouts of the in-process generator (`grpo.rollout.hf.HFGenerator`) on the bundled tiny model,
for tests/unit/test_decode_compaction.py.

    PYTHONPATH=. python tests/data/decoding_reference.py   # writes tests/data/decoding_reference.json

The JSON was written with the generator as it was before decoding dropped its finished rows (commit 0a7814d, on
an AMD EPYC CPU with AVX2, torch 2.13.0, 2 threads); the test reruns every case with the code of the day and asserts
the same completion ids, masks, truncation flags and texts, bit for bit. Each case names its settings: temperature
1 and greedy, min_new_tokens, a repetition penalty, stop strings, per-prompt limits, top-p and min-p; the lean steps
(float32: the attention as batched matmuls with an additive bias; float64: the model's kernel with a boolean key
mask) and transformers' forward (`lean: false`). Prompts of different lengths (left padding) with n > 1 completions
each, so that rows end at different steps. Rewrite the file only on purpose (a change that is meant to change the
tokens), and say so in the commit.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

PATH = Path(__file__).with_suffix(".json")
PROMPTS = ["Calculate 2 + 2 * 6 =", "Solve y = 2x + 1 for x = 2, y =", "Calculate 7 * 3 - 4 =", "Calculate 9 - 5 =",
           "Solve y = 3x - 2 for x = 4, y =", "Hi", "2+2"]
SEEDS = [11, 12, 13, 14, 15, 16, 17]

# name -> the case's settings: `sampling` (grpo.rollout.Sampling's fields), `lean`, `dtype`, `limits`
CASES = {
    "sample": dict(sampling=dict(n=4, max_new_tokens=28, temperature=1.0)),
    "greedy": dict(sampling=dict(n=2, max_new_tokens=28, temperature=0.0)),
    "min_new_tokens_penalty": dict(sampling=dict(n=3, max_new_tokens=28, temperature=1.0, min_new_tokens=14,
                                                 repetition_penalty=1.3)),
    "stop_strings": dict(sampling=dict(n=4, max_new_tokens=28, temperature=1.0, stop=[", ", "= 1"])),
    "limits": dict(sampling=dict(n=4, max_new_tokens=28, temperature=1.0), limits=[4, 28, 9, 17, 1, 12, 2]),
    "greedy_penalty_stop": dict(sampling=dict(n=1, max_new_tokens=28, temperature=0.0, repetition_penalty=1.2,
                                              stop=["+"])),
    "top_p_min_p_hot": dict(sampling=dict(n=4, max_new_tokens=28, temperature=1.6, top_p=0.9, min_p=0.05)),
    "hot": dict(sampling=dict(n=4, max_new_tokens=28, temperature=2.5)),
    "float64_key_mask": dict(sampling=dict(n=4, max_new_tokens=28, temperature=1.0, min_new_tokens=3),
                             dtype="float64", limits=[28, 20, 28, 6, 28, 9, 28]),
}
# the same settings on transformers' forward (the model's own cache)
CASES.update({f"{name}_transformers": dict(case, lean=False) for name, case in list(CASES.items())
              if name in ("sample", "greedy", "min_new_tokens_penalty", "stop_strings", "limits",
                          "float64_key_mask")})


def load_tiny(dtype: str = "float32"):
    """The bundled tiny model (float32 on the CPU, no autocast) and its tokenizer; float64 on request."""
    from grpo.config import ModelConfig
    from grpo.models import load_model
    model, tok = load_model(ModelConfig(path="tiny", device="cpu", autocast_bf16=False))
    return model.to(getattr(torch, dtype)), tok


def run_case(case: dict, model, tok):
    """The rollout of one case."""
    from grpo.rollout import HFGenerator, Sampling
    s = case["sampling"]
    sampling = Sampling(**{**s, "stop": tuple(s.get("stop", ()))})
    return HFGenerator(model, tok, lean=case.get("lean", True)).generate(PROMPTS, sampling, seeds=SEEDS,
                                                                         limits=case.get("limits"))


def record(rollout) -> dict:
    """What the JSON keeps of a rollout."""
    return {"completion_ids": rollout.completion_ids.tolist(), "completion_mask": rollout.completion_mask.tolist(),
            "truncated": rollout.truncated.tolist(), "texts": rollout.texts}


def main() -> None:
    models = {}
    out = {}
    for name, case in CASES.items():
        dtype = case.get("dtype", "float32")
        if dtype not in models:
            models[dtype] = load_tiny(dtype)
        out[name] = {"case": case, **record(run_case(case, *models[dtype]))}
        lengths = [sum(m) for m in out[name]["completion_mask"]]
        print(f"{name}: {len(lengths)} rows, lengths {lengths}")
    # one line per rollout field, rows side by side
    cases = [f"{json.dumps(name)}: {{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in fields.items())
             + "}" for name, fields in out.items()]
    PATH.write_text("{\n" + ",\n".join(cases) + "\n}\n")
    print(f"wrote {PATH}")


if __name__ == "__main__":
    main()
