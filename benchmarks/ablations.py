"""What each of our speed and memory choices is worth: our trainer with one choice switched off at a time.

Same models, prompts, step shapes and timing as `vs_trl.py` (seconds per step between reward calls, peak
resident memory of a fresh process), with the variants alternating in a rotated order `--repeats` times.

    python benchmarks/ablations.py      # writes benchmarks/results/ablations.{json,md} (or --out)
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
sys.path.insert(0, str(HERE))
import vs_trl  # noqa: E402

VARIANTS = {
    # case: {name: overrides}
    "1m": {
        "defaults (fp32)": [],
        "no prompt sharing in training": ["compute.share_prompt=false"],
        "1 thread": ["compute.threads=1"],
        "bf16 autocast": ["model.autocast_bf16=true"],
        "beta = 0 (no reference pass)": ["algo.beta=0"],
        "transformers' decoding steps": ["rollout.lean_decoding=false"],
        "transformers' training and reference forward": ["compute.lean_forward=false"],
    },
    "8m": {
        "defaults (fp32)": [],
        "no prompt sharing in training": ["compute.share_prompt=false"],
        "1 thread": ["compute.threads=1"],
        "bf16 autocast (eager attention)": ["model.autocast_bf16=true"],
        "bf16 autocast, sdpa attention": ["model.autocast_bf16=true", "model.attn_implementation=sdpa"],
        "bf16, no prompt sharing": ["model.autocast_bf16=true", "compute.share_prompt=false"],
        "bf16, transformers' decoding steps": ["model.autocast_bf16=true", "rollout.lean_decoding=false"],
        "bf16, transformers' training and reference forward": ["model.autocast_bf16=true",
                                                               "compute.lean_forward=false"],
    },
    "memory": {
        "defaults (fp32)": [],
        "micro_batch_tokens=2048": ["compute.micro_batch_tokens=2048"],
    },
}


def worker(case_name: str, overrides: list[str], model_dir: Path, prompts: Path) -> None:
    """One run of our trainer with vs_trl's settings for the case, then `overrides` (later keys win)."""
    case = vs_trl.CASES[case_name]
    clock = vs_trl.StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        vs_trl.run_grpo(case, model_dir, prompts, False, "", Path(tmp), clock, overrides)
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])][case["warmup"]:]
    json.dump({"step_seconds": gaps, "peak_rss_mib": vs_trl.maxrss_mib()}, sys.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results" / "ablations")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        case, overrides, model_dir, prompts = args.worker
        return worker(case, json.loads(overrides), Path(model_dir), Path(prompts))

    import torch
    res = {"machine": vs_trl.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(), "cases": {}}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        vs_trl.write_prompts(prompts)
        for name in args.cases.split(","):
            case = vs_trl.CASES[name]
            model_dir = Path(tmp) / name
            vs_trl.build_model(case, model_dir)
            variants = list(VARIANTS[name])
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for rep in range(min(args.repeats, case.get("max_repeats", args.repeats))):
                for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:
                    run = subprocess.run([sys.executable, __file__, "--worker", name, json.dumps(VARIANTS[name][v]),
                                          str(model_dir), str(prompts)], capture_output=True, text=True, cwd=tmp)
                    if run.returncode != 0:
                        sys.exit(f"{name} / {v} failed:\n{run.stderr[-4000:]}")
                    r = json.loads(run.stdout.strip().splitlines()[-1])
                    runs[v].append(r)
                    print(f"{name:>6} rep {rep + 1} {v}: {statistics.median(r['step_seconds']):.3f} s/step, "
                          f"peak {r['peak_rss_mib']:.0f} MiB", flush=True)
            res["cases"][name] = {v: {"seconds_per_step": statistics.median(statistics.median(r["step_seconds"])
                                                                            for r in rs),
                                      "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
                                      "overrides": VARIANTS[name][v]} for v, rs in runs.items()}
    res["wall_seconds"] = time.time() - started
    lines = [f"{res['machine']}; torch {res['torch']}; {res['threads']} threads; medians of {args.repeats} "
             "alternating runs (at most 2 for the memory case).", "",
             "| case | variant | s/step | vs defaults | peak RSS (MiB) |", "|---|---|---:|---:|---:|"]
    for name, c in res["cases"].items():
        base = c["defaults (fp32)"]["seconds_per_step"]
        for v, r in c.items():
            lines.append(f"| {name} | {v} | {r['seconds_per_step']:.3f} | {r['seconds_per_step'] / base:.2f}× | "
                         f"{r['peak_rss_mib']:.0f} |")
    md = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
