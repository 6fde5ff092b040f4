"""The vLLM server backend on this machine (rollout.backend=vllm_server):

1. seconds per weight sync for the bundled model's shape (1 M), SmolLM2-135M and Qwen2-0.5B's shape (494 M,
   random), on one local server, through both CPU routes in turn: vLLM's weight-transfer protocol with grpo's
   gloo engine (vllm_server.weight_transfer=gloo: pause, a broadcast the server loads layer by layer, resume)
   and the file route (weight_transfer=file: the trainer writes safetensors to /dev/shm, the server reloads
   them in place); medians of --syncs syncs each, the routes alternating;
2. one whole training step of the SmolLM2 job (smollm2_stories in float32: bf16 is emulated on this CPU),
   colocated (rollout.backend=vllm) against a launched server (vllm_server, weight_transfer auto: gloo), the
   backends alternating --repeats times: medians of steps 2..N of seconds per step, collecting (sampling and
   scoring) and weight sync. With a server the trainer process waits during sampling and the sync: its idle
   share is their share.

    python benchmarks/vllm_server.py    # writes benchmarks/results/vllm_server.{json,md}
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
sys.path.insert(0, str(HERE))
import rollout_engines  # noqa: E402
import vllm_step  # noqa: E402

OUT = HERE / "results" / "vllm_server"


def sync_seconds(name: str, model_dir: Path, syncs: int, tmp: Path) -> dict:
    import torch

    from grpo.config import load_config
    from grpo.models import load_model
    from grpo.rollout.vllm_server import VLLMServerGenerator

    common = [f"model.path={model_dir}", "rollout.backend=vllm_server", "vllm.kv_cache_gib=1", "vllm.max_model_len=512"]
    model, tok = load_model(load_config(None, common).model)
    started = time.perf_counter()
    gloo = VLLMServerGenerator(model, tok, cfg=load_config(None, [*common, "vllm_server.launch=1",
                                                                "vllm_server.weight_transfer=gloo"]),
                               run_dir=tmp / f"logs-{name}")
    start_s = time.perf_counter() - started
    file = None
    try:
        file = VLLMServerGenerator(model, tok, cfg=load_config(None, [
            *common, f"vllm_server.urls=[{gloo.clients[0].url}]", "vllm_server.weight_transfer=file"]))
        assert (gloo.transfer, file.transfer) == ("gloo", "file")
        times: dict[str, list[float]] = {"gloo": [], "file": []}
        for i in range(2 * syncs):
            with torch.no_grad():  # new weights each time, as after a step
                for p in model.parameters():
                    p.mul_(1.0001)
            gen = (gloo, file)[i % 2]
            t = time.perf_counter()
            gen.sync_weights(model)
            times[gen.transfer].append(time.perf_counter() - t)
    finally:
        if file is not None:
            file.close()
        gloo.close()
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "parameters": params, "start_seconds": start_s, "syncs": times,
            "median": {k: statistics.median(v) for k, v in times.items()}}


def step_job(out: Path, backend: str, args) -> list[str]:
    return [sys.executable, "-m", "grpo", "train", "smollm2_stories", "model.autocast_bf16=false",
            f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}", f"rollout.backend={backend}",
            "vllm.kv_cache_gib=2", "vllm.max_model_len=512", "eval.every=0", "eval.size=4", "log.progress=false",
            "log.trackers=[]", "log.chart=false", f"train.output_dir={out}", "train.overwrite=true"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=5, help="syncs per model; 0 keeps the results file's sync figures")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of the step comparison per backend; 0 keeps the results file's step figures")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from grpo.packaged import packaged_model_dir

    result: dict = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "sync": [], "step": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        kept = json.loads(args.out.with_suffix(".json").read_text()) if not (args.syncs and args.repeats) else {}
        if not args.syncs:
            result["sync"] = kept["sync"]
        if not args.repeats:
            result["step"] = kept.get("step", {})
        for name in ("1m", "smollm2-135m", "500m") if args.syncs else ():
            if name == "smollm2-135m":
                model_dir = packaged_model_dir("smollm2-135m-instruct")
            else:
                model_dir = tmp / name
                rollout_engines.build_model(name, model_dir)
            result["sync"].append(sync_seconds(name, model_dir, args.syncs, tmp))
            print(result["sync"][-1], file=sys.stderr)
        runs: dict[str, list[dict]] = {"vllm": [], "vllm_server": []}
        for i in range(args.repeats):
            for backend in list(runs)[::1 if i % 2 == 0 else -1]:
                out = tmp / f"{backend}-{i}"
                runs[backend].append(vllm_step.step_medians(step_job(out, backend, args), out, backend,
                                                            ("step_seconds", "rollout_seconds", "sync_seconds")))
                print(backend, runs[backend][-1], file=sys.stderr)
        if args.repeats:
            result["step"] = {"runs": runs, "median": {b: {k: statistics.median(r[k] for r in v) for k in v[0]}
                                                       for b, v in runs.items()}}
    lines = ["Seconds per weight sync to one local server, the routes alternating, medians of "
             f"{len(result['sync'][0]['syncs']['gloo'])} each (gloo: vLLM's weight-transfer protocol with grpo's gloo "
             "engine; file: safetensors in /dev/shm reloaded in place):", "",
             "| model | parameters | s / sync, gloo | s / sync, file | file / gloo | server start, s |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in result["sync"]:
        m = s["median"]
        lines.append(f"| {s['model']} | {s['parameters'] / 1e6:.1f} M | {m['gloo']:.2f} | {m['file']:.2f} | "
                     f"{m['file'] / m['gloo']:.2f} | {s['start_seconds']:.0f} |")
    if result["step"]:
        lines += step_table(result, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def step_table(result: dict, args) -> list[str]:
    lines = ["", f"One training step of the SmolLM2 job (smollm2_stories, float32, {args.prompts} prompts × 8, "
              f"48 tokens), medians of steps 2–{args.steps}:", "",
              "| backend | s / step | s collect | s sync | s learn (the rest) | collect + sync share |",
              "|---|---:|---:|---:|---:|---:|"]
    med = result["step"]["median"]
    for b, m in med.items():
        rest = m["step_seconds"] - m["rollout_seconds"] - m["sync_seconds"]
        share = (m["rollout_seconds"] + m["sync_seconds"]) / m["step_seconds"]
        lines.append(f"| {b} | {m['step_seconds']:.2f} | {m['rollout_seconds']:.2f} | {m['sync_seconds']:.2f} | "
                     f"{rest:.2f} | {share:.0%} |")
    lines.append(f"\nvllm_server / vllm per step: {med['vllm_server']['step_seconds'] / med['vllm']['step_seconds']:.2f}")
    return lines


if __name__ == "__main__":
    main()
