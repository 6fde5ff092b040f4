"""How fast the LLM judge scores, and what a step of a judge-rewarded run spends waiting on it.

    python benchmarks/judge.py                  # SmolLM2-135M-Instruct on a local vLLM server (about 5 minutes)

1. Throughput: a local `vllm serve` of the judge model (judge.launch's), then --completions distinct completions
   of the default job's prompts scored at judge.concurrency 1, 4 and 16 in turn (the default template and
   token_prob parser), --repeats times each, alternating: completions scored per second, median over repeats.
2. A step: `grpo train rewards=[judge] judge.launch=true judge.model=smollm2-135m-instruct` shortened to --steps
   steps (the tiny model; no dynamic sampling, so each step scores exactly its 16 x 8 completions): per step, the
   seconds the judge took (judge/seconds) against the step's (perf/step_seconds).

Writes benchmarks/results/judge.json and judge.md (docs/rewards.md#llm-judges quotes the table).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from grpo.config import JudgeConfig, VLLMConfig, load_config  # noqa: E402
from grpo.rewards.calls import run  # noqa: E402
from grpo.rewards.judge import Judge, launch_judge  # noqa: E402
from grpo.tasks import load_builtin_task  # noqa: E402


def throughput(url: str, model: str, completions: int, repeats: int, levels: list[int]) -> dict[int, list[float]]:
    task = load_builtin_task("mixed", 0)
    examples = task.train[:completions]
    prompts = [e.prompt for e in examples]
    texts = [f" {e.answer}" if i % 2 else " 1 + 1 = 2" for i, e in enumerate(examples)]  # distinct requests
    out: dict[int, list[float]] = {c: [] for c in levels}
    run(Judge(JudgeConfig(model=model, url=url))(prompts=prompts[:8], completions=texts[:8]))  # warm-up
    for _ in range(repeats):
        for c in levels:
            j = Judge(JudgeConfig(model=model, url=url, concurrency=c, max_failure_frac=1.0))
            start = time.perf_counter()
            scores = run(j(prompts=prompts, completions=texts))
            seconds = time.perf_counter() - start
            assert scores.count(None) == 0, j.last_failure
            out[c].append(completions / seconds)
    return out


def step_figures(model: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        from grpo.trainer import train
        cfg = load_config(None, ["rewards=[judge]", "judge.launch=true", f"judge.model={model}",
                                 f"train.output_dir={out}", f"train.steps={steps}", "algo.dynamic_sampling=false",
                                 "eval.every=0", "eval.size=16", "eval.pass_k=0", "log.progress=false",
                                 "log.trackers=[]", "log.chart=false", "vllm.kv_cache_gib=0.5"])
        train(cfg)
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "step_seconds": r["perf/step_seconds"], "judge_seconds": r["judge/seconds"],
             "requests": r["judge/requests"], "failures": r["judge/failures"]} for r in rows[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--completions", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as logs:
        started = time.perf_counter()
        server = launch_judge(JudgeConfig(model=args.model, launch=True), run_dir=Path(logs),
                              vllm_cfg=VLLMConfig(kv_cache_gib=0.5))
        start_seconds = time.perf_counter() - started
        try:
            rates = throughput(server.url + "/v1", args.model, args.completions, args.repeats, args.levels)
        finally:
            server.stop()
    steps = step_figures(args.model, args.steps)
    result = {"model": args.model, "completions": args.completions, "server_start_seconds": round(start_seconds, 1),
              "per_second": {str(c): [round(x, 2) for x in v] for c, v in rates.items()}, "steps": steps}
    (HERE / "results" / "judge.json").write_text(json.dumps(result, indent=1) + "\n")
    base = statistics.median(rates[args.levels[0]])
    lines = [f"The judge ({args.model} on a local vLLM server, token_prob, the default template) scoring "
             f"{args.completions} distinct completions; median of {args.repeats} alternating repeats.", "",
             "| judge.concurrency | completions per second | against concurrency " f"{args.levels[0]} |",
             "|---:|---:|---:|"]
    for c in args.levels:
        m = statistics.median(rates[c])
        lines.append(f"| {c} | {m:.1f} | {m / base:.2f}x |")
    js = [s["judge_seconds"] for s in steps[1:]] or [s["judge_seconds"] for s in steps]
    ss = [s["step_seconds"] for s in steps[1:]] or [s["step_seconds"] for s in steps]
    lines += ["", f"A step of the tiny model's job rewarded by this judge (128 completions, concurrency 8): "
                  f"{statistics.median(js):.1f} s waiting on the judge of {statistics.median(ss):.1f} s "
                  f"(median over steps 2-{len(steps)}); the server started in {start_seconds:.0f} s."]
    (HERE / "results" / "judge.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
