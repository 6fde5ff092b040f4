"""Build the bundled vision-language model: a Qwen2.5-VL-architecture model with a small vision tower, warm-started
on the built-in `shapes` task.

    python scripts/build_tiny_vision_model.py          # writes grpo/assets/tiny-vision (a few minutes on 2 cores)

Random initialisation, then supervised fine-tuning of the whole model (vision tower included) on the *train* split
of `shapes` (the held-out pictures are never seen). Each target is the count of squares of the colour asked for,
with probability --p-correct, else one more than the count ("miscounting"), drawn afresh every time an example is
used. The model so learns to see and count, but prefers to answer one too many: greedy answers are mostly wrong while
sampling often finds the right count. That is what GRPO sharpens, and `grpo train tiny_vision` shows it
(docs/vision.md has the figures).

Seeded: the same arguments give the same weights on the same machine and thread count.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from build_tiny_model import padded  # noqa: E402 - the same padding as the text model's warm start
from grpo.rollout import HFGenerator, Sampling  # noqa: E402
from grpo.tasks import load_builtin_task  # noqa: E402
from grpo.tiny import (TINY_VISION_DIR, build_vision_image_processor, build_vision_tokenizer,  # noqa: E402
                       tiny_vision_config)
from grpo.images import ImagePrompts, VisionPrompt, image_messages  # noqa: E402
from grpo.vision import join  # noqa: E402


def rendered(tok, example) -> VisionPrompt:
    text = tok.apply_chat_template(image_messages(example.prompt, example.images), tokenize=False,
                                   add_generation_prompt=True)
    return VisionPrompt(text, example.images)


def batch(tok, prompts: ImagePrompts, examples, rng: random.Random, size: int, p_correct: float):
    """Prompt + answer + EOS, right-padded; the loss on the answer and EOS only."""
    rows, images = [], []
    for _ in range(size):
        e = rng.choice(examples)
        ids, im = prompts.encode(rendered(tok, e))
        count = int(e.answer)
        answer = count if rng.random() < p_correct else count + 1
        rows.append((ids, tok.encode(f" {answer}") + [tok.eos_token_id]))
        images.append(im)
    return (*padded(tok, rows), join(images))


def accuracy(generator, tok, examples, temperature: float, k: int = 1) -> float:
    """Share of completions whose number is the count (greedy at temperature 0, else k samples each)."""
    prompts = [rendered(tok, e) for e in examples]
    r = generator.generate(prompts, Sampling(k, 4, temperature), seeds=list(range(len(prompts))))
    right = [t.strip() == e.answer for t, e in zip(r.texts, [e for e in examples for _ in range(k)])]
    return sum(right) / len(right)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=TINY_VISION_DIR)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--p-correct", type=float, default=0.35)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tok = build_vision_tokenizer()
    image_processor = build_vision_image_processor()
    config = tiny_vision_config(tok)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    prompts = ImagePrompts(tok, image_processor, config)
    task = load_builtin_task("shapes")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    start = time.time()
    model.train()
    for step in range(1, args.steps + 1):
        ids, mask, labels, images = batch(tok, prompts, task.train, rng, args.batch, args.p_correct)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, **images).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == 1:
            print(f"step {step}: loss {loss.item():.4f} ({time.time() - start:.0f} s)", flush=True)
    model.eval()
    generator = HFGenerator(model, tok, add_special_tokens=False, image_prompts=prompts)
    held = task.eval
    figures = {"greedy": accuracy(generator, tok, held, 0.0), "sampled": accuracy(generator, tok, held, 1.0, k=8),
               "train_seconds": round(time.time() - start, 1), **vars(args)}
    figures["out"] = str(figures["out"])
    print(json.dumps(figures))
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    image_processor.save_pretrained(args.out)
    (args.out / "build.json").write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
