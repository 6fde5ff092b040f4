"""Build the bundled tiny model: a character-level Qwen2 model warm-started on the built-in tasks.

    python scripts/build_tiny_model.py                 # writes grpo/assets/tiny-arith (a few minutes on 2 cores)

The warm start is supervised fine-tuning on the *train* split of the `mixed` task (the held-out split is never
seen). Each target is the problem's two-step working (`grpo.tasks.arithmetic.worked_solution`): with
probability --p-correct in the right order (" 2 * 6 = 12, 2 + 12 = 14"), otherwise with the grouping mistake
(" 2 + 2 = 4, 4 * 6 = 24"), drawn afresh every time an example is used. The model therefore learns to do
each step's arithmetic, but prefers the wrong grouping: greedy decoding is often wrong while sampling often
finds the right order. That is the situation GRPO is made for (it sharpens what the model can already
sample), and the default job shows it learning operator precedence. docs/tiny-model.md has the figures.

Seeded: the same arguments give the same weights on the same machine and thread count.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.envs import SingleTurn  # noqa: E402
from grpo.evaluation import evaluate  # noqa: E402
from grpo.rewards import last_number  # noqa: E402
from grpo.rollout import HFGenerator, Sampling  # noqa: E402
from grpo.tasks import load_builtin_task  # noqa: E402
from grpo.tasks.arithmetic import worked_solution  # noqa: E402
from grpo.tiny import TINY_MODEL_DIR, build_char_tokenizer, tiny_model_config  # noqa: E402


def batch(tok, examples, rng: random.Random, size: int, p_correct: float):
    """Prompt + working + EOS, loss on the working and EOS only."""
    rows = []
    for _ in range(size):
        e = rng.choice(examples)
        rows.append((tok.encode(e.prompt), tok.encode(worked_solution(e, correct=rng.random() < p_correct))
                     + [tok.eos_token_id]))
    return padded(tok, rows)


def padded(tok, rows: list[tuple[list[int], list[int]]]):
    """(ids, mask, labels) of (prompt, target) token lists, right-padded; labels -100 but on the targets."""
    size = len(rows)
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((size, width), tok.pad_token_id)
    labels = torch.full((size, width), -100)
    mask = torch.zeros(size, width, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        mask[i, :len(p) + len(c)] = 1
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
    return ids, mask, labels


def mixture(generator, examples, k: int, max_new_tokens: int) -> dict[str, float]:
    """Shares of sampled completions that are the right working, the grouping mistake, or anything else."""
    rollout = generator.generate([e.prompt for e in examples], Sampling(k, max_new_tokens, 1.0),
                                 seeds=list(range(len(examples))))
    right = wrong = 0
    for i, e in enumerate(examples):
        good, bad = worked_solution(e).strip(), worked_solution(e, correct=False).strip()
        for text in rollout.texts[i * k:(i + 1) * k]:
            right += text.strip() == good
            wrong += text.strip() == bad and bad != good
    n = len(examples) * k
    return {"right_order": right / n, "wrong_order": wrong / n, "other": 1 - (right + wrong) / n}


def warm_start(model, make_batch, *, steps: int, lr: float, warmup: int) -> float:
    """Supervised fine-tuning: `steps` AdamW steps on `make_batch(step)` -> (ids, mask, labels) under bfloat16
    autocast, linear warm-up then cosine decay to 5 %, gradients clipped at 1. Returns the seconds it took."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.1)

    def factor(step: int) -> float:  # linear warm-up, cosine decay to 5 %
        progress = min(1.0, step / steps)
        return min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    start = time.time()
    model.train()
    for step in range(1, steps + 1):
        ids, mask, labels = make_batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 100 == 0:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    return time.time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=TINY_MODEL_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--p-correct", type=float, default=0.4, help="share of targets worked in the right order")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="1 keeps the build reproducible and immune to other load")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="as rollout.max_new_tokens of the default job")
    ap.add_argument("--eval-size", type=int, default=0, help="held-out problems to measure on; 0: all")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    transformers.utils.logging.disable_progress_bar()
    tok = build_char_tokenizer()
    cfg = tiny_model_config(tok, hidden_size=args.hidden, num_hidden_layers=args.layers,
                            intermediate_size=4 * args.hidden, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.Qwen2ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    task = load_builtin_task("mixed", args.seed)
    print(f"{params:,} parameters; {len(task.train)} training problems, {len(task.eval)} held out", flush=True)

    sft_seconds = warm_start(model, lambda step: batch(tok, task.train, rng, args.batch_size, args.p_correct),
                             steps=args.steps, lr=args.lr, warmup=args.warmup)

    model.eval()
    generator = HFGenerator(model, tok)
    held_out = task.eval[:args.eval_size] if args.eval_size else task.eval
    held = evaluate(SingleTurn(), generator, held_out, last_number, max_new_tokens=args.max_new_tokens, pass_k=8,
                    temperature=1.0, seed=0)
    held.update(mixture(generator, held_out, 8, args.max_new_tokens))
    report = {"parameters": params, "sft_seconds": round(sft_seconds, 1), "threads": args.threads,
              "held_out": {k: round(v, 4) for k, v in held.items()}, "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    (args.out / "warmstart.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["held_out"], indent=2))
    print(f"saved to {args.out} ({(args.out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
