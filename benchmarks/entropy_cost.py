"""What logging the policy's entropy every step costs: the training pass (forward + backward of the completion
log-probs, as `grpo.learn` runs it) with and without `entropy=True`, on the bundled tiny model and on
SmolLM2-135M-Instruct (a 49 152-token vocabulary, where the extra Σ p·z over each chunk of logits is largest).

The batch is one step of each model's shipped job: 16 prompts × 8 completions × 32 tokens for `tiny`, 8 prompts ×
8 completions × 48 tokens for SmolLM2 (its job runs bfloat16 autocast), prompts of 40 tokens, shared within a
group as in training, with the shipped compute settings (share_prompt, lean_forward, micro-batches of 64 rows,
log-prob chunks of 1024 positions). Both variants run in one process and alternate pass by pair (off, on, off,
on, ...) after a warm-up, so drift in the machine's speed hits both alike; the result is the median of each and
the median of the pairwise differences.

    python benchmarks/entropy_cost.py                  # writes benchmarks/results/entropy_cost.{json,md}
    python benchmarks/entropy_cost.py --pairs 3        # a quick look
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODELS = {
    # name: (model.path, autocast_bf16, prompts, group size, completion tokens)
    "tiny": ("tiny", False, 16, 8, 32),
    "smollm2-135m-instruct": ("smollm2-135m-instruct", True, 8, 8, 48),
}
PROMPT_TOKENS = 40
MICRO_BATCH = 64
CHUNK = 1024


def measure(name: str, pairs: int) -> dict:
    from grpo.config import ModelConfig
    from grpo.models import load_model
    from grpo.policy.forward import LogprobModule, forward_path

    path, bf16, prompts, group, tokens = MODELS[name]
    model, _ = load_model(ModelConfig(path=path, autocast_bf16=bf16))
    module = LogprobModule(model, forward_path(model, share_prompt=True, lean=True, autocast_bf16=bf16))
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    rows = prompts * group
    prompt_ids = torch.randint(3, vocab, (prompts, PROMPT_TOKENS), generator=g).repeat_interleave(group, 0)
    completion_ids = torch.randint(3, vocab, (rows, tokens), generator=g)
    ones_p, ones_c = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)

    def step(entropy: bool) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        for s in range(0, rows, MICRO_BATCH):
            mb = slice(s, s + MICRO_BATCH)
            out = module(prompt_ids[mb], ones_p[mb], completion_ids[mb], ones_c[mb], temperature=1.0,
                         chunk_size=CHUNK, entropy=entropy)
            logp = out[0] if entropy else out
            logp.mean().backward()
        return time.perf_counter() - start

    step(False), step(True)  # warm-up
    off, on = [], []
    for _ in range(pairs):
        off.append(step(False))
        on.append(step(True))
    diffs = [b - a for a, b in zip(off, on)]
    return {"model": name, "vocab": vocab, "rows": rows, "completion_tokens": tokens, "autocast_bf16": bf16,
            "off_seconds": off, "on_seconds": on, "off_median": statistics.median(off),
            "on_median": statistics.median(on), "diff_median": statistics.median(diffs)}


def table(results: list[dict], threads: int) -> str:
    lines = [f"The training pass (forward + backward of the completion log-probs) of one step of each shipped job, "
             f"without and with the per-token entropy; median of {len(results[0]['off_seconds'])} alternating "
             f"pairs; {threads} threads, torch {torch.__version__}, {platform.machine()}.", "",
             "| model | vocabulary | rows × tokens | without entropy (s) | with entropy (s) | "
             "median pairwise extra (s) | extra |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['vocab']} | {r['rows']} × {r['completion_tokens']} | "
                     f"{r['off_median']:.3f} | {r['on_median']:.3f} | {r['diff_median']:+.3f} | "
                     f"{100 * r['diff_median'] / r['off_median']:+.1f} % |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--pairs", type=int, default=10, help="alternating (without, with) pairs after the warm-up")
    p.add_argument("--name", default="entropy_cost", help="results file name under benchmarks/results/")
    args = p.parse_args()
    results = []
    for name in args.models:
        results.append(measure(name, args.pairs))
        print(f"{name}: {results[-1]['off_median']:.3f} s -> {results[-1]['on_median']:.3f} s", flush=True)
    out = HERE / "results"
    (out / f"{args.name}.json").write_text(json.dumps({"threads": torch.get_num_threads(), "runs": results},
                                                     indent=1))
    (out / f"{args.name}.md").write_text(table(results, torch.get_num_threads()))
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
