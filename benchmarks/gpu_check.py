"""The GPU check (run by benchmarks/gpu_check.sh on one CUDA GPU, with only torch and transformers there).

1. The trainer on CUDA in bf16, in one process that has joined an NCCL group: a few GRPO steps of a randomly
   initialised ~0.5 B Qwen2 (Qwen2-0.5B's shape) on the built-in arithmetic task. From its metrics: seconds
   per step, rollout seconds, and the MFU of the learning part (the reference forward plus the policy's forward
   and backward, 2N + 6N FLOPs per token, against the GPU's dense bf16 peak).
2. The `hf` backend's rollout tokens/s on the same model, with grpo's lean decoding loop and with transformers'
   forward, every completion exactly L tokens.

Writes one JSON file (argument 1). Nothing is downloaded: the model and its tokenizer are built here.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import rollout_engines  # noqa: E402

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, by name


def train_check(path: Path, params: int, out: Path) -> dict:
    import torch.distributed as td

    from grpo.config import load_config
    from grpo.distributed import Dist
    from grpo.trainer import train

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    td.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    x = torch.ones(4, device="cuda")
    td.all_reduce(x)
    assert x.tolist() == [1.0] * 4
    steps, prompts, group, length = 6, 16, 16, 128
    cfg = load_config(None, [f"model.path={path}", "model.device=cuda", "model.dtype=bfloat16",
                             "data.task=arithmetic", f"train.steps={steps}", f"train.prompts_per_step={prompts}",
                             f"rollout.group_size={group}", f"rollout.max_new_tokens={length}",
                             f"rollout.min_new_tokens={length}", "eval.every=0", "eval.size=64", "eval.pass_k=0",
                             "log.progress=false", "log.trackers=[]", "log.chart=false",
                             f"train.output_dir={out}", "train.overwrite=true", "compute.micro_batch_size=64"])
    start = time.perf_counter()
    train(cfg, dist=Dist(0, 1, 0, "nccl"))
    wall = time.perf_counter() - start
    td.destroy_process_group()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"perf/' in x]
    rows = rows[1:]  # the first step warms the kernels up
    step = statistics.median(r["perf/step_seconds"] for r in rows)
    rollout = statistics.median(r["perf/rollout_seconds"] for r in rows)
    tokens = statistics.median(r["perf/completion_tokens"] for r in rows)
    # compute.share_prompt (the default) runs each group's prompt once, in the reference and training passes;
    # "Calculate a + b * c =" is about 21 characters, one token each
    prompt_tokens = prompts * 21
    learn_flops = 8 * params * (tokens + prompt_tokens)  # reference 2N, policy forward 2N + backward 4N
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    learn = step - rollout
    return {"device": name, "steps": steps, "wall_seconds": wall, "step_seconds": step,
            "rollout_seconds": rollout, "learn_seconds": learn, "completion_tokens": tokens,
            "rollout_tokens_per_s_in_training": tokens / rollout,
            "learn_tflops": learn_flops / learn / 1e12,
            "learn_mfu": learn_flops / learn / peak if peak else None, "peak_flops": peak}


def rollout_check(path: Path) -> dict:
    from grpo.config import ModelConfig
    from grpo.models import load_model
    from grpo.rollout import HFGenerator, Sampling

    model, tok = load_model(ModelConfig(path=str(path), device="cuda", dtype="bfloat16"))
    prompts = ["Calculate 2 + 2 * 6 =", "Solve y = 2x + 1 for x = 2, y =", "Calculate 7 - 3 * 2 =",
               "Solve y = 3x - 4 for x = 5, y ="] * 4
    out = {}
    for lean in (True, False):
        gen = HFGenerator(model, tok, lean=lean)
        for g, length in ((8, 256), (16, 256)):
            s = Sampling(n=g, max_new_tokens=length, min_new_tokens=length)
            gen.generate(prompts[:2], Sampling(n=2, max_new_tokens=16), seeds=[0, 1])
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                r = gen.generate(prompts, s, seeds=list(range(len(prompts))))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            tokens = int(r.completion_mask.sum())
            out[f"{'lean' if lean else 'transformers'}|G={g}|L={length}"] = {
                "prompts": len(prompts), "tokens": tokens, "seconds": statistics.median(times),
                "tokens_per_s": tokens / statistics.median(times)}
    return out


def main() -> None:
    result_file = Path(sys.argv[1])
    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    import transformers
    info["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen2-0.5b-random"
        info["parameters"] = rollout_engines.build_model("500m", path, positions=1024)  # Qwen2-0.5B's shape
        info["rollout"] = rollout_check(path)
        result_file.write_text(json.dumps(info, indent=1))
        info["train"] = train_check(path, info["parameters"], Path(tmp) / "run")
    result_file.write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
