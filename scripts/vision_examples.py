"""Held-out pictures of the `shapes` task with the bundled tiny-vision model's greedy answers before and after a
`grpo train tiny_vision` run: the pictures (drawn 4x larger) into docs/images, a markdown table on stdout for
docs/vision.md.

    python scripts/vision_examples.py runs/tiny-vision/model
"""
from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def answers(model_path: str, examples) -> list[str]:
    """The greedy completions (up to 4 tokens) of `model_path` to the examples, rendered as training renders them."""
    from grpo.config import ModelConfig
    from grpo.envs.single_turn import prompt_formatter
    from grpo.images import image_prompts_for
    from grpo.models import load_model
    from grpo.rollout import HFGenerator, Sampling

    cfg = ModelConfig(path=model_path, chat_template=True)
    model, tokenizer = load_model(cfg)
    render = prompt_formatter(tokenizer, cfg)
    generator = HFGenerator(model, tokenizer, add_special_tokens=False,
                            image_prompts=image_prompts_for(model, tokenizer, model_path))
    out = generator.generate([render(e.prompt, e.images) for e in examples], Sampling(1, 4, 0.0))
    return [t.strip() for t in out.texts]


def main() -> None:
    from PIL import Image

    from grpo.tasks.shapes import shape_examples
    from grpo.tiny import TINY_VISION_DIR

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trained", help="the trained run's model directory (RUN_DIR/model)")
    ap.add_argument("--count", type=int, default=6, help="held-out pictures to show")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="where the pictures go")
    args = ap.parse_args()
    held = shape_examples()[1]
    picked = held[:: max(1, len(held) // args.count)][: args.count]  # spread over the held-out scenes, always the same
    before, after = answers(str(TINY_VISION_DIR), picked), answers(args.trained, picked)
    args.out.mkdir(parents=True, exist_ok=True)
    print("| picture | question | answer | before (tiny-vision) | after (40 steps) |")
    print("|---|---|---:|---:|---:|")
    for k, (e, b, a) in enumerate(zip(picked, before, after)):
        name = f"vision-example-{k}.png"
        e.images[0].resize((128, 128), Image.NEAREST).save(args.out / name)
        mark = lambda s: f"{s} {'✓' if s == e.answer else '✗'}"  # noqa: E731
        print(f"| ![]({'images/' + name}) | {e.prompt} | {e.answer} | {mark(b)} | {mark(a)} |")


if __name__ == "__main__":
    main()
