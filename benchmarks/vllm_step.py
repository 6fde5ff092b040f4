"""One whole training step with each rollout engine: `hf` (grpo's lean decoding), `hf` with transformers'
forward (`rollout.lean_decoding=false`) and `vllm`, at a size and length where vLLM's rollouts beat
transformers' decoding (rollout_engines.py): the same `grpo train` job on a randomly initialised Qwen2 built
here, every completion exactly L tokens. Reports the median seconds per step and per rollout over the steps after the
first (which warms the kernels up), from each run's metrics.jsonl; the backends alternate `--repeats` times.

    python benchmarks/vllm_step.py     # 100m, 2 prompts × 8, L = 256: writes benchmarks/results/vllm_step.{json,md}
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import rollout_engines  # noqa: E402

OUT = HERE / "results" / "vllm_step"


BACKENDS = {"hf": ["rollout.backend=hf"], "hf transformers": ["rollout.backend=hf", "rollout.lean_decoding=false"],
            "vllm": ["rollout.backend=vllm"]}


def job(model_dir: Path, out: Path, backend: str, args) -> list[str]:
    # the grpo preset alone: the default job's dynamic sampling would redraw every all-zero group of a random model
    return [sys.executable, "-m", "grpo", "train", "presets/grpo", f"model.path={model_dir}", "data.task=arithmetic",
            f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.length}",
            f"rollout.min_new_tokens={args.length}", *BACKENDS[backend], "vllm.kv_cache_gib=2",
            "vllm.max_model_len=512", "eval.every=0", "eval.size=4", "eval.pass_k=0", "compute.threads=2",
            "log.progress=false", "log.trackers=[]", "log.chart=false", f"train.output_dir={out}", "train.overwrite=true"]


def step_medians(cmd: list[str], out: Path, name: str, keys: tuple[str, ...]) -> dict:
    """Run the `grpo train` command `cmd` (output in `out`) and return the medians of its perf/<key> figures over
    the steps after the first (which warms the kernels up); a failed run ends the benchmark with its error."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{name}: the run failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [x for x in rows if x["step"] >= 2]
    return {k: statistics.median(x[f"perf/{k}"] for x in rows) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="100m", choices=list(rollout_engines.MODELS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {b: [] for b in BACKENDS}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = rollout_engines.build_model(args.model, model_dir)
        for i in range(args.repeats):
            for backend in list(BACKENDS)[::1 if i % 2 == 0 else -1]:
                out = Path(tmp) / f"{backend}-{i}"
                runs[backend].append(step_medians(job(model_dir, out, backend, args), out, backend,
                                                  ("step_seconds", "rollout_seconds", "completion_tokens")))
                print(backend, runs[backend][-1], file=sys.stderr)
    med = {b: {k: statistics.median(r[k] for r in v) for k in v[0]} for b, v in runs.items()}
    result = {"model": args.model, "parameters": params, "settings": vars(args) | {"out": str(args.out)},
              "runs": runs, "median": med}
    lines = [f"Model {args.model} ({params / 1e6:.0f} M parameters, random), {args.prompts} prompts × G = "
             f"{args.group}, completions of exactly {args.length} tokens, medians of steps 2–{args.steps}:", "",
             "| backend | s / step | s rollout | s learn (the rest) |", "|---|---:|---:|---:|"]
    for b, m in med.items():
        lines.append(f"| {b} | {m['step_seconds']:.2f} | {m['rollout_seconds']:.2f} | "
                     f"{m['step_seconds'] - m['rollout_seconds']:.2f} |")
    for b in ("hf", "hf transformers"):
        lines.append(f"\nvllm / {b} per step: {med['vllm']['step_seconds'] / med[b]['step_seconds']:.2f}, "
                     f"rollout: {med['vllm']['rollout_seconds'] / med[b]['rollout_seconds']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
