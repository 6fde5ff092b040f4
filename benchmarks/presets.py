"""Which preset learns best here: held-out accuracy against steps and against seconds for each algorithm preset
(and the AdamW β2 of TRL against ours), several seeds each, on the default job, on another built-in task, or on
another shipped job (`--job smollm2_stories`).

Each run is a shipped job (`grpo train tiny`, the default job, unless `--job`) with `algo.preset=<preset>`,
`train.seed=<seed>` and the preset's own dynamic sampling (on in dapo only; the default job's YAML turns it on),
one run at a time (never two at once: the seconds are part of the result). pass@k is not taken (`eval.pass_k=0`:
greedy accuracy is the measure, and sampling 8 completions per held-out problem would dominate the seconds;
evaluation has its own seeded generator, so this changes nothing in training). A variant is a preset plus
overrides, such as `grpo+b2` (`optim.adam_beta2=0.999`, TRL's default; ours is 0.99) or `grpo+ds` (DAPO's dynamic
sampling alone, `algo.dynamic_sampling=true`, the rest of the grpo preset kept).

    python benchmarks/presets.py                                   # the default job, every variant, seeds 0-2
    python benchmarks/presets.py --task linear --name presets_linear
    python benchmarks/presets.py --variants grpo grpo+ds --seeds 3 4 --add   # more runs into the same results
    python benchmarks/presets.py --job smollm2_stories --variants grpo grpo+ds --seeds 0 --name presets_smollm2
    python benchmarks/presets.py --smoke                           # 2 steps, one seed, written under --runs
    python benchmarks/presets.py --redraw                          # the table and chart again from the JSON
    python benchmarks/presets.py --variants vllm+ds async1 async1-coupled async2 async2-coupled async4 async4-coupled \
        --steps 60 --name async_staleness                                                       # docs/async.md
    python benchmarks/presets.py --job smollm2_stories --variants smol-sync smol-async1 smol-async2 smol-async4 \
        --steps 10 --seeds 0 --name async_staleness_smollm2                                     # docs/async.md

Writes benchmarks/results/<name>.json (every run's evaluations), <name>.md (the table) and <name>.png (mean
held-out accuracy over the seeds against steps and against seconds, one line per variant).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "grpo": ["algo.preset=grpo"],
    "grpo+b2": ["algo.preset=grpo", "optim.adam_beta2=0.999"],
    "grpo+ds": ["algo.preset=grpo", "algo.dynamic_sampling=true"],
    "dr_grpo": ["algo.preset=dr_grpo"],
    "dapo": ["algo.preset=dapo"],
    "gspo": ["algo.preset=gspo"],
    "cispo": ["algo.preset=cispo"],
    "sapo": ["algo.preset=sapo"],
    # the 2026 menu (SPEC 14), each the default job (grpo with dynamic sampling) with one change
    "dppo+ds": ["algo.preset=dppo", "algo.dynamic_sampling=true"],
    "maxrl": ["algo.preset=grpo", "algo.dynamic_sampling=true", "algo.scale=maxrl"],
    "gdpo": ["algo.preset=grpo", "algo.dynamic_sampling=true", "algo.multi_objective_aggregation=normalize_then_sum"],
    "luspo": ["algo.preset=grpo", "algo.dynamic_sampling=true", "algo.aggregation=luspo"],
    "entropy": ["algo.preset=grpo", "algo.dynamic_sampling=true", "algo.entropy_coef=0.005"],
    "spg2": ["algo.preset=grpo", "algo.dynamic_sampling=true", "train.steps_per_generation=2"],
    # asynchronous rollouts (rollout.max_staleness, docs/async.md): the default job on the colocated vLLM engine,
    # synchronous, then k = 1, 2, 4 with decoupled PPO (the default) and with the coupled clip (`-coupled`). The
    # asynchronous runs give the engine's thread and the trainer's one core each
    "vllm+ds": ["algo.preset=grpo", "algo.dynamic_sampling=true", "rollout.backend=vllm", "vllm.kv_cache_gib=0.25"],
    **{f"async{k}{suffix}": ["algo.preset=grpo", "algo.dynamic_sampling=true", "rollout.backend=vllm",
                             "vllm.kv_cache_gib=0.25", f"rollout.max_staleness={k}", "compute.threads=1", *extra]
       for k in (1, 2, 4) for suffix, extra in (("", []), ("-coupled", ["algo.proximal=behaviour"]))},
    # the engine in a process of its own (a server grpo launches), synchronous, then k = 1, 2 with one thread for
    # the trainer and one for the server (vllm.threads)
    "srv+ds": ["algo.preset=grpo", "algo.dynamic_sampling=true", "rollout.backend=vllm_server",
               "vllm.kv_cache_gib=0.25"],
    **{f"srv-async{k}": ["algo.preset=grpo", "algo.dynamic_sampling=true", "rollout.backend=vllm_server",
                         "vllm.kv_cache_gib=0.25", f"rollout.max_staleness={k}", "compute.threads=1", "vllm.threads=1"]
       for k in (1, 2)},
    # the same on the SmolLM2 job (`--job smollm2_stories`): its own preset (grpo, no dynamic sampling), the
    # colocated engine in float32 (docs/smollm2.md), k = 0, 1, 2, 4; both sides keep the job's threads (its steps
    # are mostly learning, which one thread would slow more than the overlap saves)
    **{f"smol-{'sync' if k == 0 else f'async{k}'}": ["algo.preset=grpo", "algo.dynamic_sampling=false",
                                                     "rollout.backend=vllm", "model.autocast_bf16=false",
                                                     f"rollout.max_staleness={k}"] for k in (0, 1, 2, 4)},
}
# the variants `--menu` runs: the 2026 menu against the default job, side by side on one machine
MENU = ["grpo+ds", "dppo+ds", "maxrl", "gdpo", "luspo", "entropy", "spg2"]


def variant_overrides(variant: str) -> list[str]:
    """The variant's overrides, with its preset's own `algo.dynamic_sampling` unless the variant sets it: a
    preset runs as its paper has it, whatever the job's YAML turns on (the default job has dynamic sampling)."""
    args = VARIANTS[variant]
    if not any(a.startswith("algo.dynamic_sampling=") for a in args):
        from grpo.config import AlgoConfig

        preset = next(a.partition("=")[2] for a in args if a.startswith("algo.preset="))
        args = [*args, f"algo.dynamic_sampling={str(AlgoConfig(preset=preset).dynamic_sampling).lower()}"]
    return args


