"""Peak memory and time of token log-probs, forward + backward: plain vs chunked vs from hidden states.

Every variant starts from the last hidden states (B, T, H) and the output projection (V, H), as training
does, so every row pays for the projection: "plain" and "chunked" build the full (B, T, V) logits with one
matmul and then take log-probs from them; "from hidden" never builds them. Shape B=16, T=512, V=32000 (a
32 000-token vocabulary), as in the objective issue. Each variant runs in a
fresh subprocess; its peak is the growth of the process's resident-set high-water mark (ru_maxrss) over the
inputs it was given: the memory the computation needs, the gradients of its inputs included. Time is the median of
`--repeats` forward+backward passes after one warm-up.

    python benchmarks/logprobs_memory.py            # writes benchmarks/results/logprobs_memory.{json,md}
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
VARIANTS = {
    # name: (method, dtype, chunk_size)
    "fp32, plain": ("logits", "float32", None),
    "fp32, chunked 1024": ("logits", "float32", 1024),
    "fp32, from hidden 1024": ("hidden", "float32", 1024),
    "fp32, from hidden 256": ("hidden", "float32", 256),
    "bf16, plain": ("logits", "bfloat16", None),
    "bf16, chunked 1024": ("logits", "bfloat16", 1024),
    "bf16, from hidden 1024": ("hidden", "bfloat16", 1024),
    "bf16, from hidden 256": ("hidden", "bfloat16", 256),
}


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(name: str, b: int, t: int, v: int, h: int, repeats: int) -> dict:
    from grpo.algo import token_logprobs, token_logprobs_from_hidden

    kind, dtype, chunk = VARIANTS[name]
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    targets = torch.randint(0, v, (b, t))
    x = torch.randn(b, t, h, dtype=dtype).requires_grad_()
    w = (torch.randn(v, h, dtype=dtype) * h ** -0.5).requires_grad_()
    params = (x, w)
    if kind == "logits":
        fn = lambda: token_logprobs(x @ w.T, targets, chunk_size=chunk)  # noqa: E731
    else:
        fn = lambda: token_logprobs_from_hidden(x, w, targets, chunk_size=chunk)  # noqa: E731
    base = maxrss_mib()
    times = []
    for _ in range(repeats + 1):
        for p in params:
            p.grad = None  # the peak includes the inputs' gradients, which training needs anyway
        start = time.perf_counter()
        fn().sum().backward()
        times.append(time.perf_counter() - start)
    peak = maxrss_mib() - base
    return {"variant": name, "peak_extra_mib": round(peak, 1), "seconds": round(statistics.median(times[1:]), 3),
            "input_mib": round(sum(p.numel() * p.element_size() for p in params) / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=16)
    ap.add_argument("--t", type=int, default=512)
    ap.add_argument("--v", type=int, default=32000)
    ap.add_argument("--h", type=int, default=896, help="hidden size (Qwen2-0.5B's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=HERE / "results" / "logprobs_memory")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_one(args.one, args.b, args.t, args.v, args.h, args.repeats)))
        return
    rows = []
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--one", name, "--b", str(args.b), "--t", str(args.t), "--v", str(args.v),
               "--h", str(args.h), "--repeats", str(args.repeats), "--threads", str(args.threads)]
        row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(f"{name:28s} peak +{row['peak_extra_mib']:8.1f} MiB   {row['seconds']:.3f} s")
        rows.append(row)
    meta = {"shape": {"B": args.b, "T": args.t, "V": args.v, "H": args.h}, "threads": args.threads,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"B={args.b}, T={args.t}, V={args.v}, H={args.h}; output projection + log-probs, forward + "
             f"backward; {args.threads} threads, torch {torch.__version__}, {meta['cpu']}.", "",
             "| variant | inputs (MiB) | peak extra memory (MiB) | seconds |", "|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['input_mib']} | {r['peak_extra_mib']} | {r['seconds']} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
