"""Build the bundled tiny reward model (`rewards: [rm:tiny-rm]`): a character-level Qwen2 sequence classifier
that scores completions of the built-in arithmetic tasks, learnt from the bundled policy's own samples.

    python scripts/build_tiny_rm.py        # writes grpo/assets/tiny-rm (a few minutes on 2 cores)

An outcome reward model, a learnt verifier (as in "Training Verifiers to Solve Math Word Problems", Cobbe et al.
2021):
- data: the bundled policy (`tiny`) samples --samples completions at temperature 1 (as GRPO samples them) for
  each of --prompts problems of the *train* split of `mixed`, and each is labelled 1 when `last_number` says it
  is right, else 0. Beside them, --synthetic workings per problem that the policy rarely writes but a policy
  chasing the score finds (`synthetic`): the right working (1); a step's result off by a little, carried on (0);
  a final number off (0); and well-formed arithmetic on operands that are not the problem's (0). Trained on the
  policy's samples alone, a first version scored " 5 * 0 = 0, 5 * 0 = 0" above every right answer, and GRPO
  found that within 25 steps (docs/rewards.md#reward-models). The held-out split is never trained on;
- model: the policy's own transformer with a one-label head (`Qwen2ForSequenceClassification`, num_labels=1),
  so it starts from a network that already reads these problems, as reward models start from the SFT model;
- training: binary cross-entropy on the head's logit, which is then the reward (TRL's convention).
It reads prompt + completion as plain text (the char tokenizer has no chat template). Its held-out figures, on
completions the policy samples for held-out problems (and on written workings of them), go to
grpo/assets/tiny-rm/rm.json: the accuracy of "score > 0" against the label, and how often a right completion
outscores a wrong one of the same problem.

Seeded: the same arguments give the same weights on the same machine and thread count.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.rewards import last_number  # noqa: E402
from grpo.rollout import HFGenerator, Sampling  # noqa: E402
from grpo.tasks import load_builtin_task  # noqa: E402
from grpo.tiny import TINY_MODEL_DIR, TINY_RM_DIR  # noqa: E402


def labelled(generator, examples, samples: int, max_new_tokens: int, seed: int) -> list[tuple[str, float, int]]:
    """(prompt + completion, label, problem index) for `samples` completions of each example."""
    out = []
    for start in range(0, len(examples), 64):
        chunk = examples[start:start + 64]
        rollout = generator.generate([e.prompt for e in chunk], Sampling(samples, max_new_tokens, 1.0),
                                     seeds=[seed + start + i for i in range(len(chunk))])
        for i, e in enumerate(chunk):
            texts = rollout.texts[i * samples:(i + 1) * samples]
            ok = last_number([e.prompt] * samples, texts, [e.answer] * samples)
            out += [(e.prompt + t, y, start + i) for t, y in zip(texts, ok)]
    return out


def synthetic(example, rng: random.Random, count: int) -> list[tuple[str, float]]:
    """`count` workings of `example` (text after the prompt, label): the right one first, then wrong ones."""
    from grpo.tasks.arithmetic import worked_solution

    right = worked_solution(example)
    out = [(right, 1.0)]
    numbers = [int(x) for x in re.findall(r"-?\d+", right)]
    while len(out) < count:
        kind = rng.randrange(3)
        if kind == 0:  # the first step's result off by a little, carried into the second step
            t = numbers[2]
            wrong = t + rng.choice([-10, -2, -1, 1, 2, 10])
            first, _, second = right.partition(",")
            text = first.replace(f"= {t}", f"= {wrong}") + "," + second.replace(f" {t} ", f" {wrong} ", 1)
            a, op, b = re.findall(r"-?\d+|[-+*]", text.split(",")[1])[:3]
            text = text.rsplit("=", 1)[0] + f"= {_apply(int(a), op, int(b))}"
        elif kind == 1:  # the final number off
            text = right.rsplit("=", 1)[0] + f"= {numbers[-1] + rng.choice([-10, -3, -1, 1, 3, 10])}"
        else:  # right arithmetic on operands of no part of the problem
            a, b, c = rng.randrange(10), rng.randrange(10), rng.randrange(10)
            op1, op2 = rng.choice("+-*"), rng.choice("+-*")
            t = _apply(a, op1, b)
            text = f" {a} {op1} {b} = {t}, {t} {op2} {c} = {_apply(t, op2, c)}"
        ok = last_number([example.prompt], [text], [example.answer])[0]
        out.append((text, ok))
    return out


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def encode(tok, rows, device="cpu"):
    batch = tok([r[0] for r in rows], padding=True, return_tensors="pt")
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)


@torch.inference_mode()
def scores(model, tok, rows, batch_size: int = 256) -> torch.Tensor:
    model.eval()
    out = []
    for i in range(0, len(rows), batch_size):
        ids, mask = encode(tok, rows[i:i + batch_size])
        out.append(model(input_ids=ids, attention_mask=mask).logits[:, 0].float())
    return torch.cat(out)


def measure(model, tok, rows) -> dict[str, float]:
    """Accuracy of score > 0 against the labels; and over the problems with right and wrong completions, the
    share of (right, wrong) pairs the score orders correctly (ties count half)."""
    s, y = scores(model, tok, rows), torch.tensor([r[1] for r in rows])
    by: dict[int, list[int]] = {}
    for j, r in enumerate(rows):
        by.setdefault(r[2], []).append(j)
    won = pairs = 0.0
    for idx in by.values():
        good = [s[j] for j in idx if y[j] == 1]
        bad = [s[j] for j in idx if y[j] == 0]
        for g in good:
            for b in bad:
                won += 1.0 if g > b else 0.5 if g == b else 0.0
                pairs += 1
    return {"accuracy": ((s > 0).float() == y).float().mean().item(), "pairwise": won / max(pairs, 1),
            "positive_share": y.mean().item(), "completions": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=TINY_RM_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=2000, help="training problems the policy samples for")
    ap.add_argument("--samples", type=int, default=8, help="completions per problem")
    ap.add_argument("--synthetic", type=int, default=6, help="written workings per problem (`synthetic`)")
    ap.add_argument("--eval-prompts", type=int, default=400, help="held-out problems to measure on")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="as rollout.max_new_tokens of the default job")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    transformers.utils.logging.disable_progress_bar()
    task = load_builtin_task("mixed", args.seed)
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    policy = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    generator = HFGenerator(policy, tok)
    start = time.time()
    problems = rng.sample(task.train, args.prompts)
    train_rows = labelled(generator, problems, args.samples, args.max_new_tokens, 0)
    if args.synthetic:
        train_rows += [(e.prompt + text, y, i) for i, e in enumerate(problems) for text, y in synthetic(e, rng,
                                                                                                     args.synthetic)]
    eval_rows = labelled(generator, task.eval[:args.eval_prompts], args.samples, args.max_new_tokens, 10**6)
    eval_written = [(e.prompt + text, y, i) for i, e in enumerate(task.eval[:args.eval_prompts])
                    for text, y in synthetic(e, random.Random(1), max(args.synthetic, 2))]
    sampled = time.time() - start
    print(f"{len(train_rows)} training completions ({sum(r[1] for r in train_rows) / len(train_rows):.1%} right), "
          f"{len(eval_rows)} held out, sampled in {sampled:.0f} s", flush=True)

    model = transformers.AutoModelForSequenceClassification.from_pretrained(TINY_MODEL_DIR, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    before = measure(model, tok, eval_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 40) * max(0.05, 1 - s / args.steps))
    start = time.time()
    for step in range(1, args.steps + 1):
        model.train()
        rows = rng.sample(train_rows, args.batch_size)
        ids, mask = encode(tok, rows)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor([r[1] for r in rows]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if step % 100 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    trained = time.time() - start
    after = measure(model, tok, eval_rows)
    written = measure(model, tok, eval_written)
    report = {"parameters": sum(p.numel() for p in model.parameters()), "sample_seconds": round(sampled, 1),
              "train_seconds": round(trained, 1), "threads": args.threads,
              "held_out_before": {k: round(v, 4) for k, v in before.items()},
              "held_out": {k: round(v, 4) for k, v in after.items()},
              "held_out_written": {k: round(v, 4) for k, v in written.items()},
              "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    (args.out / "rm.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"before": report["held_out_before"], "after": report["held_out"], "written": written},
                     indent=2))
    print(f"saved to {args.out} ({(args.out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