def run(variant: str, seed: int, job: str, task: str | None, out: Path, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "grpo", "train", job, *variant_overrides(variant),
            *([f"data.task={task}"] if task else []),
            f"train.seed={seed}", f"train.output_dir={out}", "train.overwrite=true", "log.trackers=[]",
            "log.progress=false", "log.chart=false", "eval.pass_k=0", *extra]
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{variant} seed {seed} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [{"step": r["step"], "accuracy": r["eval/accuracy"], "seconds": r["perf/elapsed_seconds"]}
             for r in rows if r.get("eval/accuracy") is not None]
    return {"variant": variant, "seed": seed, "evals": evals, "wall_seconds": time.perf_counter() - start,
            "reward_last": rows[-1].get("reward/mean"),
            "step_seconds": [r["perf/step_seconds"] for r in rows if r["step"] > 0]}


def table(results: list[dict], task: str, steps: int, job: str = "tiny") -> str:
    by = {}
    for r in results:
        by.setdefault(r["variant"], []).append(r)
    # a time budget every variant reached: the shortest mean run, rounded down to 10 s
    budget = 10 * int(min(statistics.mean(r["evals"][-1]["seconds"] for r in runs) for runs in by.values()) // 10)
    what = "the tiny-model job (`grpo train tiny`" if job == "tiny" else f"the shipped job (`grpo train {job}`"
    lines = [f"Held-out greedy accuracy of {what}, task `{task}`, {steps} steps); "
             f"mean ± sd over the seeds. \"at {budget} s\": interpolated at that many seconds since the run began "
             "(evaluations included).", "",
             f"| variant | seeds | start | half-way | end | gain | at {budget} s | best seed end | seconds per run | "
             "s per step | steps/s vs first |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    first = None
    for variant, runs in by.items():
        start = [r["evals"][0]["accuracy"] for r in runs]
        end = [r["evals"][-1]["accuracy"] for r in runs]
        half = [min(r["evals"], key=lambda e: abs(e["step"] - steps / 2))["accuracy"] for r in runs]
        gain = [e - s for s, e in zip(start, end)]
        timed = [_at(r["evals"], budget) for r in runs]
        secs = [r["evals"][-1]["seconds"] for r in runs]
        # the training steps' own seconds (perf/step_seconds: waiting for the batch and learning from it, not the
        # evaluations), as steps per second against the first variant's
        per_step = [statistics.mean(r["step_seconds"]) for r in runs if r.get("step_seconds")]
        pace = statistics.mean(per_step) if per_step else None
        first = first or pace
        lines.append(f"| {variant} | {len(runs)} | {_ms(start)} | {_ms(half)} | {_ms(end)} | {_ms(gain, signed=True)} | "
                     f"{_ms(timed)} | {max(end):.3f} | {statistics.mean(secs):.0f} | "
                     f"{f'{pace:.3f}' if pace else '-'} | {f'{first / pace:.2f}x' if pace and first else '-'} |")
    return "\n".join(lines) + "\n"


def _at(evals: list[dict], seconds: float) -> float:
    """Accuracy at `seconds`, linearly interpolated between evaluations."""
    for a, b in zip(evals, evals[1:]):
        if a["seconds"] <= seconds <= b["seconds"]:
            w = (seconds - a["seconds"]) / max(b["seconds"] - a["seconds"], 1e-9)
            return a["accuracy"] + w * (b["accuracy"] - a["accuracy"])
    return evals[-1]["accuracy"] if seconds > evals[-1]["seconds"] else evals[0]["accuracy"]


def _ms(xs: list[float], signed: bool = False) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):+.3f} ± {sd:.3f}" if signed else f"{statistics.mean(xs):.3f} ± {sd:.3f}"


