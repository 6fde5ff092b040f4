"""Packed training passes and decoding that drops finished rows, against today's padded passes and decoding.

Two long-tailed cases and one uniform one, each measured side by side in one run (the variants alternate):
- `smollm2_job`: SmolLM2-135M-Instruct (converted from its PyPI wheel, docs/smollm2.md) on a batch that the
  shipped job `smollm2_stories` samples itself: 8 stories prompts × 8 completions at temperature 0.7, at most 48
  new tokens, through the chat template. The lengths are the model's own (a real run's first step).
- `heavy_tail`: the 12.1 M-parameter, 32 000-token model of vs_trl's memory case (random init), 4 prompts × 8
  completions whose lengths are drawn as the issue asks: one in sixteen at 512 tokens, the others 16-64. The
  decoding runs with each row's limit at its length (EOS held back until then), so both decoders stop where the
  lengths say.
- `uniform`: the same 12.1 M model, every completion 64 tokens: packing must cost (almost) nothing here.

For each case: the seconds of the three training passes (the reference and old-policy passes without gradients,
the update's forward and backward) with `compute.packing` off and on, and the peak memory of a pass (the growth of
the process's resident-set high-water mark over the model and the batch, each variant in a fresh process); the
seconds of decoding the batch with the `hf` generator with and without dropping finished rows (`grpo.rollout.hf.
_COMPACT_AT = 0` keeps every row, today's decoding: the tokens are the same, checked here). Medians over
`--repeats` alternating runs after one warm-up pass.

    python benchmarks/packing.py                 # writes benchmarks/results/packing.{json,md}
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CASES = ("smollm2_job", "heavy_tail", "uniform")
SMALL = dict(vocab=32000, hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2)  # vs_trl's memory case


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(model_dir: str):
    from grpo.config import ModelConfig
    from grpo.models import load_model
    return load_model(ModelConfig(path=model_dir, autocast_bf16=False))


def make_batch(case: str, work: Path, repeats: int) -> dict:
    """The case's model directory, batch (saved to `work`), and the decoding seconds of both decoders."""
    import grpo.rollout.hf as hf
    from grpo.rollout import Sampling
    from grpo.rollout.hf import HFGenerator

    if case == "smollm2_job":
        from grpo.config import load_config
        from grpo.envs import prompt_formatter
        from grpo.packaged import packaged_model_dir
        from grpo.tasks import load_task
        cfg = load_config("smollm2_stories")
        model_dir = str(packaged_model_dir("smollm2-135m-instruct"))
        model, tok = _load(model_dir)
        render = prompt_formatter(tok, cfg.model)
        prompts = [render(e.prompt) for e in load_task(cfg.data, 0).train[:8]]
        sampling = Sampling(n=8, max_new_tokens=48, temperature=0.7)
        limits = None
        add_special = False
    else:
        from vs_trl import build_model
        model_dir = str(work / "model")
        build_model({**SMALL}, Path(model_dir))
        model, tok = _load(model_dir)
        rng = random.Random(0)
        if case == "heavy_tail":
            lengths = [512 if rng.random() < 1 / 16 else rng.randint(16, 64) for _ in range(32)]
            if 512 not in lengths:
                lengths[rng.randrange(32)] = 512
        else:
            lengths = [64] * 32
        words = ["Calculate 3 + 4 * 5 =", "What is 12 - 7 + 2 ?", "Solve y = 3x + 1 for x = 4", "Add 17 and 25:"]
        prompts = [words[i // 8] for i in range(32)]  # 4 prompts × 8, one row each so each has its own limit
        sampling = Sampling(n=1, max_new_tokens=max(lengths), temperature=1.0, min_new_tokens=max(lengths))
        limits = lengths
        add_special = True
    gen = HFGenerator(model, tok, add_special_tokens=add_special)
    seeds = list(range(len(prompts)))
    times = {"decode, every row": [], "decode, finished rows dropped": []}
    rollouts = {}
    for r in range(repeats + 1):  # the first of each is a warm-up
        for name, compact in (("decode, every row", 0.0), ("decode, finished rows dropped", None)):
            saved = hf._COMPACT_AT
            if compact is not None:
                hf._COMPACT_AT = compact
            try:
                start = time.perf_counter()
                rollouts[name] = gen.generate(prompts, sampling, seeds, limits)
                seconds = time.perf_counter() - start
            finally:
                hf._COMPACT_AT = saved
            if r:
                times[name].append(seconds)
    a, b = rollouts.values()
    same = torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    roll = b
    if case != "smollm2_job":  # lengths as drawn (EOS held back, each row stops at its limit)
        assert roll.completion_mask.sum(1).tolist() == limits, "rows did not stop at their limits"
    torch.save({"prompt_ids": roll.prompt_ids, "prompt_mask": roll.prompt_mask,
                "completion_ids": roll.completion_ids, "completion_mask": roll.completion_mask},
               work / f"{case}.pt")
    lengths = roll.completion_mask.sum(1)
    return {"model_dir": model_dir, "batch": str(work / f"{case}.pt"), "same_tokens": same,
            "rows": len(lengths), "prompt_tokens": int(roll.prompt_mask.sum()),
            "completion_tokens": int(lengths.sum()), "padded_width": int(lengths.max()),
            "lengths": sorted(lengths.tolist()),
            "params": sum(p.numel() for p in model.parameters()),
            "decode": {k: statistics.median(v) for k, v in times.items()}, "decode_runs": times}


def run_passes(model_dir: str, batch: str, packing: bool, repeats: int) -> dict:
    """In this process: the three passes over the batch, `repeats` times after a warm-up; seconds and peak."""
    from grpo.policy import LogprobModule, forward_path

    model, _ = _load(model_dir)
    b = torch.load(batch)
    path = forward_path(model, share_prompt=True, lean=True, packing=packing)
    module = LogprobModule(model, path)
    args = (b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"])
    kw = dict(temperature=1.0, chunk_size=1024)
    base = maxrss_mib()
    out: dict[str, list[float]] = {"reference": [], "old": [], "update": []}
    for r in range(repeats + 1):
        for name in ("reference", "old"):
            start = time.perf_counter()
            with torch.no_grad():
                module(*args, **kw)
            if r:
                out[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        logp = module(*args, **kw)
        (logp * b["completion_mask"]).sum().backward()
        model.zero_grad(set_to_none=True)
        if r:
            out["update"].append(time.perf_counter() - start)
    return {"packed": path.packing, "seconds": out, "peak_mib": maxrss_mib() - base}


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    print(json.dumps(run_passes(args.model_dir, args.batch, args.packing == "on", args.repeats)))


def machine() -> str:
    from vs_trl import machine as cpu  # the CPU's name, as vs_trl writes it
    return f"{cpu()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    p.add_argument("--out", default=str(HERE / "results" / "packing"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--batch", help=argparse.SUPPRESS)
    p.add_argument("--packing", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results = {"machine": machine(), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            work = Path(tmp) / case
            work.mkdir()
            info = make_batch(case, work, args.repeats)
            runs: dict[str, list[dict]] = {"off": [], "on": []}
            for _ in range(2):  # each variant twice, in fresh processes, alternating
                for packing in ("off", "on"):
                    cmd = [sys.executable, __file__, "--worker", "--model-dir", info["model_dir"], "--batch",
                           info["batch"], "--packing", packing, "--repeats", str(args.repeats),
                           "--threads", str(args.threads or torch.get_num_threads())]
                    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    runs[packing].append(json.loads(r.stdout.strip().splitlines()[-1]))
            passes = {}
            for packing, rs in runs.items():
                passes[packing] = {name: statistics.median(s for r in rs for s in r["seconds"][name])
                                   for name in ("reference", "old", "update")}
                passes[packing]["peak_mib"] = statistics.median(r["peak_mib"] for r in rs)
                passes[packing]["packed"] = all(r["packed"] for r in rs)
            results["cases"][case] = {**info, "passes": passes, "pass_runs": runs}
            print(json.dumps({case: {"decode": info["decode"], "passes": passes}}), flush=True)
    results["minutes"] = (time.perf_counter() - started) / 60
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


def markdown(res: dict) -> str:
    lines = [f"{res['machine']}; whole run {res['minutes']:.1f} min.", "",
             "| case | params | rows | completion tokens (padded width) | pass | padded s | packed s | speed-up |",
             "|---|---:|---:|---|---|---:|---:|---:|"]
    for case, c in res["cases"].items():
        off, on = c["passes"]["off"], c["passes"]["on"]
        for name in ("reference", "old", "update"):
            lines.append(f"| {case} | {c['params'] / 1e6:.1f} M | {c['rows']} | {c['completion_tokens']} "
                         f"({c['padded_width']}) | {name} | {off[name]:.3f} | {on[name]:.3f} | "
                         f"{off[name] / on[name]:.2f}× |")
        total_off = sum(off[n] for n in ("reference", "old", "update"))
        total_on = sum(on[n] for n in ("reference", "old", "update"))
        lines.append(f"| {case} | | | | **three passes** | {total_off:.3f} | {total_on:.3f} | "
                     f"**{total_off / total_on:.2f}×** |")
    lines += ["", "| case | peak MiB, padded | peak MiB, packed | ratio | decode s, every row | decode s, finished "
              "rows dropped | speed-up | same tokens |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for case, c in res["cases"].items():
        off, on = c["passes"]["off"], c["passes"]["on"]
        d = c["decode"]
        every, dropped = d["decode, every row"], d["decode, finished rows dropped"]
        lines.append(f"| {case} | {off['peak_mib']:.0f} | {on['peak_mib']:.0f} | {on['peak_mib'] / off['peak_mib']:.2f} "
                     f"| {every:.3f} | {dropped:.3f} | {every / dropped:.2f}× | {c['same_tokens']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
