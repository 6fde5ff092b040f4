#!/usr/bin/env python
"""Build the bundled tiny model (grpo/assets/tiny-arith): a character-level Qwen2ForCausalLM, warm-started
by supervised fine-tuning on the *train* split of the built-in ``mixed`` task.

The warm start deliberately teaches a per-problem mixture of the correct rule and one systematic
misconception, so the model samples the right answer often (~p of the time) but its greedy answer is
usually the misconception. GRPO then has something to sharpen (see docs/tiny-model.md):

- arithmetic ``a op1 b op2 c``: the misconception groups the *other* pair first, i.e. if the correct
  evaluation is ``(a op1 b) op2 c`` it answers ``a op1 (b op2 c)`` and vice versa;
- linear ``y = a x ± b``: the misconception answers ``a * (x ± b)``.

Each time an example is drawn its target is the correct answer with probability ``--p-correct`` and the
misconception answer otherwise (the two coincide for e.g. ``a + b + c``). Loss is taken only on the
completion tokens, i.e. ``" " + answer`` followed by EOS. The held-out split is never trained on; it is
only measured at the end (greedy accuracy, pass@k at temperature 1, and the share of samples that are
correct / misconception / other), and the figures go to ``warmstart.json`` next to the weights.

Usage: python scripts/build_tiny_model.py            # rebuilds grpo/assets/tiny-arith with the defaults
       python scripts/build_tiny_model.py --out /tmp/x --steps 300 --val-fraction 0.1   # quick experiment
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import transformers  # noqa: E402

from grpo.tasks import load_builtin_task  # noqa: E402
from grpo.tasks.base import Example  # noqa: E402
from grpo.tiny import TINY_MODEL_DIR, build_char_tokenizer, tiny_model_config  # noqa: E402

_APPLY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
_INT = re.compile(r"-?\d+")


# ----------------------------------------------------------------------------------------------- data
def misconception_answer(ex: Example) -> str:
    """The answer under the systematic misconception the warm start mixes in (see module docstring)."""
    f = ex.fields
    if f["task"] == "arithmetic":
        a, b, c = f["operands"]
        op1, op2 = f["ops"]
        if op2 == "*" and op1 != "*":  # correct is a op1 (b * c): misconception groups (a op1 b) first
            return str(_APPLY[op2](_APPLY[op1](a, b), c))
        return str(_APPLY[op1](a, _APPLY[op2](b, c)))  # correct is (a op1 b) op2 c
    if f["task"] == "linear":
        inner = f["x"] + f["b"] if f["sign"] == "+" else f["x"] - f["b"]
        return str(f["a"] * inner)
    raise ValueError(f"no misconception for task {f.get('task')!r}")


def first_int(text: str) -> str | None:
    m = _INT.search(text)
    return str(int(m.group())) if m else None


def _hash_fraction(prompt: str, salt: str) -> float:
    h = int.from_bytes(hashlib.sha256((salt + prompt).encode()).digest()[:8], "big")
    return h / 2**64


class SFTData:
    """Per example two token sequences (prompt + " correct" + EOS, prompt + " misconception" + EOS), with
    labels only on the completion. `batch` draws examples without replacement (reshuffled every epoch) and
    picks the target afresh for every draw."""

    def __init__(self, examples: list[Example], tok, p_correct: float, gen: torch.Generator):
        self.p_correct, self.gen, self.n = p_correct, gen, len(examples)
        seqs, labels = [[], []], [[], []]
        for ex in examples:
            prompt_ids = tok(ex.prompt, add_special_tokens=False)["input_ids"]
            for k, ans in enumerate((ex.answer, misconception_answer(ex))):
                comp = tok(" " + ans, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                seqs[k].append(prompt_ids + comp)
                labels[k].append([-100] * len(prompt_ids) + comp)
        self.max_len = max(len(s) for k in (0, 1) for s in seqs[k])
        pad = tok.pad_token_id
        self.ids = torch.full((2, self.n, self.max_len), pad, dtype=torch.long)
        self.labels = torch.full((2, self.n, self.max_len), -100, dtype=torch.long)
        self.lens = torch.zeros((2, self.n), dtype=torch.long)
        for k in (0, 1):
            for i, (s, lab) in enumerate(zip(seqs[k], labels[k])):
                self.ids[k, i, : len(s)] = torch.tensor(s)
                self.labels[k, i, : len(lab)] = torch.tensor(lab)
                self.lens[k, i] = len(s)
        self._perm, self._pos, self.epoch = torch.randperm(self.n, generator=gen), 0, 0

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = []
        while len(idx) < size:
            take = self._perm[self._pos : self._pos + size - len(idx)]
            idx.extend(take.tolist())
            self._pos += len(take)
            if self._pos >= self.n:
                self._perm, self._pos = torch.randperm(self.n, generator=self.gen), 0
                self.epoch += 1
        idx = torch.tensor(idx)
        which = (torch.rand(size, generator=self.gen) >= self.p_correct).long()  # 0 correct, 1 misconception
        lens = self.lens[which, idx]
        width = int(lens.max())
        ids = self.ids[which, idx, :width]
        labels = self.labels[which, idx, :width]
        mask = (torch.arange(width)[None, :] < lens[:, None]).long()  # right padding
        return ids, labels, mask


# ----------------------------------------------------------------------------------------- measuring
@torch.no_grad()
def completion_probs(model, tok, examples: list[Example], batch_size: int = 256) -> torch.Tensor:
    """Exact model probability of the full correct and misconception completions (incl. EOS):
    a tensor [n, 2]. Cheap teacher-forced progress metric; no sampling noise."""
    model.eval()
    out = []
    for s in range(0, len(examples), batch_size):
        chunk = examples[s : s + batch_size]
        rows = []
        for k in (0, 1):
            seqs, starts = [], []
            for ex in chunk:
                p = tok(ex.prompt, add_special_tokens=False)["input_ids"]
                ans = ex.answer if k == 0 else misconception_answer(ex)
                c = tok(" " + ans, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                seqs.append(p + c)
                starts.append(len(p))
            width = max(map(len, seqs))
            ids = torch.full((len(seqs), width), tok.pad_token_id)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for i, sq in enumerate(seqs):
                ids[i, : len(sq)] = torch.tensor(sq)
                mask[i, : len(sq)] = 1
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            tgt = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            pos = torch.arange(width - 1)[None, :]
            keep = (pos >= torch.tensor(starts)[:, None] - 1) & (mask[:, 1:] == 1)
            rows.append((tgt * keep).sum(-1).exp())
        out.append(torch.stack(rows, -1))
    return torch.cat(out)


@torch.no_grad()
def generate_texts(model, tok, prompts: list[str], *, do_sample: bool, num_return: int = 1,
                   max_new_tokens: int = 6, temperature: float = 1.0, batch_size: int = 512) -> list[list[str]]:
    """Batched generation with left padding and an attention mask; stops at EOS. Returns, per prompt,
    `num_return` decoded completions (special tokens skipped)."""
    model.eval()
    tok.padding_side = "left"
    per_batch = max(1, batch_size // num_return)
    out: list[list[str]] = []
    for s in range(0, len(prompts), per_batch):
        enc = tok(prompts[s : s + per_batch], return_tensors="pt", padding=True, add_special_tokens=False)
        kw = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if do_sample else dict(do_sample=False)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, num_return_sequences=num_return,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        out.extend(texts[i : i + num_return] for i in range(0, len(texts), num_return))
    return out


def measure(model, tok, examples: list[Example], *, k: int, seed: int, max_new_tokens: int) -> dict:
    """Greedy accuracy, pass@k at temperature 1 (top-p 1, no top-k), share of samples correct /
    misconception (distinct from correct) / other, overall and per family; plus the exact expected
    figures from completion probabilities."""
    torch.manual_seed(seed)
    prompts = [e.prompt for e in examples]
    greedy = [g[0] for g in generate_texts(model, tok, prompts, do_sample=False, max_new_tokens=max_new_tokens)]
    samples = generate_texts(model, tok, prompts, do_sample=True, num_return=k, max_new_tokens=max_new_tokens)
    probs = completion_probs(model, tok, examples)
    fams: dict[str, list[int]] = {"all": list(range(len(examples)))}
    for i, e in enumerate(examples):
        fams.setdefault(e.fields.get("task", "?"), []).append(i)
    rows = []
    for i, e in enumerate(examples):
        mis = misconception_answer(e)
        got = [first_int(t) for t in samples[i]]
        n_c = sum(g == e.answer for g in got)
        n_m = 0 if mis == e.answer else sum(g == mis for g in got)
        pc, pm = probs[i].tolist()
        pm = 0.0 if mis == e.answer else pm
        rows.append(dict(greedy=first_int(greedy[i]) == e.answer, greedy_mis=mis != e.answer and first_int(greedy[i]) == mis,
                         passk=n_c > 0, c=n_c / k, m=n_m / k, pc=pc, pm=pm, coincide=mis == e.answer,
                         share_band=0.2 <= n_c / k <= 0.6))
    result = {}
    for fam, idx in fams.items():
        r = [rows[i] for i in idx]
        n = len(r)
        mean = lambda key: round(sum(float(x[key]) for x in r) / n, 4)  # noqa: E731
        result[fam] = {
            "n": n,
            "greedy_accuracy": mean("greedy"),
            "greedy_is_misconception": mean("greedy_mis"),
            f"pass@{k}": mean("passk"),
            "sample_correct": mean("c"),
            "sample_misconception": mean("m"),
            "sample_other": round(1 - mean("c") - mean("m"), 4),
            "misconception_coincides": mean("coincide"),
            "expected_correct": mean("pc"),
            "expected_misconception": mean("pm"),
            f"expected_pass@{k}": round(sum(1 - (1 - x["pc"]) ** k for x in r) / n, 4),
            "problems_sample_correct_in_[0.2,0.6]": mean("share_band"),
        }
    return result


def timings(model, tok, examples: list[Example], *, bf16: bool, batch: int = 128, new_tokens: int = 6) -> dict:
    """Seconds for one forward+backward (+AdamW step excluded) on `batch` sequences of about 36 tokens, and
    for generating `batch` x `new_tokens` tokens (sampling, EOS disabled so all tokens are produced)."""
    model.train()
    tok.padding_side = "left"
    prompts = [e.prompt for e in examples[:batch]]
    texts = [e.prompt + " " + e.answer for e in examples[:batch]]
    enc = tok(texts, return_tensors="pt", padding="max_length", max_length=36, add_special_tokens=False)
    fb = []
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**enc, labels=enc["input_ids"]).loss
        loss.backward()
        fb.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    model.eval()
    genc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    gt = []
    with torch.no_grad():
        for _ in range(3):
            t0 = time.perf_counter()
            model.generate(**genc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                           temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
            gt.append(time.perf_counter() - t0)
    return {"forward_backward_128x36_s": round(min(fb), 4), "forward_backward_128x36_autocast_bf16": bf16,
            "generate_128x6_s": round(min(gt), 4), "generate_dtype": "float32", "threads": torch.get_num_threads()}


# -------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=TINY_MODEL_DIR, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task", default="mixed")
    ap.add_argument("--p-correct", type=float, default=0.4, help="probability that a drawn example's target is the correct answer")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05, help="cosine decay floor, as a fraction of --lr")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=None, help="override hidden_size (default: grpo.tiny)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast for SFT (weights stay float32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--val-fraction", type=float, default=0.0,
                    help="carve this fraction of the train split off as a validation set for progress (experiments)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--k", type=int, default=8, help="samples per prompt for pass@k")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--no-save", action="store_true", help="measure only; write nothing")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    task = load_builtin_task(args.task, seed=args.seed)
    train = task.train
    val: list[Example] = []
    if args.val_fraction > 0:
        val = [e for e in train if _hash_fraction(e.prompt, "val") < args.val_fraction]
        train = [e for e in train if _hash_fraction(e.prompt, "val") >= args.val_fraction]
    monitor = val or train[:760]
    monitor_name = "val" if val else "train-sample"

    tok = build_char_tokenizer()
    overrides = {k: v for k, v in dict(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                         intermediate_size=args.intermediate, num_attention_heads=args.heads,
                                         num_key_value_heads=args.kv_heads).items() if v is not None}
    config = tiny_model_config(tok, **overrides)
    model = transformers.Qwen2ForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2ForCausalLM hidden={config.hidden_size} layers={config.num_hidden_layers} "
          f"intermediate={config.intermediate_size} heads={config.num_attention_heads}/{config.num_key_value_heads} "
          f"vocab={config.vocab_size} params={n_params:,}", flush=True)
    print(f"data: {len(train)} train examples ({len(val)} carved off for validation), "
          f"{len(task.eval)} held-out (never trained on); p_correct={args.p_correct}", flush=True)

    data = SFTData(train, tok, args.p_correct, gen)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    history = []
    t_start = time.perf_counter()
    run_loss, run_n = 0.0, 0
    for step in range(args.steps):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids, labels, mask = data.batch(args.batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run_loss += loss.item()
        run_n += 1
        last = step + 1 == args.steps
        if (step + 1) % 50 == 0 or last:
            elapsed = time.perf_counter() - t_start
            line = f"step {step + 1:5d}/{args.steps} epoch {data.epoch:3d} loss {run_loss / run_n:.4f} lr {lr_at(step):.2e} {elapsed:6.0f}s"
            if (step + 1) % args.eval_every == 0 or last:
                pr = completion_probs(model, tok, monitor)
                mis_differs = torch.tensor([misconception_answer(e) != e.answer for e in monitor])
                pc, pm = pr[:, 0], pr[:, 1] * mis_differs
                ent = {"step": step + 1, "elapsed_s": round(elapsed, 1), "loss": round(run_loss / run_n, 4),
                       "p_correct": round(pc.mean().item(), 4),
                       "p_correct_where_differs": round(pc[mis_differs].mean().item(), 4),
                       "p_mis_where_differs": round(pm[mis_differs].mean().item(), 4),
                       "p_either": round((pc + pm).mean().item(), 4)}
                history.append(ent)
                line += (f" | {monitor_name}: P(correct) {ent['p_correct']:.3f} P(c|differs) {ent['p_correct_where_differs']:.3f}"
                         f" P(mis|differs) {ent['p_mis_where_differs']:.3f} P(either) {ent['p_either']:.3f}")
            print(line, flush=True)
            run_loss, run_n = 0.0, 0
    sft_wall = time.perf_counter() - t_start
    print(f"SFT done in {sft_wall:.0f}s", flush=True)

    model.eval()
    t0 = time.perf_counter()
    figures = {"held_out": measure(model, tok, task.eval, k=args.k, seed=args.seed, max_new_tokens=args.max_new_tokens)}
    if val:
        figures["val"] = measure(model, tok, val, k=args.k, seed=args.seed, max_new_tokens=args.max_new_tokens)
    print(f"measured in {time.perf_counter() - t0:.0f}s", flush=True)
    for split, res in figures.items():
        for fam, r in res.items():
            print(f"{split:8s} {fam:10s} n={r['n']:4d} greedy {r['greedy_accuracy']:.3f} (mis {r['greedy_is_misconception']:.3f}) "
                  f"pass@{args.k} {r[f'pass@{args.k}']:.3f} samples c/m/o {r['sample_correct']:.3f}/"
                  f"{r['sample_misconception']:.3f}/{r['sample_other']:.3f} coincide {r['misconception_coincides']:.3f} "
                  f"E[c] {r['expected_correct']:.3f} E[m] {r['expected_misconception']:.3f}", flush=True)
    tm = timings(model, tok, task.eval, bf16=args.bf16)
    print(f"timings: {tm}", flush=True)

    report = {
        "model": {"architecture": "Qwen2ForCausalLM", "parameters": n_params,
                  **{k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                      "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                      "max_position_embeddings", "tie_word_embeddings")}},
        "sft": {"wall_time_s": round(sft_wall, 1), "steps": args.steps, "epochs": round(args.steps * args.batch_size / len(train), 2),
                "train_examples": len(train), "final_loss": history[-1]["loss"] if history else None, "history": history},
        "figures": figures,
        "timings": tm,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    if not args.no_save:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        model = model.float()
        model.generation_config.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                       bos_token_id=tok.eos_token_id)
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        st = out / "model.safetensors"
        report["model"]["safetensors_bytes"] = st.stat().st_size
        report["args"]["out"] = os.path.relpath(out, Path(__file__).resolve().parent.parent) if out.is_absolute() else str(out)
        (out / "warmstart.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"saved to {out} (model.safetensors {st.stat().st_size / 1e6:.2f} MB)", flush=True)
    return report


if __name__ == "__main__":
    main()