def chart(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    by = {}
    for r in results:
        by.setdefault(r["variant"], []).append(r)
    for variant, runs in by.items():
        steps = [e["step"] for e in runs[0]["evals"]]
        acc = [statistics.mean(r["evals"][i]["accuracy"] for r in runs) for i in range(len(steps))]
        secs = [statistics.mean(r["evals"][i]["seconds"] for r in runs) for i in range(len(steps))]
        axes[0].plot(steps, acc, marker="o", label=variant)
        axes[1].plot(secs, acc, marker="o", label=variant)
    axes[0].set(xlabel="step", ylabel="held-out accuracy (greedy), mean over seeds")
    axes[1].set(xlabel="seconds since the run began")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _job_task_steps(job: str, task: str | None, steps: int | None) -> tuple[str, int]:
    """The task and step count the runs used: the ones given, else the shipped job's."""
    from grpo.cli import resolve_config
    from grpo.config import load_config

    cfg = load_config(resolve_config(job))
    return task or cfg.data.task, steps or cfg.train.steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default="tiny", help="the shipped job to run (default: tiny, the default job)")
    p.add_argument("--task", default=None, help="data.task of the runs (default: the job's own; mixed for tiny)")
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="the variants to run (default: every one; with --menu, the 2026 menu's)")
    p.add_argument("--menu", action="store_true",
                   help="the 2026 menu (SPEC 14): " + ", ".join(MENU) + "; each differs from the default job "
                        "(grpo+ds) by one option")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: the job's own; 100 for tiny)")
    p.add_argument("--name", default="presets", help="results file name under benchmarks/results/")
    p.add_argument("--runs", default="/tmp/grpo-bench-presets", help="where the run directories go")
    p.add_argument("--smoke", action="store_true", help="2 steps, seed 0, evaluating on 8 examples")
    p.add_argument("--add", action="store_true",
                   help="merge these runs into the existing <name>.json (a variant and seed run again replaces its "
                        "old run) instead of starting it afresh")
    p.add_argument("--redraw", action="store_true", help="only rewrite <name>.md and <name>.png from <name>.json")
    args = p.parse_args()
    args.variants = args.variants or (MENU if args.menu else list(VARIANTS))
    if args.redraw:
        saved = json.loads((HERE / "results" / f"{args.name}.json").read_text())
        (HERE / "results" / f"{args.name}.md").write_text(table(saved["runs"], saved["task"], saved["steps"],
                                                                saved.get("job", "tiny")))
        chart(saved["runs"], HERE / "results" / f"{args.name}.png")
        return
    extra = [f"train.steps={args.steps}"] if args.steps else []
    if args.smoke:
        args.seeds, extra = [0], ["train.steps=2", "eval.size=8", "eval.pass_k=0", "eval.every=1"]
    task, steps = _job_task_steps(args.job, args.task, 2 if args.smoke else args.steps)
    out = Path(args.runs) if args.smoke else HERE / "results"  # a smoke run's table and chart stay out of the repo
    saved = None
    if args.add and (out / f"{args.name}.json").exists():  # checked before the runs, not after them
        saved = json.loads((out / f"{args.name}.json").read_text())
        if (saved.get("job", "tiny"), saved["task"], saved["steps"]) != (args.job, task, steps):
            raise SystemExit(f"{args.name}.json holds job {saved.get('job', 'tiny')}, task {saved['task']}, "
                             f"{saved['steps']} steps, not {args.job}, {task}, {steps}: not merged")
    results = []
    # seed by seed, every variant in turn: a machine whose speed drifts during the hours of a run (seen here: the
    # same job 85 s a run, then 125 s) slows every variant alike rather than the last ones
    for seed in args.seeds:
        for variant in args.variants:
            r = run(variant, seed, args.job, args.task, Path(args.runs) / f"{args.job}-{task}" / f"{variant}-s{seed}",
                    extra)
            results.append(r)
            print(f"{variant} seed {seed}: accuracy {r['evals'][0]['accuracy']:.3f} -> {r['evals'][-1]['accuracy']:.3f} "
                  f"in {r['wall_seconds']:.0f} s", flush=True)
    if saved:
        new = {(r["variant"], r["seed"]) for r in results}
        results = [r for r in saved["runs"] if (r["variant"], r["seed"]) not in new] + results
    order = list(VARIANTS)
    results.sort(key=lambda r: (order.index(r["variant"]), r["seed"]))
    (out / f"{args.name}.json").write_text(json.dumps({"job": args.job, "task": task, "steps": steps,
                                                      "runs": results}, indent=1))
    (out / f"{args.name}.md").write_text(table(results, task, steps, args.job))
    chart(results, out / f"{args.name}.png")
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
